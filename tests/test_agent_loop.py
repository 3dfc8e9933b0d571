"""The multi-turn agent loop (controllers/agent_loop.py) end to end: real Ray rollout workers, real
environments by file path, the tiny model. The ids the engine generated are the ids trained on,
byte for byte; observation tokens are in the trajectory (attention) but never in the mask."""

from __future__ import annotations

import os
import sys

import pytest
import ray.cloudpickle
import torch

from conftest import tiny_overrides
from rlflow import load_config
from workers.rollout.worker import RolloutWorker

ENVS = os.path.join(os.path.dirname(__file__), "agent_loop_envs.py")
R = 16  # data.max_response_length: room for up to 3 turns and 2 observations


class RecordingRollout(RolloutWorker):
    """Keeps every generate call's contexts and outputs (test only; pickled by value)."""

    def generate(self, batch, *args, **kwargs):
        out = super().generate(batch, *args, **kwargs)
        calls = getattr(self, "calls", [])
        for row in range(batch.batch_size[0]):
            context = batch["input_ids"][row][batch["attention_mask"][row].bool()].tolist()
            mask = out["response_mask"][row].bool()
            log_probs = out["rollout_log_probs"][row][mask].tolist() if "rollout_log_probs" in out.keys() else None
            calls.append((tuple(context), out["responses"][row][mask].tolist(), log_probs))
        self.calls = calls
        return out

    def recorded_calls(self):
        return getattr(self, "calls", [])


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """The tiny random model made to end its responses at varied lengths (exactness_helpers): turns
    end with EOS, so episodes reach their environments' turn counts."""
    from exactness_helpers import build_varied_length_model

    return build_varied_length_model(str(tmp_path_factory.mktemp("varied_length_model")))


def _config(model_dir, base, env="CountingEnv", **extra):
    values = {"rollout.agent.env": f"{ENVS}:{env}", "rollout.agent.max_turns": 3, "rollout.agent.num_workers": 0,
              "data.max_response_length": R, "algorithm.adv_estimator": "grpo", "trainer.default_local_dir": base,
              "trainer.record_rollouts": os.path.join(base, "rec"), "trainer.deterministic": True, **extra}
    return load_config(None, tiny_overrides(model_dir, **values))


def _segments(mask: list[int]) -> list[tuple[int, int, int]]:
    """(start, end, flag) runs of equal mask values."""
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((start, i, mask[start]))
            start = i
    return runs


@pytest.mark.parametrize("env", ["CountingEnv", "GreetingEnv"])
def test_trajectories_are_the_generated_ids_byte_for_byte(ray_session, model_dir, tmp_path, env):
    """Every model turn in the trained batch is exactly what the engine generated for that context
    (ids and log-probs), the observations between turns are the environment's text encoded once, the
    mask is 1 on model tokens only, the attention covers the whole trajectory, and the rewards sit
    on each turn's last token."""
    from transformers import AutoTokenizer

    from agent_loop_envs import observation_after, turns_of
    from controllers.rollout_source import read_recorded
    from trainers import CapturingTrainer

    class Trainer(CapturingTrainer):
        def train_step(self, step):
            metrics = super().train_step(step)
            self.calls = self.groups["rollout"].call_all("recorded_calls")[0]
            return metrics

    base = str(tmp_path / env)
    trainer = Trainer(_config(model_dir, base, env, **{"trainer.total_steps": 1}),
                      worker_classes={"rollout": RecordingRollout})
    history = trainer.fit()
    tok = AutoTokenizer.from_pretrained(model_dir)
    generated = {}
    for context, ids, log_probs in trainer.calls:
        generated.setdefault(context, []).append((ids, log_probs))
    batch = read_recorded(os.path.join(base, "rec"), 0).batch
    turn_counts = []
    for row in range(batch.batch_size[0]):
        width = batch["prompts"].shape[1]
        prompt = batch["prompts"][row][batch["attention_mask"][row, :width].bool()].tolist()
        length = int(batch["attention_mask"][row, width:].sum())
        ids = batch["responses"][row, :length].tolist()
        mask = batch["response_mask"][row, :length].tolist()
        # the trajectory is contiguous: attention 1 up to its length, nothing after it
        assert batch["attention_mask"][row, width : width + length].all()
        assert batch["response_mask"][row, length:].sum() == 0
        turns = [(s, e) for s, e, flag in _segments(mask) if flag == 1]
        if env == "GreetingEnv":
            assert ids[:2] == tok.encode("0>", add_special_tokens=False) and mask[:2] == [0, 0]
        for k, (start, end) in enumerate(turns):
            context = tuple(prompt + ids[:start])
            candidates = generated[context]
            assert any(out[: end - start] == ids[start:end] for out, _ in candidates), f"row {row} turn {k}: not generated"
            out, log_probs = next((o, lp) for o, lp in candidates if o[: end - start] == ids[start:end])
            assert torch.equal(batch["rollout_log_probs"][row, start:end], torch.tensor(log_probs[: end - start]))
            text = tok.decode(ids[start:end], skip_special_tokens=True)
            if k + 1 < len(turns):  # the observation that followed this turn
                following = tok.encode(observation_after(text, k + 1), add_special_tokens=False)
                assert ids[end : end + len(following)] == following, f"row {row}: observation {k + 1} differs"
                assert turns[k + 1][0] == end + len(following)
            # the step's reward is on the turn's last token; nothing elsewhere
            assert batch["token_level_scores"][row, end - 1] >= 0
        scored = batch["token_level_scores"][row].nonzero().flatten().tolist()
        assert set(scored) <= {end - 1 for _, end in turns}
        assert torch.all(batch["rollout_log_probs"][row][batch["response_mask"][row] == 0] == 0)
        turn_counts.append(len(turns))
        if length < R:  # the budget did not cut the episode: it lasted the env's turn count
            assert len(turns) == turns_of({"raw_prompt": tok.decode(prompt)}), f"row {row}"
    # turns_of decides the episode length, unless the budget ran out first
    assert len(set(turn_counts)) > 1, f"every trajectory has {turn_counts[0]} turns: no mix of turn counts"
    assert history[-1]["agent/turns_mean"] == pytest.approx(sum(turn_counts) / len(turn_counts))
    assert max(turn_counts) <= 3


