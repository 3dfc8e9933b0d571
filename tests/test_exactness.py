"""The headline promise, end to end: real fits (Ray workers, gloo, FSDP2 and DDP at dp=2, the tiny
model) replaying ONE recorded rollout file take the same gradient at every optimizer step, end at
the same parameters and log the same metrics whatever the layout of the mini-batches (micro-batch
size, token-budget batching, dp ranks), for every loss_agg_mode, with KL-in-loss, an entropy bonus
and active grad clipping.

The evidence is at the gradient level: every fit runs with trainer.grad_probes on, so each
optimizer step reports each parameter tensor's gradient norm and fixed random projections of the
whole gradient (after the dp reduction, before clipping), and the matrix compares them. The S1
family trains with plain SGD at a large lr, where a K-times gradient error is a K-times parameter
change; parameter tolerances are fractions of each tensor's movement during the fit.

Also: deterministic mode reproduces a generating run bit for bit, replay reproduces the recorded
run bit for bit, and negative controls (test-only worker subclasses in tests/exactness_workers.py:
local normalisation at dp=2, one tensor's gradient doubled) move the probes by exactly the factor
the data predicts, so the comparisons can fail.

Each fit is run once per session and cached; the worst difference of every pair, as a fraction of
its tolerance, is printed in the terminal summary. Fits that differ only in layout are grouped in
"families" (one algorithm setting each); a family's fits must all agree.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

import exactness_workers
from exactness_helpers import (
    recorded_batches,
    BASE,
    STEPS,
    build_varied_length_model,
    compare_fits,
    required_metrics,
    response_lengths,
    run_fit,
)

MINI = 8  # actor.ppo_mini_batch_size (BASE in exactness_helpers)
TOKEN_BUDGET = 24  # ppo_max_token_len_per_gpu: rows are 6..13 tokens, so 2-4 micro-batches per shard
# large: over the fit the largest actor tensor movement is ~0.09, the critic's ~0.01 (the critic's
# token-mean value loss has 2-3x the actor's gradient norm and diverged at 0.05); the critic's
# slowest tensor must still move 100x its rounding in the fit's 8 SGD steps
SGD_LR = {"actor": 0.05, "critic": 0.0075}

# One algorithm setting per family; the five loss_agg_modes each appear once for the actor and
# once for the critic in F1-F5. F1 is also the generating (recorded) configuration.
FAMILIES = {
    # KL in the loss (a reference worker) in F1, F2, F4 and S1: F1's layouts then have S1's roles and
    # ranks, so each F1 fit takes the worker processes an S1 fit of that layout left (IdleWorkers)
    "F1": {"actor.loss_agg_mode": "token-mean", "critic.loss_agg_mode": "seq-mean-token-mean",
           "actor.grad_clip": 0.5, "actor.use_kl_loss": True},  # clipping active: the actor's grad norm is 1.5-5 here
    "F2": {"actor.loss_agg_mode": "seq-mean-token-sum", "critic.loss_agg_mode": "token-mean",
           "actor.use_kl_loss": True},
    # the critic inherits the actor's loss_scale_factor (5, deliberately not max_response_length)
    "F3": {"actor.loss_agg_mode": "seq-mean-token-mean", "critic.loss_agg_mode": "seq-mean-token-sum-norm",
           "actor.loss_scale_factor": 5.0},
    "F4": {"actor.loss_agg_mode": "seq-mean-token-sum-norm", "critic.loss_agg_mode": "token-sum",
           "actor.use_kl_loss": True},
    "F5": {"actor.loss_agg_mode": "token-sum", "critic.loss_agg_mode": "seq-mean-token-sum"},
    # the classic data-parallel count bug's home: token-mean actor AND critic, plain SGD
    "S1": {"actor.loss_agg_mode": "token-mean", "critic.loss_agg_mode": "token-mean", "actor.use_kl_loss": True,
           "actor.optim.name": "sgd", "critic.optim.name": "sgd", "actor.optim.lr": SGD_LR["actor"], "critic.optim.lr": SGD_LR["critic"]},
    # one optimizer step over the whole batch (16 rows, on-policy), checked against an independent
    # float64 gradient written in the test
    "A1": {"actor.loss_agg_mode": "token-mean", "critic.loss_agg_mode": "token-mean", "actor.ppo_epochs": 1,
           "actor.ppo_mini_batch_size": 16, "trainer.total_steps": 1, "rollout.temperature": 0.7,
           "actor.optim.name": "sgd", "critic.optim.name": "sgd", "actor.optim.lr": SGD_LR["actor"], "critic.optim.lr": SGD_LR["critic"]},
}
# multi-turn: trajectories of 1-3 model turns with observation holes (tests/agent_loop_envs.py),
# token-mean actor and critic with plain SGD, as S1. A turn ends at EOS or at the trajectory's 16
# tokens, and one SGD step at this lr can take EOS out of every first turn of step 2 (seeds 0, 1 and
# 3 of the HF engine's sampler did): seed 2's recording has holes and mixed turn counts at both
# steps, which test_multi_turn_recording_has_holes_and_mixed_turn_counts checks
FAMILIES["M1"] = {**FAMILIES["S1"], "data.max_response_length": 16, "rollout.agent.max_turns": 3,
                  "rollout.agent.num_workers": 0, "trainer.seed": 2,
                  "rollout.agent.env": os.path.join(os.path.dirname(__file__), "agent_loop_envs.py") + ":CountingEnv"}
# the objectives beyond PPO's clip, each on S1's SGD setting: CISPO's clipped IS weight, SAPO's soft
# gate, and on-policy distillation's reverse KL to a teacher (a second random tiny model) added to
# the policy loss; each family's extra terms are required metrics (exactness_helpers.required_metrics)
FAMILIES["C1"] = {**FAMILIES["S1"], "actor.policy_loss": "cispo"}
FAMILIES["P1"] = {**FAMILIES["S1"], "actor.policy_loss": "sapo", "actor.loss_agg_mode": "seq-mean-token-mean"}
FAMILIES["D1"] = {**FAMILIES["S1"], "actor.distill.coef": 0.5, "teacher.enable": True}
# DPPO-Binary-TV with a trust region small enough (0.01 of probability) that the second epoch's
# tokens leave it
FAMILIES["K1"] = {**FAMILIES["S1"], "actor.policy_loss": "dppo_tv", "actor.policy_loss_options.delta_low": 0.01,
                  "actor.policy_loss_options.delta_high": 0.01}
# the top-k forward KL ([B, R, k] targets from the teacher's forward, gathered by the actor's)
FAMILIES["D2"] = {**FAMILIES["D1"], "actor.distill.top_k": 4}
WHOLE = {"actor.ppo_micro_batch_size_per_gpu": MINI}  # one micro-batch = the whole per-rank shard
LAYOUTS = {
    "whole": WHOLE,
    "mb1": {"actor.ppo_micro_batch_size_per_gpu": 1},
    "mb2": {"actor.ppo_micro_batch_size_per_gpu": 2},
    "mb4": {"actor.ppo_micro_batch_size_per_gpu": 4},
    "dyn": {"actor.use_dynamic_bsz": True, "actor.ppo_max_token_len_per_gpu": TOKEN_BUDGET},
    # FSDP2, one micro-batch per rank (4 rows)
    "dp2": {"actor.dp_size": 2, "actor.ppo_micro_batch_size_per_gpu": MINI // 2},
    # FSDP2, 2 micro-batches of 2 rows per rank (FSDP2 reduce-scatters after each)
    "dp2-mb2": {"actor.dp_size": 2, "actor.ppo_micro_batch_size_per_gpu": 2},
    "dp2-dyn": {"actor.dp_size": 2, "actor.use_dynamic_bsz": True, "actor.ppo_max_token_len_per_gpu": TOKEN_BUDGET},
    # DDP accumulates 2 micro-batches per rank without communication and all-reduces once (no_sync)
    "dp2-ddp-mb2": {"actor.dp_size": 2, "actor.strategy": "ddp", "critic.strategy": "ddp",
                    "actor.ppo_micro_batch_size_per_gpu": 2},
    # packed micro-batches (no padding computed), 4 of 2 rows each
    "pack-mb2": {"actor.use_remove_padding": True, "actor.ppo_micro_batch_size_per_gpu": 2},
    # Ulysses sequence parallelism: each packed micro-batch (4 rows) split over 2 ranks
    "sp2": {"actor.sp_size": 2, "actor.ppo_micro_batch_size_per_gpu": 4},
    # dp=2 x sp=2 (4 processes per role, FSDP2 over all 4), 2 micro-batches of 2 rows per dp rank
    "dp2-sp2": {"actor.dp_size": 2, "actor.sp_size": 2, "actor.ppo_micro_batch_size_per_gpu": 2},
    # sp=2 with a token budget: a micro-batch packs up to 2 x 12 tokens, each rank holding half
    "sp2-dyn": {"actor.sp_size": 2, "actor.use_dynamic_bsz": True, "actor.ppo_max_token_len_per_gpu": TOKEN_BUDGET // 2},
}
# (critic settings are inherited from the actor's: dp_size, micro-batch size, dynamic bsz, ...)

# name -> (family, layout, extra). "gen*" generate and record; every other fit replays gen1's file.
# extra "workers": test worker classes (tests/exactness_workers.py); "steps": fewer steps.
FITS = {
    "gen1": ("F1", "whole", {"record": True}),
    "gen2": ("F1", "whole", {"record": True}),
    "F1/whole": ("F1", "whole", {}),
    "F1/mb1": ("F1", "mb1", {}),
    "F1/dp2-ddp-mb2-localnorm": ("F1", "dp2-ddp-mb2", {"workers": exactness_workers.LOCAL_NORMALISATION}),
    "F2/whole": ("F2", "whole", {}),
    "F2/dyn": ("F2", "dyn", {}),
    "F3/whole": ("F3", "whole", {}),
    "F3/dp2": ("F3", "dp2", {}),
    "F4/whole": ("F4", "whole", {}),
    "F4/dp2-dyn": ("F4", "dp2-dyn", {}),
    "F5/whole": ("F5", "whole", {}),
    "F5/mb2": ("F5", "mb2", {}),
    "F5/dp2-ddp-mb2": ("F5", "dp2-ddp-mb2", {}),
    "S1/whole": ("S1", "whole", {}),
    "S1/dp2-mb2": ("S1", "dp2-mb2", {}),
    "S1/dp2-ddp-mb2": ("S1", "dp2-ddp-mb2", {}),
    "S1/dp2-dyn": ("S1", "dp2-dyn", {}),
    "S1/whole-doubled": ("S1", "whole", {"workers": exactness_workers.DOUBLED_GRADIENT, "steps": 1}),
    "A1/mb4": ("A1", "mb4", {}),
    "S1/pack-mb2": ("S1", "pack-mb2", {}),
    "S1/sp2": ("S1", "sp2", {}),
    "S1/dp2-sp2": ("S1", "dp2-sp2", {}),
    "S1/sp2-dyn": ("S1", "sp2-dyn", {}),
    "S1/sp2-localnorm": ("S1", "sp2", {"workers": exactness_workers.SP_LOCAL_NORMALISATION, "steps": 1}),
    "S1/sp2-unreduced": ("S1", "sp2", {"workers": exactness_workers.SP_UNREDUCED_GRADIENT, "steps": 1}),
    "F1/pack-mb2": ("F1", "pack-mb2", {}),
    "F1/sp2": ("F1", "sp2", {}),
    "F1/sp2-dyn": ("F1", "sp2-dyn", {}),
    "genM": ("M1", "whole", {"record": True}),
    "M1/whole": ("M1", "whole", {"replay": "genM"}),
    "M1/dp2-mb2": ("M1", "dp2-mb2", {"replay": "genM"}),
    "C1/whole": ("C1", "whole", {}),
    "C1/dp2-mb2": ("C1", "dp2-mb2", {}),
    "P1/whole": ("P1", "whole", {}),
    "P1/dp2-dyn": ("P1", "dp2-dyn", {}),
    "D1/whole": ("D1", "whole", {}),
    "D1/mb1": ("D1", "mb1", {}),
    "K1/whole": ("K1", "whole", {}),
    "K1/dp2-mb2": ("K1", "dp2-mb2", {}),
    "D2/whole": ("D2", "whole", {}),
    "D2/pack-mb2": ("D2", "pack-mb2", {}),
}
# layouts that must be equivalent (within tolerance)
PAIRS = [
    ("F1/whole", "F1/mb1"),  # micro-batch 1 vs whole shard, token-mean actor, clipping on
    ("F5/whole", "F5/mb2"),  # micro-batch 2 vs whole shard
    ("F2/whole", "F2/dyn"),  # token budget vs fixed
    ("F3/whole", "F3/dp2"),  # dp=2 (FSDP2, whole per-rank shard) vs dp=1
    ("F4/whole", "F4/dp2-dyn"),  # dp=2 with token budget vs dp=1 fixed
    ("F5/whole", "F5/dp2-ddp-mb2"),  # dp=2 DDP, 2 micro-batches per rank reduced once vs dp=1 whole
    ("S1/whole", "S1/dp2-mb2"),  # token-mean, SGD: FSDP2 dp=2, 2 micro-batches per rank, unequal tokens
    ("S1/whole", "S1/dp2-ddp-mb2"),  # the same under DDP
    ("S1/whole", "S1/dp2-dyn"),  # token budget at dp=2
    ("M1/whole", "M1/dp2-mb2"),  # multi-turn with mask holes: FSDP2 dp=2, 2 micro-batches per rank
    ("C1/whole", "C1/dp2-mb2"),  # CISPO: FSDP2 dp=2, 2 micro-batches per rank
    ("P1/whole", "P1/dp2-dyn"),  # SAPO, seq-mean-token-mean: dp=2 with a token budget
    # distillation added to the policy loss, micro-batches of 1 row. (The teacher makes the D
    # families' roles a layout of their own: a dp=2 fit would start 7 processes for one pair; the
    # term's dp scaling is aggregate()'s, which every dp=2 pair above checks.)
    ("D1/whole", "D1/mb1"),
    ("K1/whole", "K1/dp2-mb2"),  # DPPO-Binary-TV: FSDP2 dp=2, 2 micro-batches per rank
    ("D2/whole", "D2/pack-mb2"),  # top-k forward KL: packed micro-batches
    # the sequence axis (workers/sequence.py): packed vs padded, Ulysses sp=2, dp=2 x sp=2, sp=2 with
    # a token budget; token-mean actor and critic with KL in the loss under SGD (S1), and AdamW with
    # a token-mean actor, a seq-mean-token-mean critic (a sequence split over ranks) and clipping (F1)
    ("S1/whole", "S1/pack-mb2"),
    ("S1/whole", "S1/sp2"),
    ("S1/whole", "S1/dp2-sp2"),
    ("S1/whole", "S1/sp2-dyn"),
    ("F1/whole", "F1/pack-mb2"),
    ("F1/whole", "F1/sp2"),
    ("F1/whole", "F1/sp2-dyn"),
]

_REPORT: list[str] = []


class _Report:
    """Prints every comparison in the terminal summary, whatever pytest's capture setting."""

    def pytest_terminal_summary(self, terminalreporter):
        if _REPORT:
            terminalreporter.section("exactness: worst differences per pair (fractions of tolerance)")
            for line in _REPORT:
                terminalreporter.write_line(line)


