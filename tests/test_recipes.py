"""The shipped recipes beyond the default: GSM8K on a real HF model (GPU; here it is loaded and
validated, and its data path checked end to end up to the reward) and GRPO on the embedded task.
(That every yaml in configs/ loads is tests/test_config.py::test_every_shipped_recipe_loads.)"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlflow.config import ConfigError, load_config, to_dataclass
from text_rewards import REWARD_FILE

REPO = Path(__file__).resolve().parents[1]
GSM8K = REPO / "configs" / "gsm8k_qwen2.5_0.5b.yaml"
GRPO = REPO / "configs" / "grpo.yaml"


def _preprocess_module():
    spec = importlib.util.spec_from_file_location("preprocess_gsm8k", REPO / "scripts" / "preprocess_gsm8k.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gsm8k_recipe_validates_for_8_gpus_with_vllm_and_fsdp2(monkeypatch):
    monkeypatch.delenv("RLFLOW_MODEL_PATH", raising=False)
    cfg = load_config(GSM8K)
    assert cfg.rollout.name == "vllm" and cfg.rollout.dtype == "bfloat16" and not cfg.rollout.enforce_eager
    assert cfg.actor.strategy == cfg.critic.strategy == "fsdp2"
    assert cfg.actor.dp_size == cfg.critic.dp_size == cfg.rollout.dp_size == 8
    assert cfg.algorithm.adv_estimator == "gae" and cfg.critic.enable and not cfg.reference.enable
    assert cfg.critic.ppo_mini_batch_size == cfg.actor.ppo_mini_batch_size  # inherited
    assert cfg.actor.loss_scale_factor == cfg.data.max_response_length == 512
    assert list(cfg.data.train_files) == ["data/gsm8k/train.parquet"]
    assert list(cfg.data.val_files) == ["data/gsm8k/test.parquet"]
    assert cfg.trainer.resume_mode == "auto" and cfg.trainer.save_freq > 0
    # the model folder is a placeholder the user sets; the interpolation survives load + validate
    assert cfg.actor.model.path == cfg.critic.model.path == "/models/Qwen2.5-0.5B-Instruct"
    assert OmegaConf.to_container(cfg.actor.model)["path"].startswith("${oc.env:RLFLOW_MODEL_PATH")


def test_gsm8k_model_path_comes_from_rlflow_model_path(monkeypatch, tmp_path):
    monkeypatch.setenv("RLFLOW_MODEL_PATH", str(tmp_path / "qwen"))
    cfg = load_config(GSM8K)
    typed = to_dataclass(cfg)  # what the driver builds the run from
    assert typed.actor.model.path == typed.critic.model.path == str(tmp_path / "qwen")


def test_gsm8k_recipe_scales_down_and_its_checks_still_apply():
    small = ["actor.dp_size=2", "critic.dp_size=2", "rollout.dp_size=2"]
    cfg = load_config(GSM8K, small)
    assert cfg.critic.dp_size == 2
    with pytest.raises(ConfigError, match="ppo_micro_batch_size_per_gpu"):
        load_config(GSM8K, ["actor.ppo_micro_batch_size_per_gpu=3"])


def test_gsm8k_preprocessed_rows_feed_the_recipes_reward(tmp_path):
    """preprocess_gsm8k.py output -> the recipe's prompt_key -> load_rows -> the built-in reward
    dispatched by data_source (openai/gsm8k): a right answer scores 1, a wrong one 0."""
    from rlflow.data.dataset import load_rows
    from rlflow.rewards import compute_score

    pre = _preprocess_module()
    sample = [
        {"question": "Tom has 3 apples and buys 4 more. How many apples?", "answer": "3 + 4 = 7\n#### 7"},
        {"question": "A box holds 1,200 pens; 200 are sold. How many are left?", "answer": "1200 - 200 = 1000\n#### 1,000"},
    ]
    rows = pre.convert_records([json.dumps(r) for r in sample], split="train")
    path = tmp_path / "data" / "gsm8k" / "train.parquet"
    pre.write_parquet_atomic(rows, str(path))
    cfg = load_config(GSM8K, [f"data.train_files=[{path}]"])
    loaded = load_rows(list(cfg.data.train_files), prompt_key=cfg.data.prompt_key)
    assert [r["data_source"] for r in loaded] == ["openai/gsm8k"] * 2
    truths = [r["reward_model"]["ground_truth"] for r in loaded]
    assert truths == ["7", "1000"]
    assert loaded[0][cfg.data.prompt_key][0]["role"] == "user"  # chat messages: the chat template applies
    ok = compute_score(loaded[1]["data_source"], "1200 - 200 = 1000 pens.\n#### 1000", truths[1])
    wrong = compute_score(loaded[0]["data_source"], "3 + 4 = 8\n#### 8", truths[0])
    assert _score(ok) == 1.0 and _score(wrong) == 0.0


def _score(result) -> float:
    return float(result["score"] if isinstance(result, dict) else result)


def test_grpo_recipe_is_grpo_with_kl_loss_and_no_critic():
    cfg = load_config(GRPO)
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.rollout.n == 8
    assert not cfg.critic.enable and cfg.reference.enable and cfg.actor.use_kl_loss
    assert cfg.actor.model.path == "tiny" and not cfg.data.train_files  # the embedded task
    assert (cfg.data.train_batch_size * cfg.rollout.n) % cfg.actor.ppo_mini_batch_size == 0



DAPO = REPO / "configs" / "dapo.yaml"


def test_dapo_recipe_is_dapo():
    cfg = load_config(DAPO)
    assert cfg.algorithm.adv_estimator == "grpo" and not cfg.critic.enable and not cfg.reference.enable
    assert cfg.actor.loss_agg_mode == "token-mean" and cfg.actor.clip_ratio_high > cfg.actor.clip_ratio_low
    assert cfg.algorithm.filter_groups.enable and cfg.algorithm.filter_groups.metric == "acc"
    assert cfg.reward.overlong_buffer.enable and cfg.reward.overlong_buffer.len < cfg.data.max_response_length
    assert cfg.actor.model.path == "tiny" and not cfg.data.train_files  # the embedded task


def test_dapo_recipe_runs_two_steps(ray_session, tiny_model_dir, tmp_path):
    """The recipe on the random tiny model, at test sizes; it never answers right, so groups are
    kept by a reward that varies with the text (metric=score)."""
    from rlflow import RLFlow

    overrides = [f"actor.model.path={tiny_model_dir}", "data.train_batch_size=4", "rollout.n=4",
                 "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size_per_gpu=4", "trainer.total_steps=2",
                 "trainer.test_freq=0", "trainer.val_before_train=false", "trainer.logger=[jsonl]",
                 f"trainer.default_local_dir={tmp_path}", "algorithm.filter_groups.metric=score",
                 f"reward.custom_function.path={REWARD_FILE}",
                 "reward.custom_function.name=exactness_score"]
    history = RLFlow(load_config(DAPO, overrides)).fit()
    assert [h["step"] for h in history] == [1, 2]
    assert all(h["rollout/num_gen_batches"] >= 1 and "reward/overlong_penalty_mean" in h for h in history)


CALC = REPO / "configs" / "calculator_agent.yaml"


def test_calculator_agent_recipe_runs_two_steps(ray_session, tiny_model_dir, tmp_path):
    """The recipe's environment and loop on the random tiny model at test sizes (the warm-started
    calc model takes minutes to build; the measured run is in docs/AGENTS.md)."""
    from rlflow import RLFlow

    cfg = load_config(CALC, [f"actor.model.path={tiny_model_dir}", "data.train_batch_size=4", "rollout.n=4",
                             "actor.ppo_mini_batch_size=16", "trainer.total_steps=2", "trainer.test_freq=0",
                             "trainer.val_before_train=false", "trainer.logger=[jsonl]",
                             f"trainer.default_local_dir={tmp_path}"])
    assert cfg.rollout.agent.env == "rlflow.agents.calculator:CalculatorEnv" and cfg.data.synthetic_task == "calc"
    history = RLFlow(cfg).fit()
    assert [h["step"] for h in history] == [1, 2] and all(h["agent/turns_mean"] >= 1 for h in history)


LONG = REPO / "configs" / "long_sequences.yaml"


def test_long_sequence_recipe_runs_one_step(ray_session, tiny_model_dir, tmp_path):
    """The recipe's layout (packed micro-batches split over sp=2 ranks, a token budget, gradient
    checkpointing, for the actor, the critic and the reference) on the random tiny model, whose
    sampled responses run long; at test sizes, on the short sort task (the warm-started sort_long
    model takes minutes)."""
    from rlflow import RLFlow

    assert load_config(LONG).data.synthetic_task == "sort_long"
    cfg = load_config(LONG, [f"actor.model.path={tiny_model_dir}", "data.synthetic_task=sort", "data.max_prompt_length=48",
                             "data.max_response_length=96", "actor.ppo_max_token_len_per_gpu=128",
                             "actor.use_kl_loss=true", "trainer.total_steps=1", "trainer.test_freq=0",
                             "trainer.val_before_train=false", "trainer.logger=[jsonl]",
                             f"trainer.default_local_dir={tmp_path}"])
    for role in ("actor", "critic", "reference"):
        assert cfg[role].sp_size == 2 and cfg[role].use_remove_padding, role
    assert cfg.actor.use_dynamic_bsz and cfg.actor.model.gradient_checkpointing and cfg.critic.model.gradient_checkpointing
    history = RLFlow(cfg).fit()
    assert [h["step"] for h in history] == [1]
    assert history[0]["response/length_mean"] > 10 and history[0]["actor/num_micro_batches"] >= 2