def test_a_ppo_run_with_a_critic_and_validation(ray_session, model_dir, tmp_path):
    """PPO (GAE, a critic) with the agent loop and the environments in 2 Ray processes: validation
    runs whole episodes, the counts the update
    used are the model tokens only (BatchMeta of the masked batch), and acc comes from the env."""
    from controllers.rollout_source import read_recorded
    from trainers import CriticMetaTrainer

    base = str(tmp_path / "ppo")
    cfg = _config(model_dir, base, **{"algorithm.adv_estimator": "gae", "trainer.val_before_train": True,
                                           "rollout.agent.num_workers": 2,  # the Ray process pool
                                           "trainer.test_freq": 2, "actor.ppo_epochs": 1, "critic.ppo_epochs": 1})
    trainer = CriticMetaTrainer(cfg)
    history = trainer.fit()
    assert {"val/acc_mean", "val/score_mean"} <= set(history[0]) and "val/acc_mean" in history[-1]
    for step, metrics in enumerate(history[1:]):
        batch = read_recorded(os.path.join(base, "rec"), step).batch
        meta = trainer.seen_meta[step]
        assert sum(m.batch_num_tokens for m in meta) == int(batch["response_mask"].sum())
        holes = (batch["attention_mask"][:, batch["prompts"].shape[1]:] - batch["response_mask"]).sum()
        assert holes > 0, "no observation tokens: the test does not exercise mask holes"
        assert "reward/acc_mean" in metrics and metrics["response/length_mean"] == pytest.approx(
            batch["response_mask"].sum(-1).float().mean().item())


def test_agent_config_errors_name_the_key(tmp_path):
    from rlflow.config import ConfigError

    with pytest.raises(ConfigError, match="rollout.agent.env: algorithm.adv_estimator=remax"):
        load_config(None, [f"rollout.agent.env={ENVS}:CountingEnv", "algorithm.adv_estimator=remax"])
    with pytest.raises(ConfigError, match="rollout.agent.max_turns must be >= 1"):
        load_config(None, [f"rollout.agent.env={ENVS}:CountingEnv", "rollout.agent.max_turns=0"])
    from rlflow.agents import load_env_class

    with pytest.raises(AttributeError, match=r"rollout.agent.env=.*has no Missing"):
        load_env_class(f"{ENVS}:Missing")
    with pytest.raises(FileNotFoundError, match="rollout.agent.env="):
        load_env_class(f"{tmp_path}/nope.py:Env")
    with pytest.raises(TypeError, match="not a subclass of rlflow.agents.Environment"):
        load_env_class(f"{ENVS}:turns_of")


def test_one_step_stale_episodes_are_generated_by_the_weights_they_record(ray_session, model_dir, tmp_path):
    """trainer.max_staleness=1 with the agent loop: step t + 1's episodes run while step t updates,
    with the weights of the syncs before it (after t updates), which is the weight version the batch
    records. The engine's log-probs of every model token prove which weights generated it."""
    from async_helpers import STEPS, check_weight_versions
    from trainers import StepWeightsTrainer

    base = str(tmp_path / "stale")
    trainer = StepWeightsTrainer(_config(model_dir, base, **{"trainer.max_staleness": 1, "trainer.total_steps": STEPS}))
    history = trainer.fit()
    assert [h["rollout/staleness"] for h in history] == [0.0, 1.0, 1.0, 1.0]
    check_weight_versions(model_dir, os.path.join(base, "rec"), trainer.actor_versions, tol=1e-5, lag_min=1e-3)