class Fits:
    def __init__(self, model_dir: str, tmp_factory):
        self.model_dir = model_dir
        self.tmp = tmp_factory
        self.record_path = str(tmp_factory.mktemp("exactness_rollouts") / "gen1")
        self._teacher_dir = None
        self.cache = {}

    @property
    def teacher_dir(self) -> str:
        """The distillation families' teacher: a random tiny model with the actor's vocabulary."""
        if self._teacher_dir is None:
            from rlflow.tiny import build_tiny_model

            self._teacher_dir = build_tiny_model(str(self.tmp.mktemp("exactness_teacher")), seed=7)
        return self._teacher_dir

    def overrides(self, name: str) -> dict:
        family, layout, extra = FITS[name]
        overrides = {**FAMILIES[family], **LAYOUTS[layout]}
        if overrides.get("teacher.enable"):
            overrides["teacher.model.path"] = self.teacher_dir
        if "steps" in extra:
            overrides["trainer.total_steps"] = extra["steps"]
        return overrides

    def __getitem__(self, name: str):
        if name not in self.cache:
            extra = FITS[name][2]
            overrides = self.overrides(name)
            if extra.get("record"):
                path = self.record_path if name == "gen1" else str(self.tmp.mktemp("exactness_rollouts") / name)
                overrides["trainer.record_rollouts"] = path
            else:
                source = extra.get("replay", "gen1")  # the recording this fit replays
                overrides["trainer.replay_rollouts"] = self[source].record_path
            result = run_fit(self.model_dir, str(self.tmp.mktemp("exactness_run")), workers=extra.get("workers"),
                             **overrides)
            result.record_path = overrides.get("trainer.record_rollouts")
            _REPORT.append(f"fit {name:<26} {result.seconds:6.1f} s")
            self.cache[name] = result
        return self.cache[name]


