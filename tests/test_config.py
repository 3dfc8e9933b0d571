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


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        (["actor.policy_loss=cispo", "actor.policy_loss_options.epsilon_low=1.5"],
         r"actor\.policy_loss_options\.epsilon_low must be in \[0, 1\]"),
        (["actor.policy_loss=cispo", "actor.policy_loss_options.epsilon_high=-0.1"],
         r"actor\.policy_loss_options\.epsilon_high must be >= 0"),
        (["actor.policy_loss=cispo", "actor.policy_loss_options.clip_ratio_high=0.3"],
         r"actor\.policy_loss_options\.clip_ratio_high is not an option of actor\.policy_loss='cispo'; "
         r"valid: epsilon_low, epsilon_high"),
        (["actor.policy_loss=sapo", "actor.policy_loss_options.tau_neg=0"],
         r"actor\.policy_loss_options\.tau_neg must be > 0"),
        (["actor.policy_loss=sapo", "actor.policy_loss_options.tau=1.0"],
         r"actor\.policy_loss_options\.tau is not an option of actor\.policy_loss='sapo'; valid: tau_pos, tau_neg"),
    ],
    ids=["cispo-epsilon_low", "cispo-epsilon_high", "cispo-unknown", "sapo-tau_neg", "sapo-unknown"],
)
def test_bad_cispo_and_sapo_options_name_the_key(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, overrides)


def test_cispo_and_sapo_options_reach_the_loss_term():
    from rlflow.algos import CISPOOptions, SAPOOptions, actor_loss_terms

    cfg = to_dataclass(load_config(None, ["actor.policy_loss=cispo", "actor.policy_loss_options.epsilon_high=0.5",
                                          "actor.clip_ratio_high=0.28"]))
    assert actor_loss_terms(cfg.actor)[0].options == CISPOOptions(
        epsilon_low=1.0, epsilon_high=0.5, loss_scale_factor=cfg.actor.loss_scale_factor)
    cfg = to_dataclass(load_config(None, ["actor.policy_loss=sapo", "actor.policy_loss_options.tau_pos=0.5"]))
    assert actor_loss_terms(cfg.actor)[0].options == SAPOOptions(
        tau_pos=0.5, tau_neg=1.05, loss_scale_factor=cfg.actor.loss_scale_factor)


# ---------------------------------------------------------------------------------------------
# numeric ranges: one table (rlflow.config.NUMERIC_RANGES), every numeric key in it or in NO_RANGE
# ---------------------------------------------------------------------------------------------


def _numeric_keys(schema=None, prefix: str = "") -> dict[str, type]:
    """Every int/float (or list of them) key of the schema, dotted, with its number type."""
    import dataclasses
    import types
    import typing

    schema = schema if schema is not None else RLFlowConfig()
    hints = typing.get_type_hints(type(schema))
    found = {}
    for f in dataclasses.fields(schema):
        value = getattr(schema, f.name)
        if dataclasses.is_dataclass(value):
            found.update(_numeric_keys(value, f"{prefix}{f.name}."))
            continue
        hint = hints[f.name]
        if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
            hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
        if typing.get_origin(hint) is list:
            hint = typing.get_args(hint)[0]
        if hint in (int, float):
            found[f"{prefix}{f.name}"] = hint
    return found


NUMERIC_KEYS = _numeric_keys()


def test_every_numeric_key_has_a_range_or_is_listed_as_having_none():
    from rlflow.config import NO_RANGE, NUMERIC_RANGES

    assert not set(NUMERIC_RANGES) & set(NO_RANGE)
    forgotten = sorted(set(NUMERIC_KEYS) - set(NUMERIC_RANGES) - set(NO_RANGE))
    assert not forgotten, f"add these keys to rlflow.config.NUMERIC_RANGES (or NO_RANGE): {forgotten}"
    stale = sorted((set(NUMERIC_RANGES) | set(NO_RANGE)) - set(NUMERIC_KEYS))
    assert not stale, f"not numeric keys of the schema: {stale}"


# what a boundary value needs from other keys to pass the checks that relate keys
COMPANIONS = {
    "data.train_batch_size": ["actor.ppo_mini_batch_size=4"],  # must divide 1 prompt x rollout.n=4
    "rollout.n": ["actor.ppo_mini_batch_size=32"],  # must divide 32 prompts x 1
    "reward.rule_weight": ["reward_model.enable=true", "reward_model.path=rm"],  # 0 needs a reward model
}


