"""The headline promise, end to end: real fits (Ray workers, gloo, FSDP2 at dp=2, the tiny model)
replaying ONE recorded rollout file give the same final actor and critic parameters and the same
logged metrics whatever the layout of the mini-batches (micro-batch size, token-budget batching,
dp ranks), for every loss_agg_mode, with KL-in-loss, an entropy bonus and active grad clipping.

Also: deterministic mode reproduces a generating run bit for bit, replay reproduces the recorded
run bit for bit, and a negative control (the test-only switch that turns global normalisation
off) makes the critic's gradient norm move by exactly the factor the data predicts, so the
comparisons can fail.

Each fit is run once per session and cached; the worst difference of every pair is printed in
the terminal summary. Fits that differ only in layout are grouped in "families" (one algorithm
setting each); a family's fits must all agree.
"""

from __future__ import annotations

import pytest
import torch

from exactness_helpers import (
    COMPARED_METRICS,
    build_varied_length_model,
    compare_fits,
    response_lengths,
    run_fit,
)

LOCAL_NORM_ENV = {"RLFLOW_TEST_LOCAL_NORMALISATION": "1"}
MINI = 8  # actor.ppo_mini_batch_size (BASE in exactness_helpers)
TOKEN_BUDGET = 24  # ppo_max_token_len_per_gpu: rows are 6..13 tokens, so 2-4 micro-batches per shard