@pytest.fixture(scope="module")
def fits(ray_session, tmp_path_factory, request):
    request.config.pluginmanager.register(_Report(), "exactness-report")
    model_dir = build_varied_length_model(str(tmp_path_factory.mktemp("exactness_model")))
    return Fits(model_dir, tmp_path_factory)


def first_step_probes(fit, role: str) -> dict[str, float]:
    """The probes of the first optimizer step (both fits at their initial weights), by short name."""
    prefix = f"{role}/grad_probe/mb0/"
    return {k[len(prefix):]: float(v) for k, v in fit.steps()[0].items() if k.startswith(prefix)}


# ------------------------------------------------------------------------------------ the tests


def test_recorded_rollout_has_uneven_masks(fits):
    lengths = response_lengths(fits["gen1"].record_path)
    assert len(lengths) == STEPS
    flat = [n for step in lengths for n in step]
    assert len(set(flat)) >= 3, f"recorded response lengths barely vary: {lengths}"
    assert min(flat) >= 1 and max(flat) <= 6
    _REPORT.append(f"recorded response lengths per step: {lengths}")


def test_multi_turn_recording_has_holes_and_mixed_turn_counts(fits):
    """The M1 family's rollouts: observation tokens inside trajectories (attention 1, mask 0), and
    rows of one step with different numbers of model turns."""
    for step, batch in recorded_batches(fits["genM"].record_path).items():
        width = batch["prompts"].shape[1]
        mask, trajectory = batch["response_mask"], batch["attention_mask"][:, width:]
        assert (trajectory - mask).sum() > 0, f"step {step}: no observation holes"
        turns = [sum(1 for i in range(len(row)) if row[i] == 1 and (i == 0 or row[i - 1] == 0)) for row in mask.tolist()]
        assert len(set(turns)) > 1, f"step {step}: every row has {turns[0]} turns"
    assert fits["genM"].steps()[0]["agent/turns_mean"] > 1


