"""Environments from other libraries in the agent loop (rlflow/agents/adapters.py): a verifiers
SingleTurnEnv and MultiTurnEnv, and a gymnasium text Env, built from the libraries' own classes
(tests/agent_adapter_envs.py), stepped directly and in a 1-step fit through the environment pool."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import tiny_overrides
from rlflow import load_config
from rlflow.agents import load_env_class
from rlflow.agents.adapters import GymnasiumEnv, VerifiersEnv, verifiers_rows

ENVS = os.path.join(os.path.dirname(__file__), "agent_adapter_envs.py")
GUESS = "agent_adapter_envs:rlflow-test/Guess-v0"


def test_verifiers_rows_carry_the_library_dataset():
    rows = verifiers_rows(f"{ENVS}:single_turn")
    assert len(rows) == 8
    assert rows[0]["prompt"] == [{"role": "user", "content": "12+3="}]
    assert rows[0]["reward_model"] == {"ground_truth": "15"}
    assert rows[0]["extra_info"]["verifiers_input"]["answer"] == "15"
    assert rows[0]["data_source"] == "verifiers/SingleTurnEnv"


def test_verifiers_single_turn_env_scores_with_its_rubric():
    rows = verifiers_rows(f"{ENVS}:single_turn")
    env = VerifiersEnv(f"{ENVS}:single_turn")
    assert env.reset(rows[0]) == ""
    result = env.step("15")
    assert result.done and result.reward == pytest.approx(1.1)  # exact 1 + 0.1 per assistant turn
    assert result.info["exact"] == 1.0 and result.info["acc"] == 1.0
    assert result.info["stop_condition"] == "max_turns_reached"
    env.reset(rows[1])
    wrong = env.step("41")
    assert wrong.done and wrong.reward == pytest.approx(0.1) and wrong.info["acc"] == 0.0
    with pytest.raises(RuntimeError, match="before reset"):
        VerifiersEnv(f"{ENVS}:single_turn").step("1")


def test_verifiers_multi_turn_env_response_and_stop_conditions():
    rows = verifiers_rows(f"{ENVS}:multi_turn")
    env = VerifiersEnv(f"{ENVS}:multi_turn")
    env.reset(rows[0])
    first = env.step("abcd")  # env_response: the turn's length
    assert not first.done and first.observation == "=4" and first.reward == 0.0
    final = env.step("15")  # env_response sets final_env_response: the rollout ends, scored
    assert final.done and final.observation == ""
    assert final.reward == pytest.approx(1.2) and final.info["acc"] == 1.0
    assert final.info["stop_condition"] == "has_final_env_response" and final.info["num_turns"] == 2.0
    # the library's max_turns: the episode ends at its limit, scored
    capped = VerifiersEnv(f"{ENVS}:multi_turn", load_kwargs={"max_turns": 1})
    capped.reset(rows[1])
    only = capped.step("42")
    assert only.done and only.info["stop_condition"] == "max_turns_reached" and only.reward == pytest.approx(1.1)
    # an episode abandoned mid-way (rlflow's max_turns) is dropped when the env is reset
    env.reset(rows[2])
    env.step("x")
    env.reset(rows[3])
    assert env.step("ab").observation == "=2"
    # a ChatML model: the observation rendered with its role markers
    chatml = VerifiersEnv(f"{ENVS}:multi_turn", message_format="<|im_start|>{role}\n{content}<|im_end|>\n",
                          generation_prompt="<|im_start|>assistant\n")
    chatml.reset(rows[0])
    assert chatml.step("abc").observation == "<|im_start|>user\n=3<|im_end|>\n<|im_start|>assistant\n"


def test_gymnasium_text_env_maps_step_and_seeds_from_the_row():
    assert issubclass(load_env_class("rlflow.agents.adapters:GymnasiumEnv"), GymnasiumEnv)
    env = GymnasiumEnv(GUESS)
    row = {"source_prompt": {"prompt": "guess a digit"}, "ground_truth": "", "extra_info": {"seed": 3}}
    assert env.reset(row) == "guess"
    target = env.env.unwrapped.target
    results = [env.step(str(g)) for g in ([target] if target in (0, 9) else [0, 9, target])]
    last = results[-1]
    assert last.done and last.reward == 1.0 and last.info["acc"] == 1.0
    for r in results[:-1]:
        assert not r.done and r.observation in ("higher", "lower") and r.reward == 0.0
    # the same row plays the same game (replay); the registry's max_episode_steps truncates
    again = GymnasiumEnv(GUESS)
    again.reset(row)
    assert again.env.unwrapped.target == target
    wrong = str((target + 1) % 10)
    steps = [again.step(wrong) for _ in range(3)]
    assert [s.done for s in steps] == [False, False, True] and steps[-1].info["acc"] == 0.0
    with pytest.raises(TypeError, match="text observations"):
        GymnasiumEnv._check(3, "x")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """The tiny random model whose turns end with EOS at varied lengths (exactness_helpers)."""
    from exactness_helpers import build_varied_length_model

    return build_varied_length_model(str(tmp_path_factory.mktemp("adapter_model")))


def _fit(model_dir, base, env_values, **extra):
    from controllers.rollout_source import read_recorded
    from controllers.ppo import PPOTrainer

    values = {"rollout.agent.max_turns": 3, "data.max_response_length": 16, "algorithm.adv_estimator": "grpo",
              "trainer.default_local_dir": base, "trainer.record_rollouts": os.path.join(base, "rec"),
              "trainer.total_steps": 1, **env_values, **extra}
    history = PPOTrainer(load_config(None, tiny_overrides(model_dir, **values))).fit()
    return history, read_recorded(os.path.join(base, "rec"), 0).batch


def _turns(mask: list[int]) -> list[tuple[int, int]]:
    runs, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


@pytest.mark.timeout(300)
def test_verifiers_multi_turn_env_in_a_fit(ray_session, model_dir, tmp_path):
    """A verifiers MultiTurnEnv by import path in a 1-step GRPO fit (the environment pool in the
    driver: a pool process would import verifiers again, ~10 s on 2 cores; it runs the same):
    observations are env_response's text encoded once between the sampled turns (no loss on them),
    and the rubric's reward lands on the last turn's last token."""
    from transformers import AutoTokenizer

    history, batch = _fit(model_dir, str(tmp_path / "vf"), {
        "rollout.agent.env": "rlflow.agents.adapters:VerifiersEnv", "rollout.agent.env_kwargs.load": f"{ENVS}:multi_turn",
        "rollout.agent.num_workers": 0}, **{"data.synthetic_task": "add"})
    tok = AutoTokenizer.from_pretrained(model_dir)
    width = batch["prompts"].shape[1]
    complete = 0
    for row in range(batch.batch_size[0]):
        length = int(batch["attention_mask"][row, width:].sum())
        ids = batch["responses"][row, :length].tolist()
        mask = batch["response_mask"][row, :length].tolist()
        turns = _turns(mask)
        if len(turns) >= 2:  # the observation after the first turn: its length, as env_response wrote it
            start, end = turns[0]
            text = tok.decode(ids[start:end], skip_special_tokens=True)
            assert ids[end:turns[1][0]] == tok.encode(f"={len(text) % 10}", add_special_tokens=False)
        if len(turns) == 2 and ids[-1] == tok.eos_token_id:  # ended by the library: scored by the rubric
            complete += 1
            scores = batch["token_level_scores"][row]
            assert scores.nonzero().flatten().tolist() in ([turns[1][1] - 1], [])
            assert float(scores.sum()) == pytest.approx(0.2, abs=1e-6) or float(scores.sum()) == pytest.approx(1.2)
    assert complete > 0, "no episode reached the library's end"
    assert history[-1]["agent/turns_mean"] > 1.0


@pytest.mark.timeout(300)
def test_gymnasium_env_in_a_fit(ray_session, model_dir, tmp_path):
    """A registered gymnasium text Env in a 1-step fit (environments in the driver): the reset's
    observation follows the prompt, untrained; the hints follow wrong guesses."""
    from transformers import AutoTokenizer

    history, batch = _fit(model_dir, str(tmp_path / "gym"), {
        "rollout.agent.env": "rlflow.agents.adapters:GymnasiumEnv", "rollout.agent.env_kwargs.env_id": GUESS,
        "rollout.agent.num_workers": 0})
    tok = AutoTokenizer.from_pretrained(model_dir)
    first = tok.encode("guess", add_special_tokens=False)
    width = batch["prompts"].shape[1]
    for row in range(batch.batch_size[0]):
        ids = batch["responses"][row].tolist()
        assert ids[:len(first)] == first and batch["response_mask"][row, :len(first)].sum() == 0
    assert torch.isfinite(batch["token_level_scores"]).all() and width > 0
    assert "agent/turns_mean" in history[-1]


def test_openenv_environment_in_process():
    """An OpenEnv Environment (the class its servers serve) built from the library's classes: the
    action class comes from Environment[ActT, ObsT, StateT], the text fields from the models."""
    from rlflow.agents.adapters import OpenEnvEnv

    load = os.path.join(os.path.dirname(__file__), "agent_adapter_openenv.py") + ":ReverseEnvironment"
    env = OpenEnvEnv(load)
    row = {"source_prompt": {"prompt": "reverse"}, "ground_truth": "", "extra_info": {"seed": 1}}
    first = env.reset(row)
    word = first.removeprefix("reverse ")
    assert first.startswith("reverse ") and word
    miss = env.step("zz")
    assert (miss.observation, miss.reward, miss.done) == ("no", 0.0, False)
    hit = env.step(word[::-1])
    assert hit.done and hit.reward == 1.0 and hit.info == {"tries": 2, "acc": 1.0}
    again = OpenEnvEnv(load, load_kwargs={"tries": 1})
    assert again.reset(row) == first  # the row's seed: the same word (replay)
    lost = again.step("zz")
    assert lost.done and lost.reward == 0.0 and lost.info["acc"] == 0.0 and lost.observation == ""
    with pytest.raises(ValueError, match="no field 'msg'"):
        OpenEnvEnv(load, action_field="msg")


@pytest.mark.timeout(300)
def test_openenv_environment_in_a_fit(ray_session, model_dir, tmp_path):
    from transformers import AutoTokenizer

    load = os.path.join(os.path.dirname(__file__), "agent_adapter_openenv.py") + ":ReverseEnvironment"
    history, batch = _fit(model_dir, str(tmp_path / "openenv"), {
        "rollout.agent.env": "rlflow.agents.adapters:OpenEnvEnv", "rollout.agent.env_kwargs.load": load,
        "rollout.agent.num_workers": 0})
    tok = AutoTokenizer.from_pretrained(model_dir)
    reverse = tok.encode("reverse ", add_special_tokens=False)
    for row in range(batch.batch_size[0]):  # the reset's observation, after the prompt, untrained
        assert batch["responses"][row, :len(reverse)].tolist() == reverse
        assert batch["response_mask"][row, :len(reverse)].sum() == 0
    assert "agent/turns_mean" in history[-1]


def test_verifiers_calculator_plays_as_calculator_env():
    """configs/calculator_verifiers.yaml's environment (a verifiers MultiTurnEnv) gives the episodes
    of rlflow's CalculatorEnv: the same observations, rewards and acc for the same turns."""
    from rlflow.agents.calculator import CalculatorEnv
    from rlflow.data.synthetic import make_synthetic_rows

    row = make_synthetic_rows("calc", 1, seed=3, split="train")[0]
    a, b = row["prompt"].rstrip("=").split("+")
    rl_row = {"ground_truth": row["reward_model"]["ground_truth"], "data_source": row["data_source"],
              "extra_info": {}, "raw_prompt": row["prompt"], "source_prompt": {"prompt": row["prompt"]}}
    load = "rlflow.agents.examples.calculator_verifiers:load_environment"
    for turns in ([f"@{a}+{b}", row["reward_model"]["ground_truth"]], ["@1+", f"@{a}+{b}", "0"], ["12"]):
        ours, theirs = CalculatorEnv(), VerifiersEnv(load)
        assert ours.reset(rl_row) == theirs.reset(rl_row) == ""
        for turn in turns:
            want, got = ours.step(turn), theirs.step(turn)
            assert (got.observation, got.reward, got.done) == (want.observation, want.reward, want.done), turns
        assert got.info["acc"] == want.info["acc"]


def test_verifiers_tool_env_reads_hermes_tool_calls():
    """vf.ToolEnv reads the model's tool_calls: with tool_parser="hermes" a turn's <tool_call> JSON
    becomes one, the library calls the tool, and its tool message is the observation."""
    rows = verifiers_rows(f"{ENVS}:tools")
    env = VerifiersEnv(f"{ENVS}:tools", tool_parser="hermes")
    env.reset(rows[0])
    call = env.step('<tool_call>{"name": "add", "arguments": {"a": 12, "b": 3}}</tool_call>')
    assert not call.done and call.observation == "15"
    final = env.step("15")  # no call: the library's no_tools_called stop condition
    assert final.done and final.reward == 1.0 and final.info["total_tool_calls"] == 1.0
    assert final.info["stop_condition"] == "no_tools_called"
