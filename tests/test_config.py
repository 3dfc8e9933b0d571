"""Config loading: yaml + dotlist overrides, inherited values, and errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from tensordict import TensorDict

from rlflow.config import ConfigError, RLFlowConfig, load_config, to_dataclass

REPO = Path(__file__).resolve().parents[1]


def test_defaults_resolve_and_critic_inherits_the_actor():
    cfg = load_config(None, ["actor.loss_agg_mode=seq-mean-token-sum-norm", "actor.dp_size=2"])
    assert cfg.actor.loss_scale_factor == cfg.data.max_response_length  # a constant, not a padded width
    assert cfg.critic.loss_scale_factor == cfg.actor.loss_scale_factor  # the verl #6957 behaviour
    assert cfg.critic.loss_agg_mode == "seq-mean-token-sum-norm"
    assert cfg.critic.dp_size == 2 and cfg.critic.enable and not cfg.reference.enable
    assert isinstance(to_dataclass(cfg), RLFlowConfig)


def test_critic_strategy_inherits_the_actors_unless_set():
    assert load_config(None, ["actor.strategy=ddp"]).critic.strategy == "ddp"
    assert load_config(None, ["actor.strategy=ddp", "critic.strategy=fsdp2"]).critic.strategy == "fsdp2"


def test_grpo_needs_no_critic_and_kl_loss_turns_on_the_reference():
    cfg = load_config(None, ["algorithm.adv_estimator=grpo", "actor.use_kl_loss=true"])
    assert not cfg.critic.enable and cfg.reference.enable


def test_a_micro_batch_of_at_least_a_ranks_shard_is_that_whole_shard():
    from rlflow.protocol import plan_micro_batches
    from workers.trainable import micro_batch_plan

    # the default micro-batch (64) at dp 2 exceeds a rank's 32 rows of the default mini-batch (64)
    cfg = load_config(None, ["actor.dp_size=2"])
    assert cfg.actor.ppo_micro_batch_size_per_gpu > cfg.actor.ppo_mini_batch_size // cfg.actor.dp_size
    shard = TensorDict({"input_ids": torch.zeros(32, 3, dtype=torch.long)}, batch_size=[32])
    (micro,) = plan_micro_batches(shard, **micro_batch_plan(cfg.actor, shard))
    assert micro.tolist() == list(range(32))
    with pytest.raises(ConfigError, match=r"= 64 / 2 = 32, or be at least it"):
        load_config(None, ["actor.dp_size=2", "actor.ppo_micro_batch_size_per_gpu=24"])


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("actor:\n  optim:\n    lr: 3.0e-4\ntrainer:\n  total_steps: 7\n")
    cfg = load_config(path, ["trainer.total_steps=9"])
    assert cfg.actor.optim.lr == pytest.approx(3e-4) and cfg.trainer.total_steps == 9


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        (["actor.optim.lrr=1"], r"unknown config key 'actor\.optim\.lrr'.*did you mean 'actor\.optim\.lr'"),
        (["lr=1e-5"], r"unknown config key 'lr'.*did you mean 'actor\.optim\.lr'"),
        (["trainer.totl_steps=3"], r"'trainer\.totl_steps'.*'trainer\.total_steps'"),
        (["actor.ppo_mini_batch_size=7"], r"actor\.ppo_mini_batch_size=7 must divide data\.train_batch_size \* rollout\.n"),
        (["actor.dp_size=3", "actor.ppo_mini_batch_size=64"], r"actor\.ppo_mini_batch_size=64 must be divisible by actor\.dp_size=3"),
        (["actor.ppo_micro_batch_size_per_gpu=5"], r"actor\.ppo_micro_batch_size_per_gpu=5 must divide the per-rank mini-batch"),
        (["critic.ppo_micro_batch_size_per_gpu=3"], r"critic\.ppo_micro_batch_size_per_gpu=3"),
        (["actor.loss_agg_mode=mean"], r"actor\.loss_agg_mode='mean' is not one of token-mean"),
        (["critic.loss_agg_mode=mean"], r"critic\.loss_agg_mode='mean'"),
        (["actor.dp_size=two"], r"bad value for config key 'actor\.dp_size'"),
        (["algorithm.adv_estimator=foo"], r"algorithm\.adv_estimator='foo' is not one of .*gae"),
        (["algorithm.adv_estimator=grpo", "rollout.n=1", "actor.ppo_mini_batch_size=32"], r"rollout\.n must be >= 2"),
        (["actor.policy_loss=nope"], r"actor\.policy_loss='nope'"),
        (["rollout.name=sglang"], r"rollout\.name='sglang'"),
        (["rollout.weight_sync=nccl"], r"rollout\.weight_sync='nccl' is not one of auto, shared_memory, object_store, collective"),
        (["rollout.weight_sync_bucket_mb=0"], r"rollout\.weight_sync_bucket_mb must be >= 1"),
        (["trainer.logger=[console,neptune]"], r"trainer\.logger: unknown logger 'neptune'"),
        (["trainer.resume_mode=/no/such/dir"], r"trainer\.resume_mode='/no/such/dir'"),
        (["actor.optim"], r"not of the form key=value"),
        (["critic.optim.name=lion"], r"critic\.optim\.name='lion' is not one of adamw, sgd"),
        (["trainer.grad_probes.num_projections=-1"], r"trainer\.grad_probes\.num_projections must be >= 0"),
        (["actor=3"], r"'actor'.*is a section"),
    ],
)
def test_bad_configs_name_the_key(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, overrides)


def test_bad_yaml_key_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("critic:\n  clip_range_value: 0.2\n")
    with pytest.raises(ConfigError, match=r"critic\.clip_range_value.*bad\.yaml.*critic\.cliprange_value"):
        load_config(path)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


def test_every_shipped_recipe_loads():
    recipes = sorted((REPO / "configs").glob("*.yaml"))
    assert recipes, "configs/ holds the recipes"
    for recipe in recipes:
        load_config(recipe)


def test_default_yaml_matches_the_schema_defaults():
    shipped = load_config(REPO / "configs" / "default.yaml")
    assert OmegaConf.to_container(shipped) == OmegaConf.to_container(load_config(None))


def test_policy_loss_options_reach_the_loss_term():
    from rlflow.algos import GeoMeanOptions, actor_loss_terms

    cfg = to_dataclass(load_config(None, ["actor.policy_loss=geo_mean", "actor.policy_loss_options.clip_ratio_low=0.3",
                                          "actor.loss_agg_mode=seq-mean-token-mean"]))
    options = actor_loss_terms(cfg.actor)[0].options
    assert options == GeoMeanOptions(clip_ratio_low=0.3, clip_ratio_high=0.4, loss_agg_mode="seq-mean-token-mean",
                                     loss_scale_factor=cfg.actor.loss_scale_factor)
    # actor.clip_ratio_* are the PPO ratio clip: the defaults of vanilla's options, not geo_mean's
    vanilla = actor_loss_terms(to_dataclass(load_config(None, ["actor.clip_ratio_high=0.28"])).actor)[0].options
    assert vanilla.clip_ratio_high == 0.28


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        (["actor.policy_loss=geo_mean", "actor.policy_loss_options.clip_ratio_c=2"],
         r"actor\.policy_loss_options\.clip_ratio_c is not an option of actor\.policy_loss='geo_mean'; "
         r"valid: clip_ratio_low, clip_ratio_high"),
        (["actor.policy_loss_options.clip_ratio=0.2"], r"actor\.policy_loss_options\.clip_ratio is not an option.*clip_ratio_c"),
        (["actor.policy_loss=reinforce", "actor.policy_loss_options.clip_ratio_low=0.2"], r"valid: \(none\)"),
        (["actor.policy_loss_options.clip_ratio_c=1.0"], r"actor\.policy_loss_options\.clip_ratio_c must be > 1\.0"),
        (["actor.clip_ratio_c=0.5"], r"actor\.clip_ratio_c must be > 1\.0"),
        (["actor.policy_loss=geo_mean", "actor.policy_loss_options.clip_ratio_low=-0.1"],
         r"actor\.policy_loss_options\.clip_ratio_low must be >= 0"),
        (["actor.policy_loss_options.clip_ratio_low=big"], r"actor\.policy_loss_options\.clip_ratio_low must be a number"),
        (["critic.cliprange_value=-1"], r"critic\.cliprange_value must be >= 0"),
    ],
)
def test_bad_loss_options_name_the_key(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, overrides)