def test_deterministic_mode_reproduces_a_generating_run(fits):
    a, b = fits["gen1"], fits["gen2"]
    ra, rb = recorded_batches(a.record_path), recorded_batches(b.record_path)
    assert sorted(ra) == sorted(rb) == list(range(STEPS))
    for step in ra:
        assert set(ra[step].keys()) == set(rb[step].keys())
        for key in ra[step].keys():
            assert torch.equal(ra[step][key], rb[step][key]), f"step {step}: recorded {key} differs between runs"
    diff = compare_fits(a, b, metrics=required_metrics(FAMILIES["F1"]), bitwise=True)
    _REPORT.append(f"gen1 vs gen2 (deterministic, bitwise): {diff.line()}")
    assert not diff.failures, diff.failures[:10]
    assert diff.param_abs == 0.0 and diff.num_probes > 0


def test_replay_reproduces_the_recorded_run(fits):
    """Replaying gen1's file through the real update path gives gen1's weights bit for bit."""
    diff = compare_fits(fits["gen1"], fits["F1/whole"], metrics=required_metrics(FAMILIES["F1"]), bitwise=True)
    _REPORT.append(f"gen1 vs F1/whole (replay, bitwise): {diff.line()}")
    assert not diff.failures, diff.failures[:10]


@pytest.mark.parametrize("pair", PAIRS, ids=[f"{a}~{b.split('/')[1]}" for a, b in PAIRS])
def test_layouts_are_equivalent(fits, pair):
    a, b = fits[pair[0]], fits[pair[1]]
    diff = compare_fits(a, b, metrics=required_metrics(FAMILIES[FITS[pair[0]][0]]))
    _REPORT.append(f"{pair[0]} vs {pair[1]}: {diff.line()}")
    assert diff.num_probes > 0
    assert not diff.failures, diff.failures[:10]