# One algorithm setting per family; the five loss_agg_modes each appear once for the actor and
# once for the critic. F1 is also the generating (recorded) configuration.
FAMILIES = {
    "F1": {"actor.loss_agg_mode": "token-mean", "critic.loss_agg_mode": "seq-mean-token-mean",
           "actor.grad_clip": 0.5},  # clipping active: the actor's grad norm is 1.5-5 here
    # KL in the loss (a reference worker) in F2 and F4 only: each reference is one more process
    "F2": {"actor.loss_agg_mode": "seq-mean-token-sum", "critic.loss_agg_mode": "token-mean",
           "actor.use_kl_loss": True},
    # the critic inherits the actor's loss_scale_factor (5, deliberately not max_response_length)
    "F3": {"actor.loss_agg_mode": "seq-mean-token-mean", "critic.loss_agg_mode": "seq-mean-token-sum-norm",
           "actor.loss_scale_factor": 5.0},
    "F4": {"actor.loss_agg_mode": "seq-mean-token-sum-norm", "critic.loss_agg_mode": "token-sum",
           "actor.use_kl_loss": True},
    "F5": {"actor.loss_agg_mode": "token-sum", "critic.loss_agg_mode": "seq-mean-token-sum"},
}
WHOLE = {"actor.ppo_micro_batch_size_per_gpu": MINI}  # one micro-batch = the whole per-rank shard
LAYOUTS = {
    "whole": WHOLE,
    "mb1": {"actor.ppo_micro_batch_size_per_gpu": 1},
    "mb2": {"actor.ppo_micro_batch_size_per_gpu": 2},
    "dyn": {"actor.use_dynamic_bsz": True, "actor.ppo_max_token_len_per_gpu": TOKEN_BUDGET},
    # FSDP2 over gloo moves the whole model ~3x per micro-batch: one micro-batch per rank here
    "dp2": {"actor.dp_size": 2, "actor.ppo_micro_batch_size_per_gpu": MINI // 2},
    "dp2-dyn": {"actor.dp_size": 2, "actor.use_dynamic_bsz": True, "actor.ppo_max_token_len_per_gpu": TOKEN_BUDGET},
    # DDP accumulates 2 micro-batches per rank without communication and all-reduces once (no_sync)
    "dp2-ddp-mb2": {"actor.dp_size": 2, "actor.strategy": "ddp", "critic.strategy": "ddp",
                    "actor.ppo_micro_batch_size_per_gpu": 2},
}
# (critic settings are inherited from the actor's: dp_size, micro-batch size, dynamic bsz, ...)

# name -> (family, layout, extra). "gen*" generate and record; every other fit replays gen1's file.
FITS = {
    "gen1": ("F1", "whole", {"record": True}),
    "gen2": ("F1", "whole", {"record": True}),
    "F1/whole": ("F1", "whole", {}),
    "F1/mb1": ("F1", "mb1", {}),
    "F1/mb2-localnorm": ("F1", "mb2", {"env": LOCAL_NORM_ENV}),
    "F2/whole": ("F2", "whole", {}),
    "F2/dyn": ("F2", "dyn", {}),
    "F3/whole": ("F3", "whole", {}),
    "F3/dp2": ("F3", "dp2", {}),
    "F4/whole": ("F4", "whole", {}),
    "F4/dp2-dyn": ("F4", "dp2-dyn", {}),
    "F5/whole": ("F5", "whole", {}),
    "F5/mb2": ("F5", "mb2", {}),
    "F5/dp2-ddp-mb2": ("F5", "dp2-ddp-mb2", {}),
}
# layouts that must be equivalent (within tolerance)
PAIRS = [
    ("F1/whole", "F1/mb1"),  # micro-batch 1 vs whole shard, token-mean actor, clipping on
    ("F5/whole", "F5/mb2"),  # micro-batch 2 vs whole shard
    ("F2/whole", "F2/dyn"),  # token budget vs fixed
    ("F3/whole", "F3/dp2"),  # dp=2 (FSDP2, whole per-rank shard) vs dp=1
    ("F4/whole", "F4/dp2-dyn"),  # dp=2 with token budget vs dp=1 fixed
    ("F5/whole", "F5/dp2-ddp-mb2"),  # dp=2 DDP, 2 micro-batches per rank reduced once vs dp=1 whole
]

_REPORT: list[str] = []


class _Report:
    """Prints every comparison in the terminal summary, whatever pytest's capture setting."""

    def pytest_terminal_summary(self, terminalreporter):
        if _REPORT:
            terminalreporter.section("exactness: worst differences per pair")
            for line in _REPORT:
                terminalreporter.write_line(line)


class Fits:
    def __init__(self, model_dir: str, tmp_factory):
        self.model_dir = model_dir
        self.tmp = tmp_factory
        self.record_path = str(tmp_factory.mktemp("exactness_rollouts") / "gen1.pt")
        self.cache = {}

    def __getitem__(self, name: str):
        if name not in self.cache:
            family, layout, extra = FITS[name]
            overrides = {**FAMILIES[family], **LAYOUTS[layout]}
            if extra.get("record"):
                path = self.record_path if name == "gen1" else str(self.tmp.mktemp("exactness_rollouts") / f"{name}.pt")
                overrides["trainer.record_rollouts"] = path
            else:
                self["gen1"]  # the file every replay reads
                overrides["trainer.replay_rollouts"] = self.record_path
            result = run_fit(self.model_dir, str(self.tmp.mktemp("exactness_run")), env=extra.get("env"), **overrides)
            result.record_path = overrides.get("trainer.record_rollouts")
            _REPORT.append(f"fit {name:<18} {result.seconds:6.1f} s")
            self.cache[name] = result
        return self.cache[name]


@pytest.fixture(scope="module")
def fits(ray_session, tmp_path_factory, request):
    request.config.pluginmanager.register(_Report(), "exactness-report")
    model_dir = build_varied_length_model(str(tmp_path_factory.mktemp("exactness_model")))
    return Fits(model_dir, tmp_path_factory)


def _value_clipfrac_counts_rounding() -> bool:
    """True while compute_value_loss counts unclipped tokens as clipped by float rounding."""
    from rlflow.algos import compute_value_loss

    gen = torch.Generator().manual_seed(0)
    values = 0.3 * torch.randn(256, 64, generator=gen)
    vpreds = 0.3 * torch.randn(256, 64, generator=gen)
    returns = torch.randn(256, 64, generator=gen)
    inside = ((vpreds - values).abs() <= 0.5).float()  # only tokens the clip leaves alone
    _, clipfrac = compute_value_loss(vpreds, returns, values, inside, cliprange_value=0.5)
    return float(clipfrac) > 0


VF_CLIPFRAC_BUGGY = _value_clipfrac_counts_rounding()


# ------------------------------------------------------------------------------------ the tests


def test_recorded_rollout_has_uneven_masks(fits):
    lengths = response_lengths(fits["gen1"].record_path)
    assert len(lengths) == 3
    flat = [n for step in lengths for n in step]
    assert len(set(flat)) >= 3, f"recorded response lengths barely vary: {lengths}"
    assert min(flat) >= 1 and max(flat) <= 6
    _REPORT.append(f"recorded response lengths per step: {lengths}")


def test_deterministic_mode_reproduces_a_generating_run(fits):
    a, b = fits["gen1"], fits["gen2"]
    ra = torch.load(a.record_path, weights_only=True)
    rb = torch.load(b.record_path, weights_only=True)
    assert sorted(ra) == sorted(rb) == [0, 1, 2]
    for step in ra:
        for key in ra[step]:
            assert torch.equal(ra[step][key], rb[step][key]), f"step {step}: recorded {key} differs between runs"
    diff = compare_fits(a, b, rtol=0.0, atol=0.0, metric_rtol=0.0, metric_atol=0.0)
    _REPORT.append(f"gen1 vs gen2 (deterministic, bitwise): {diff.line()}")
    assert not diff.failures, diff.failures[:10]
    assert diff.param_abs == 0.0 and diff.metric_abs == 0.0


def test_replay_reproduces_the_recorded_run(fits):
    """Replaying gen1's file through the real update path gives gen1's weights bit for bit."""
    diff = compare_fits(fits["gen1"], fits["F1/whole"], rtol=0.0, atol=0.0, metric_rtol=0.0, metric_atol=0.0)
    _REPORT.append(f"gen1 vs F1/whole (replay, bitwise): {diff.line()}")
    assert not diff.failures, diff.failures[:10]


@pytest.mark.parametrize("pair", PAIRS, ids=[f"{a}~{b.split('/')[1]}" for a, b in PAIRS])
def test_layouts_are_equivalent(fits, pair):
    a, b = fits[pair[0]], fits[pair[1]]
    compared = tuple(m for m in COMPARED_METRICS if not (VF_CLIPFRAC_BUGGY and m == "critic/vf_clipfrac"))
    diff = compare_fits(a, b, metrics=compared)
    vf = compare_fits(a, b, metrics=("critic/vf_clipfrac",))
    note = "" if not VF_CLIPFRAC_BUGGY else f"  [vf_clipfrac not asserted (rounding bug): max|d|={vf.metric_abs:.3g}]"
    _REPORT.append(f"{pair[0]} vs {pair[1]}: {diff.line()}{note}")
    assert not diff.failures, diff.failures[:10]


def test_layouts_ran_as_configured(fits):
    """Micro-batch counts per mini-batch (a MAX over ranks) show each layout did what it says."""
    def micro(name):
        return [h["actor/num_micro_batches"] for h in fits[name].history if "actor/pg_loss" in h]

    assert micro("F1/whole") == [1.0] * 3 and micro("F1/mb1") == [8.0] * 3 and micro("F5/mb2") == [4.0] * 3
    assert micro("F3/dp2") == [1.0] * 3  # 4 rows per rank in one micro-batch
    assert micro("F5/dp2-ddp-mb2") == [2.0] * 3  # 4 rows per rank in 2 micro-batches: no_sync engaged
    assert all(n >= 2 for n in micro("F2/dyn")) and all(n >= 2 for n in micro("F4/dp2-dyn"))


def test_grad_clipping_was_active(fits):
    """F1 clips the actor at 0.5: the logged (pre-clip) norm is above it at every step."""
    for name in ("F1/whole", "F1/mb1"):
        norms = [h["actor/grad_norm"] for h in fits[name].history if "actor/pg_loss" in h]
        assert min(norms) > 0.5 * 1.5, f"{name}: actor grad norms {norms} do not exceed actor.grad_clip=0.5"


def test_kl_loss_and_entropy_bonus_are_on(fits):
    for name in ("F2/dyn", "F4/dp2-dyn"):
        last = fits[name].history[-1]
        assert last["actor/kl_loss"] > 0 and last["actor/entropy_loss"] > 0


def test_critic_inherits_loss_scale_factor():
    from exactness_helpers import BASE
    from rlflow import load_config
    from conftest import tiny_overrides

    cfg = load_config(None, tiny_overrides("unused", **{**BASE, **FAMILIES["F3"], "reward.custom_function.path": __file__}))
    assert cfg.critic.loss_scale_factor == cfg.actor.loss_scale_factor == 5.0


def test_negative_control_local_normalisation(fits):
    """Without global metadata each micro-batch normalises by itself. F1's critic is
    seq-mean-token-mean: a micro-batch of m sequences divides by m instead of the mini-batch's 8,
    so the gradient is exactly 8/m = 4x (micro-batches of 2; every row has >= 1 valid token).
    Adam is nearly blind to a constant gradient scale, so the parameters drift little; the logged
    grad norm shows it, and the comparison above would fail."""
    glob = [h["critic/grad_norm"] for h in fits["F1/whole"].history if "critic/grad_norm" in h]
    local = [h["critic/grad_norm"] for h in fits["F1/mb2-localnorm"].history if "critic/grad_norm" in h]
    factors = [lo / gl for lo, gl in zip(local, glob)]
    expected = MINI / 2
    _REPORT.append(f"negative control (local normalisation, critic seq-mean-token-mean, micro-batches of 2): "
                   f"critic grad_norm factor per step {[round(f, 6) for f in factors]}, expected {expected}")
    full = compare_fits(fits["F1/whole"], fits["F1/mb2-localnorm"])
    _REPORT.append(f"  F1/whole vs F1/mb2-localnorm (must fail): {full.line()}; {len(full.failures)} failures")
    for factor in factors:
        assert factor == pytest.approx(expected, rel=1e-3)
    # and the equivalence check flags it, in the critic's metrics and in the actor's parameters
    # (the actor is token-mean: micro-batches of unequal token counts get unequal weights)
    critic = compare_fits(fits["F1/whole"], fits["F1/mb2-localnorm"], metrics=("critic/grad_norm", "critic/vf_loss"))
    assert any("critic/grad_norm" in f for f in critic.failures)
    assert any(f.startswith("actor.model.") for f in full.failures), full.failures[:5]


@pytest.mark.xfail(VF_CLIPFRAC_BUGGY, strict=True, reason=(
    "rlflow/algos/losses.py compute_value_loss counts a token as clipped when "
    "(values + clamp(vpreds - values)) - returns squares larger than vpreds - returns by float rounding "
    "although |vpreds - values| <= cliprange_value; vf_clipfrac then depends on the split. Fix: "
    "clipped = (clipped_sq_err > unclipped_sq_err) & ((vpreds - values).abs() > cliprange_value)"))
def test_vf_clipfrac_counts_only_clipped_tokens():
    assert not _value_clipfrac_counts_rounding()