def _cases():
    """(key, value, inside) just outside and at (or, for an open end, just inside) each end of
    each key's range."""
    from rlflow.config import NUMERIC_RANGES

    cases = []
    for key, allowed in NUMERIC_RANGES.items():
        step = 1 if NUMERIC_KEYS[key] is int else 1e-6
        ends = []
        if allowed.low is not None:
            low = allowed.low
            ends += [(low, not allowed.low_open), (low - step, False)] if not allowed.low_open else \
                [(low, False), (low + step, True)]
        if allowed.high is not None:
            high = allowed.high
            if high == float("inf"):
                ends += [(high, not allowed.high_open), (1e9, True)]
            elif allowed.high_open:
                ends += [(high, False), (high - step, True)]
            else:
                ends += [(high, True), (high + step, False)]
        if allowed.null:
            ends.append((None, True))
        for value, inside in ends:
            value = value if value is None else NUMERIC_KEYS[key](value)  # as the config holds it
            cases.append(pytest.param(key, value, inside, id=f"{key}={value}"))
    return cases


def _override(key: str, value) -> str:
    text = "null" if value is None else repr(value)
    if key.endswith(".optim.betas"):
        return f"{key}=[{text},0.999]"  # the first element; the second is the default's
    return f"{key}={text}"


@pytest.mark.parametrize("key, value, inside", _cases())
def test_a_range_rejects_the_value_just_outside_and_accepts_its_boundary(key, value, inside):
    overrides = [*COMPANIONS.get(key, []), _override(key, value)]
    if inside:
        load_config(None, overrides)
        return
    named = f"{key}[0]" if key.endswith(".optim.betas") else key
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    message = str(info.value)
    assert message.startswith(f"{named} must be "), message
    assert "\n" not in message and message.endswith(f", got {value}"), message


@pytest.mark.parametrize("overrides, line", [
    (["actor.optim.lr=-1e-4"], "actor.optim.lr must be > 0, got -0.0001"),
    (["critic.optim.eps=-1"], "critic.optim.eps must be >= 0, got -1.0"),
    (["critic.optim.betas=[0.9,1.0]"], "critic.optim.betas[1] must be in [0, 1), got 1.0"),
    (["reward.timeout_s=inf"], "reward.timeout_s must be > 0 and finite (seconds), got inf"),
    (["actor.lora.rank=-1"], "actor.lora.rank must be >= 0 (0: LoRA off), got -1"),
    (["ray.num_cpus=-2"], "ray.num_cpus must be >= 0 or null (0: sized from the workers), got -2"),
    (["rollout.top_p=nan"], "rollout.top_p must be in (0, 1], got nan"),
    (["actor.optim.betas=[0.9]"], "actor.optim.betas must hold two numbers [beta1, beta2] (AdamW's), got [0.9]"),
])
def test_range_errors_are_one_line_naming_the_key(overrides, line):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert str(info.value) == line


def test_a_range_is_checked_whether_its_section_is_used_or_not():
    # the critic is off under grpo and the agent section without an environment: still checked
    with pytest.raises(ConfigError, match=r"^critic\.optim\.lr must be > 0"):
        load_config(None, ["algorithm.adv_estimator=grpo", "critic.optim.lr=0"])
    with pytest.raises(ConfigError, match=r"^rollout\.agent\.timeout_s must be"):
        load_config(None, ["rollout.agent.timeout_s=0"])
    assert load_config(None, ["actor.grad_clip=inf"]).actor.grad_clip == float("inf")  # no clipping


# ---------------------------------------------------------------------------------------------
# trainer.resume_mode=<folder>: a checkpoint must be there before Ray starts
# ---------------------------------------------------------------------------------------------


def test_resume_mode_folder_without_a_checkpoint_is_one_line_naming_the_key(tmp_path):
    empty = tmp_path / "run"
    empty.mkdir()
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"trainer.resume_mode={empty}"])
    message = str(info.value)
    assert message.startswith(f"trainer.resume_mode='{empty}': ") and "holds no checkpoints" in message
    assert "\n" not in message
    step = empty / "checkpoints" / "step_3"
    step.mkdir(parents=True)
    for folder in (empty, empty / "checkpoints", step):  # a run, its checkpoints, one checkpoint
        assert load_config(None, [f"trainer.resume_mode={folder}"]).trainer.resume_mode == str(folder)