def test_layouts_ran_as_configured(fits):
    """Micro-batch counts per mini-batch (a MAX over ranks) show each layout did what it says."""
    def micro(name):
        return [h["actor/num_micro_batches"] for h in fits[name].steps()]

    assert micro("F1/whole") == [1.0] * STEPS and micro("F1/mb1") == [8.0] * STEPS and micro("F5/mb2") == [4.0] * STEPS
    assert micro("F3/dp2") == [1.0] * STEPS  # 4 rows per rank in one micro-batch
    for name in ("F5/dp2-ddp-mb2", "S1/dp2-mb2", "S1/dp2-ddp-mb2", "M1/dp2-mb2"):  # 4 rows per rank in 2 micro-batches
        assert micro(name) == [2.0] * STEPS, name
    assert all(n >= 2 for name in ("F2/dyn", "F4/dp2-dyn", "S1/dp2-dyn", "S1/sp2-dyn", "F1/sp2-dyn") for n in micro(name))
    for family in ("S1", "F1"):  # 8 rows per mini-batch: packed in micro-batches of 2, sp=2 in 2 of 4 rows
        assert micro(f"{family}/pack-mb2") == [4.0] * STEPS and micro(f"{family}/sp2") == [2.0] * STEPS
    assert micro("S1/dp2-sp2") == [2.0] * STEPS
    assert micro("D1/mb1") == [8.0] * STEPS and micro("D2/pack-mb2") == [4.0] * STEPS


def test_dp2_shards_hold_unequal_token_counts(fits):
    """The dp=2 token-mean layouts are the ones where a count taken per rank or per micro-batch is
    wrong: their mini-batches must put unequal token counts on the two ranks and in the micro-batches
    of one rank (the driver's plan, recomputed here from the recorded rollout)."""

    from controllers.ppo import PPOTrainer
    from conftest import tiny_overrides
    from rlflow import load_config
    from rlflow.protocol import split_micro_batches
    from workers.trainable import micro_batch_plan

    recorded = recorded_batches(fits.record_path)
    for name in ("S1/dp2-mb2", "S1/dp2-ddp-mb2", "S1/dp2-dyn", "S1/dp2-sp2"):
        cfg = load_config(None, tiny_overrides("unused", **{**BASE, **fits.overrides(name),
                                                            "reward.custom_function.path": __file__}))
        trainer = PPOTrainer(cfg)
        unequal_ranks = unequal_micro = 0
        per_step = []
        for step in sorted(recorded):
            batch = recorded[step]
            ranks = trainer.plan_minibatches(batch, "actor", step)
            for j in range(len(ranks[0])):
                rank_tokens = []
                for shards in ranks:
                    group = trainer.cfg.actor.model.share_prompt_forward  # as the actor worker plans
                    micros, _ = split_micro_batches(shards[j], **micro_batch_plan(trainer.cfg.actor, shards[j], group))
                    counts = [int(m["response_mask"].sum()) for m in micros]
                    unequal_micro += len(set(counts)) > 1
                    rank_tokens.append(counts)
                unequal_ranks += sum(rank_tokens[0]) != sum(rank_tokens[1])
                per_step.append(rank_tokens)
        _REPORT.append(f"{name}: response tokens per rank per micro-batch, each mini-batch: {per_step}")
        minibatches = len(per_step)
        assert unequal_ranks >= minibatches // 2, f"{name}: ranks hold equal token counts in most mini-batches"
        assert unequal_micro >= minibatches // 2, f"{name}: micro-batches hold equal token counts in most mini-batches"


def test_grad_clipping_was_active(fits):
    """F1 clips the actor at 0.5: the logged (pre-clip) norm is above it at every step."""
    for name in ("F1/whole", "F1/mb1"):
        norms = [h["actor/grad_norm"] for h in fits[name].steps()]
        assert min(norms) > 0.5 * 1.5, f"{name}: actor grad norms {norms} do not exceed actor.grad_clip=0.5"


def test_cispo_sapo_dppo_and_distillation_terms_act(fits):
    """The new objectives' families compare something: CISPO's clip changes weights (the second
    epoch's ratios leave [0, 1.28]), DPPO's trust region drops tokens, SAPO's gate leaves 1
    off-policy, the teacher's KLs are not 0."""
    cispo = [h for h in fits["C1/whole"].steps()]
    assert max(h["actor/pg_clipfrac"] for h in cispo) > 0, "C1: CISPO's clip never changed a weight"
    assert min(h["actor/pg_is_weight_mean"] for h in cispo) != max(h["actor/pg_is_weight_mean"] for h in cispo)
    assert max(h["actor/pg_clipfrac"] for h in fits["K1/whole"].steps()) > 0, "K1: no token left DPPO's trust region"
    gates = [h["actor/pg_gate_weight_mean"] for h in fits["P1/whole"].steps()]
    assert min(gates) < 1 - 1e-4, f"P1: SAPO's gate weights {gates} stayed at 1 (on-policy everywhere)"
    distill = fits["D1/whole"].steps()
    assert min(abs(h["actor/distill_reverse_kl"]) for h in distill) > 1e-3
    assert min(h["actor/distill_loss"] for h in distill) > 1e-4
    assert min(h["actor/distill_forward_kl"] for h in fits["D2/whole"].steps()) > 1e-3


def test_kl_loss_and_entropy_bonus_are_on(fits):
    for name in ("F2/dyn", "F4/dp2-dyn", "S1/dp2-mb2"):
        last = fits[name].history[-1]
        assert last["actor/kl_loss"] > 0 and last["actor/entropy_loss"] > 0


def test_sgd_moves_the_parameters_far_above_rounding(fits):
    """The S1 family's tolerance is a fraction of each tensor's movement: the movement must be far
    above float32 rounding of the weights (then the rtol part of the tolerance is what binds, and a
    2x gradient error moves a tensor ~2x as far)."""
    from exactness_helpers import FP32_EPS, PARAM_ULPS

    fit = fits["S1/whole"]
    for role in ("actor", "critic"):
        for name, start in fit.initial[role].items():
            moved = float((fit.weights[role][name] - start).abs().max())
            rounding = PARAM_ULPS * FP32_EPS * float(fit.weights[role][name].abs().max())
            assert moved > 100 * rounding, f"{role}.{name} moved {moved:.3g}, rounding {rounding:.3g}"


def test_critic_inherits_loss_scale_factor():
    from rlflow import load_config
    from conftest import tiny_overrides

    cfg = load_config(None, tiny_overrides("unused", **{**BASE, **FAMILIES["F3"], "reward.custom_function.path": __file__}))
    assert cfg.critic.loss_scale_factor == cfg.actor.loss_scale_factor == 5.0


def test_negative_control_local_normalisation_at_dp2(fits):
    """A test-only worker (exactness_workers.LocalNormalisation) ignores the driver's BatchMeta:
    each micro-batch divides by its own counts, and dp_size is not multiplied back. F1's critic is
    seq-mean-token-mean: a micro-batch of m sequences divides by m instead of the mini-batch's 8,
    and DDP's mean over the 2 ranks halves the sum, so the first gradient is exactly
    8 / (m * dp) = 8 / (2 * 2) = 2 times the right one, in every tensor and every projection (every
    recorded row has >= 1 valid token). The actor is token-mean with unequal micro-batch token
    counts: no single factor, and the layout comparison must fail on it."""
    expected = MINI / (2 * 2)
    assert min(n for step in response_lengths(fits.record_path) for n in step) >= 1
    right, local = fits["F1/whole"], fits["F1/dp2-ddp-mb2-localnorm"]
    whole_probes, local_probes = first_step_probes(right, "critic"), first_step_probes(local, "critic")
    assert whole_probes.keys() == local_probes.keys() and len(whole_probes) > 10
    factors = {name: local_probes[name] / whole_probes[name] for name in whole_probes if whole_probes[name] != 0}
    worst = max(factors.items(), key=lambda item: abs(item[1] - expected))
    _REPORT.append(f"negative control (local normalisation, dp=2 DDP, micro-batches of 2): critic probe factor at "
                   f"the first step {min(factors.values()):.6f}..{max(factors.values()):.6f}, expected {expected}")
    assert worst[1] == pytest.approx(expected, rel=1e-4), worst
    actor = first_step_probes(local, "actor")
    actor_right = first_step_probes(right, "actor")
    actor_factors = sorted(actor[n] / actor_right[n] for n in actor if n.startswith("norm/") and actor_right[n] != 0)
    _REPORT.append(f"  actor (token-mean) norm factors {actor_factors[0]:.3f}..{actor_factors[-1]:.3f}: no single factor")
    full = compare_fits(right, local, metrics=required_metrics(FAMILIES["F1"]))
    _REPORT.append(f"  F1/whole vs F1/dp2-ddp-mb2-localnorm (must fail): {full.line()}; {len(full.failures)} failures")
    assert any("actor/grad_probe/" in f for f in full.failures), full.failures[:5]
    assert any("critic/grad_probe/" in f for f in full.failures), full.failures[:5]
    assert any(f.startswith("step 1 critic/grad_norm") for f in full.failures), full.failures[:5]


def test_negative_control_doubled_gradient_of_one_tensor(fits):
    """A test-only worker doubles the gradient of one actor tensor. At the first optimizer step
    (same weights, same data) that tensor's gradient norm is exactly 2x and every other tensor's is
    unchanged; the comparison names it."""
    right, doubled = fits["S1/whole"], fits["S1/whole-doubled"]
    a, b = first_step_probes(right, "actor"), first_step_probes(doubled, "actor")
    target = f"norm/{exactness_workers.DOUBLED_TENSOR}"
    assert b[target] == pytest.approx(2 * a[target], rel=1e-6)
    others = {n: b[n] / a[n] for n in a if n.startswith("norm/") and n != target and a[n] != 0}
    assert len(others) > 10 and all(f == pytest.approx(1.0, rel=1e-6) for f in others.values()), others
    first = compare_fits(right, doubled, metrics=(), params=False)
    first_step_norm_failures = [f.split(":")[0] for f in first.failures if "/mb0/norm/" in f]
    _REPORT.append(f"negative control (one actor tensor's gradient doubled): {target} factor {b[target] / a[target]:.6f}; "
                   f"other tensors {min(others.values()):.6f}..{max(others.values()):.6f}; "
                   f"norm failures at the first step: {first_step_norm_failures}")
    assert first_step_norm_failures == [f"step 1 actor/grad_probe/mb0/{target}"], first.failures[:5]
    assert any("/proj" in f for f in first.failures)


def test_negative_control_sp_rank_normalises_by_its_own_tokens(fits):
    """A test-only worker (exactness_workers.SpLocalNormalisation) at sp=2 divides each micro-batch
    loss by the counts of the response tokens its own slice of the packed row predicts, not the
    driver's BatchMeta (the sequence-parallel form of the bug): the comparison with the whole batch
    must fail on both roles' gradients, while the correct sp=2 layout passes (PAIRS)."""
    right, local = fits["S1/whole"], fits["S1/sp2-localnorm"]
    full = compare_fits(right, local, metrics=(), params=False)
    first = [f for f in full.failures if f.startswith("step 1 ")]
    _REPORT.append(f"negative control (sp=2, each sp rank normalised by its own tokens): {len(first)} failures at the "
                   f"first step, e.g. {first[:1]}")
    assert any("actor/grad_probe/" in f for f in first), full.failures[:5]
    assert any("critic/grad_probe/" in f for f in first), full.failures[:5]


def test_negative_control_sp_gradient_not_reduced_over_the_sp_group(fits):
    """A test-only layout (exactness_workers.SpUnreducedGradient) gathers the sp ranks' outputs
    but leaves out the all-reduce of their gradient: each rank keeps only its own copy of the loss's
    gradient, so at the first optimizer step every gradient is exactly 1/sp_size of the right one,
    in every tensor and projection of both roles."""
    right, unreduced = fits["S1/whole"], fits["S1/sp2-unreduced"]
    for role in ("actor", "critic"):
        a, b = first_step_probes(right, role), first_step_probes(unreduced, role)
        assert a.keys() == b.keys() and len(a) > 10
        factors = {name: b[name] / a[name] for name in a if abs(a[name]) > 1e-9}
        worst = max(factors.items(), key=lambda item: abs(item[1] - 0.5))
        _REPORT.append(f"negative control (sp=2 gradient not all-reduced): {role} probe factors at the first step "
                       f"{min(factors.values()):.6f}..{max(factors.values()):.6f}, expected 0.5")
        assert worst[1] == pytest.approx(0.5, rel=1e-3), worst
    first = compare_fits(right, unreduced, metrics=(), params=False)
    assert any(f.startswith("step 1 actor/grad_probe/") for f in first.failures), first.failures[:5]


def test_first_sgd_step_equals_an_independent_float64_gradient(fits):
    """Layout comparisons cannot see an error every layout shares (a tensor's gradient doubled on
    every path, an entropy bonus with the wrong sign). So one real fit (Ray workers, 4 micro-batches,
    PPO with a critic, on-policy, one SGD step) is checked against the objective written out here
    in float64 from the recorded rollout and the fit's initial weights: token-mean PPO at ratio 1
    with GAE (gamma = lam = 1: return = the sequence's score, advantage = return - value, whitened
    over the valid tokens) and an entropy bonus, and the token-mean value loss (at the first step
    the value clip is inactive: the predictions are the old values). The worker's gradient probes
    must equal this gradient's, and the SGD update must be -lr times it. The sampling temperature
    is 0.7: log-probs and entropy are those of logits / temperature."""
    from transformers import AutoModelForCausalLM

    from exactness_helpers import FP32_EPS, PARAM_ULPS
    from workers.critic import load_value_model
    from workers.probes import probe_vector

    fit = fits["A1/mb4"]
    assert [h["actor/num_micro_batches"] for h in fit.steps()] == [4.0]
    record = recorded_batches(fits.record_path)[0]
    actor = AutoModelForCausalLM.from_pretrained(fits.model_dir, dtype=torch.float64)
    actor.load_state_dict(fit.initial["actor"])
    critic = load_value_model(fits.model_dir, "float32").double()
    critic.load_state_dict(fit.initial["critic"])
    prompt_width, width = record["prompts"].shape[1], record["responses"].shape[1]
    inputs = {k: record[k] for k in ("input_ids", "attention_mask", "position_ids")}
    window = slice(prompt_width - 1, prompt_width - 1 + width)  # column t predicts response token t - P + 1
    mask = record["response_mask"].double()
    num_tokens = mask.sum()

    logits = actor(**inputs, use_cache=False).logits[:, window] / FAMILIES["A1"]["rollout.temperature"]
    log_probs = torch.log_softmax(logits, -1)
    token_log_prob = log_probs.gather(-1, record["responses"].unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    values = critic(**inputs, use_cache=False).logits[:, window, 0] * mask
    returns = record["token_level_scores"].double().sum(-1, keepdim=True) * mask
    raw = (returns - values.detach()) * mask
    mean = (raw * mask).sum() / num_tokens
    var = (((raw - mean) ** 2) * mask).sum() / (num_tokens - 1)
    advantages = (raw - mean) / torch.sqrt(var + 1e-8)
    ratio = torch.exp(token_log_prob - token_log_prob.detach())
    entropy_coeff = BASE["actor.entropy_coeff"]
    actor_loss = ((-advantages * ratio - entropy_coeff * entropy) * mask).sum() / num_tokens
    critic_loss = 0.5 * (((values - returns) ** 2) * mask).sum() / num_tokens
    actor_loss.backward()
    critic_loss.backward()

    worst = {}
    for role, model in (("actor", actor), ("critic", critic)):
        grads = {name: p.grad for name, p in model.named_parameters()}
        probes = first_step_probes(fit, role)
        whole_norm = math.sqrt(sum(float(g.norm()) ** 2 for g in grads.values()))
        for name, grad in grads.items():
            got = probes[f"norm/{name}"]
            assert got == pytest.approx(float(grad.norm()), rel=1e-4, abs=1e-6 * whole_norm), (role, name)
            worst[f"{role} norm"] = max(worst.get(f"{role} norm", 0), abs(got - float(grad.norm())) / whole_norm)
        for k in range(fit_num_projections(fit, role)):
            expected = sum(float((g * probe_vector(0, n, k, g.shape)).sum()) for n, g in grads.items())
            assert probes[f"proj{k}"] == pytest.approx(expected, abs=1e-4 * whole_norm), (role, k)
            worst[f"{role} proj"] = max(worst.get(f"{role} proj", 0), abs(probes[f"proj{k}"] - expected) / whole_norm)
        lr = SGD_LR[role]
        for name, grad in grads.items():
            moved = fit.weights[role][name].double() - fit.initial[role][name].double()
            expected = -lr * grad
            tol = 1e-3 * float(expected.abs().max()) + PARAM_ULPS * FP32_EPS * fit.weights[role][name].double().abs()
            excess = float(((moved - expected).abs() / tol.clamp(min=1e-30)).max())
            worst[f"{role} update"] = max(worst.get(f"{role} update", 0), excess)
            assert excess <= 1, f"{role}.{name}: the SGD update is not -lr * the float64 gradient ({excess:.3g} of tol)"
    _REPORT.append("A1 (one SGD step) vs an independent float64 gradient: "
                   + ", ".join(f"{k} {v:.3g}" for k, v in worst.items())
                   + " (norm/proj: |d| / whole gradient norm; update: fraction of tolerance)")


def fit_num_projections(fit, role: str) -> int:
    return sum(1 for name in first_step_probes(fit, role) if name.startswith("proj"))


def test_vf_clipfrac_counts_only_clipped_tokens():
    """compute_value_loss counts a token as clipped only when the clip moved it: values +
    clamp(vpreds - values) can round one ulp away from vpreds inside the range, which made the
    fraction depend on the split."""
    from rlflow.algos import compute_value_loss

    gen = torch.Generator().manual_seed(0)
    values = 0.3 * torch.randn(256, 64, generator=gen)
    vpreds = 0.3 * torch.randn(256, 64, generator=gen)
    returns = torch.randn(256, 64, generator=gen)
    inside = ((vpreds - values).abs() <= 0.5).float()  # only tokens the clip leaves alone
    _, clipfrac = compute_value_loss(vpreds, returns, values, inside, cliprange_value=0.5)
    assert float(clipfrac) == 0.0
