"""Helpers for tests/test_exactness.py: a tiny model that stops at varied lengths, a reward that
varies, one real fit per layout, and the comparison of parameters and metrics."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

import torch
from tensordict import TensorDict

from conftest import tiny_overrides
from text_rewards import REWARD_FILE

# the per-step metrics whose values must not depend on the layout; every one must be logged by
# both runs of a pair (a missing metric fails the comparison, it is never skipped)
COMPARED_METRICS = (
    "actor/pg_loss", "actor/entropy", "actor/entropy_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower",
    "actor/ppo_kl", "actor/grad_norm", "critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean",
    "critic/grad_norm",
)
KL_METRICS = ("actor/kl_loss",)  # families with actor.use_kl_loss
# the terms a policy loss or an objective adds, each logged with its declared aggregation
POLICY_LOSS_METRICS = {"cispo": ("actor/pg_is_weight_mean",), "sapo": ("actor/pg_gate_weight_mean",)}
DISTILL_METRICS = ("actor/distill_loss", "actor/distill_reverse_kl")  # families with actor.distill.coef > 0
DISTILL_TOPK_METRICS = ("actor/distill_loss", "actor/distill_forward_kl")  # ... and actor.distill.top_k > 0
# Metrics: rtol of the metric's largest magnitude over the fit, not of this step's value. A loss
# is a mean of per-token terms of both signs, and its float noise is that of the terms: in a step
# where they cancel (M1's pg_loss: 0.011 there, 0.18 in the other steps) a tolerance relative to
# the sum would ask for more digits than float32 terms carry.
METRIC_RTOL, METRIC_ATOL = 1e-4, 1e-6
# Parameters: the difference of two fits, per tensor, in units of that tensor's whole movement
# during the fit (max |final - initial|), plus a few float32 ulps of the weight itself. Relative to
# the weight (the old rule) a tensor near 1 (RMSNorm) got a tolerance larger than its movement.
# AdamW steps each element by about lr whatever its gradient's size, so rounding noise in a nearly
# zero gradient element moves it as far as a real gradient would: its parameters are weak evidence
# (the gradient probes carry it) and get a looser fraction than SGD's, whose update is -lr * g.
PARAM_RTOL = {"adamw": 5e-2, "sgd": 1e-3}
PARAM_ULPS = 4
# Gradient probes: per-tensor gradient norms relative to that tensor's largest gradient norm over
# the fit (its steps and mini-batches), projections <g, r_k> relative to the norm of the whole
# gradient of that optimizer step (E|<g, r>| = |g| for Gaussian r). As for the metrics, a norm that
# is small by cancellation (M1: model.norm.weight's 0.0017 in one mini-batch, 0.013-0.2 in the
# others) carries the float noise of the larger terms it is made of, not of itself.
PROBE_RTOL = 1e-4
FP32_EPS = torch.finfo(torch.float32).eps

EOS_SHIFT, EOS_LOGIT_GAIN = 0.3, 1.5  # measured: sampled lengths 1..6 spread fairly evenly


def build_varied_length_model(out_dir: str) -> str:
    """A randomly initialised (un-SFT'd) tiny Qwen2 whose sampled responses end at varied lengths.

    A random model (260-token vocabulary) rarely samples EOS within a few tokens, so most responses
    would fill max_response_length and the masks would be nearly equal. Untie the embeddings, give every
    input embedding a constant component in one hidden dimension (it survives the residual stream
    and the final RMSNorm) and let only EOS's output row read it: EOS becomes a likely token at
    every position while the rest of the model stays random.
    """
    from transformers import AutoModelForCausalLM

    from rlflow.tiny import build_tiny_model

    build_tiny_model(out_dir, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    eos = model.config.eos_token_id
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = EOS_SHIFT
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[eos, 0] = EOS_LOGIT_GAIN
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


# every fit: 16 responses per step (8 prompts x n=2), mini-batches of 8 -> 2 per epoch, 2 epochs,
# 2 steps -> 8 optimizer steps per model, the second step's rollout scored and updated from weights
# the first step moved; a critic (gae) and an entropy bonus
STEPS = 2
BASE = {
    "data.max_prompt_length": 16,
    "data.max_response_length": 6,
    "actor.ppo_mini_batch_size": 8,
    "actor.ppo_micro_batch_size_per_gpu": 8,
    "actor.ppo_epochs": 2,
    "actor.kl_loss_coef": 0.1,  # KL in the loss (and so the reference worker) where a family turns it on
    "actor.entropy_coeff": 0.01,
    "actor.grad_clip": 1e6,  # off unless a case sets it
    "critic.grad_clip": 1e6,
    # AdamW families: its per-element normalisation m/(sqrt(v)+eps) turns float-rounding noise in
    # gradient elements that are nearly zero into parameter differences proportional to lr, so a
    # realistic RL lr (verl's defaults: actor 1e-6, critic 1e-5). SGD families set their own.
    "actor.optim.lr": 3e-6,
    "critic.optim.lr": 3e-6,
    "algorithm.adv_estimator": "gae",
    "trainer.total_steps": STEPS,
    "trainer.deterministic": True,
    "trainer.logger": "[jsonl]",
    "trainer.grad_probes.enable": True,
    "reward.custom_function.name": "exactness_score",
    "reward.num_workers": 0,  # scored in the driver: the same function, without 2 pool processes per fit
}


@dataclass
class FitResult:
    history: list[dict]
    weights: dict[str, dict[str, torch.Tensor]]  # final, per role
    initial: dict[str, dict[str, torch.Tensor]]  # what each role started from
    optimizer: str  # actor.optim.name (both roles use the same in the matrix)
    seconds: float
    record_path: str | None = None

    def steps(self) -> list[dict]:
        return [h for h in self.history if "actor/pg_loss" in h]


def run_fit(model_dir: str, out_dir: str, workers: dict | None = None, **overrides) -> FitResult:
    """One real fit (Ray workers, gloo) with the initial and final actor and critic weights."""
    import exactness_workers
    from rlflow import load_config
    from trainers import CapturingTrainer

    settings = dict(BASE)
    settings["reward.custom_function.path"] = REWARD_FILE
    settings["trainer.default_local_dir"] = out_dir
    settings.update(overrides)
    cfg = load_config(None, tiny_overrides(model_dir, **settings))
    start = time.perf_counter()
    trainer = CapturingTrainer(cfg, worker_classes=workers or exactness_workers.RECORDING)
    history = trainer.fit()
    seconds = time.perf_counter() - start
    assert trainer.final_weights and set(trainer.final_weights) == {"actor", "critic"}
    initial = {role: torch.load(exactness_workers.initial_weights_path(out_dir, role), weights_only=True)
               for role in trainer.final_weights}
    return FitResult(history, trainer.final_weights, initial, cfg.actor.optim.name, seconds)


# ------------------------------------------------------------------------------ comparisons


def required_metrics(family: dict) -> tuple[str, ...]:
    return (COMPARED_METRICS + (KL_METRICS if family.get("actor.use_kl_loss") else ())
            + POLICY_LOSS_METRICS.get(family.get("actor.policy_loss", "vanilla"), ())
            + (() if family.get("actor.distill.coef", 0) == 0
               else DISTILL_TOPK_METRICS if family.get("actor.distill.top_k", 0) > 0 else DISTILL_METRICS))


def probe_names(step: dict) -> list[str]:
    return sorted(name for name in step if "/grad_probe/" in name)


def _tensor_key(name: str) -> str:
    """'actor/grad_probe/mb1/norm/model.norm.weight' -> 'actor/model.norm.weight'."""
    return name.split("/", 1)[0] + "/" + name.split("/norm/", 1)[1]


def _norm_scales(steps: list[dict]) -> dict[str, float]:
    """Each role's tensor's largest gradient norm over a fit's steps and mini-batches."""
    scales: dict[str, float] = {}
    for step in steps:
        for name in probe_names(step):
            if "/norm/" in name:
                key = _tensor_key(name)
                scales[key] = max(scales.get(key, 0.0), abs(float(step[name])))
    return scales


def _probe_scale(step: dict, name: str, norm_scales: dict[str, float], whole: bool = False) -> float:
    """What a probe's tolerance is relative to: for a norm (whole=False) that tensor's largest norm
    over the fit (norm_scales), for a projection the whole gradient's norm (sqrt of the sum of the
    squared tensor norms of that role and optimizer step), and that for every probe with whole=True."""
    if "/norm/" in name and not whole:
        return norm_scales[_tensor_key(name)]
    if "/norm/" in name:
        name = name.split("/norm/", 1)[0] + "/proj"
    prefix = name.rsplit("/", 1)[0] + "/norm/"
    return math.sqrt(math.fsum(float(v) ** 2 for k, v in step.items() if k.startswith(prefix)))


@dataclass
class Diff:
    """The worst differences between two fits, each also as a fraction of its tolerance."""

    param_abs: float = 0.0
    param_where: str = ""
    param_excess: float = 0.0  # max |a-b| / tolerance over every parameter element: <= 1 passes
    probe_excess: float = 0.0
    probe_where: str = ""
    metric_rel: float = 0.0  # max |a-b| / |b| among metric values with |b| > 1e-3
    metric_excess: float = 0.0
    metric_where: str = ""
    num_probes: int = 0
    failures: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (f"params {self.param_excess:.3f} of tol (max|d|={self.param_abs:.3g} {self.param_where}); "
                f"probes {self.probe_excess:.3f} of tol ({self.num_probes} compared; {self.probe_where}); "
                f"metrics {self.metric_excess:.3f} of tol (max rel {self.metric_rel:.3g}; {self.metric_where})")


def _compare_value(diff: Diff, where: str, x: float, y: float, tol: float, kind: str) -> None:
    if not (math.isfinite(x) and math.isfinite(y)):
        diff.failures.append(f"{where}: not finite ({x}, {y})")
        return
    d = abs(x - y)
    excess = d / tol if tol > 0 else (math.inf if d > 0 else 0.0)
    if kind == "probe":
        if excess >= diff.probe_excess:
            diff.probe_excess, diff.probe_where = excess, f"{where} {x:.6g} vs {y:.6g}"
    else:
        if abs(y) > 1e-3:
            diff.metric_rel = max(diff.metric_rel, d / abs(y))
        if excess >= diff.metric_excess:
            diff.metric_excess, diff.metric_where = excess, f"{where} {x:.6g} vs {y:.6g}"
    if excess > 1:
        diff.failures.append(f"{where}: {x!r} vs {y!r} (|d|={d:.3g}, {excess:.3g} of tol)")


def compare_params(diff: Diff, a: FitResult, b: FitResult, rtol: float | None, relative_to_whole: bool = False) -> None:
    """Per tensor: |a - b| <= rtol * max|b_final - initial| + PARAM_ULPS ulps of |b| (rtol 0:
    bitwise; relative_to_whole: the largest movement of any tensor of the role). Both fits must
    start from the same weights."""
    for role in ("actor", "critic"):
        wa, wb, w0 = a.weights[role], b.weights[role], b.initial[role]
        if not (set(wa) == set(wb) == set(w0) == set(a.initial[role])):
            diff.failures.append(f"{role}: different parameter names")
            continue
        whole_movement = max(float((wb[n].double() - w0[n].double()).abs().max()) for n in wb if wb[n].numel())
        for name in wb:
            if not torch.equal(a.initial[role][name], w0[name]):
                diff.failures.append(f"{role}.{name}: the two fits started from different weights")
            x, y = wa[name].double(), wb[name].double()
            d = (x - y).abs()
            if not d.numel():
                continue
            worst = float(d.max())
            if rtol == 0:
                excess = math.inf if worst > 0 else 0.0
            else:
                movement = whole_movement if relative_to_whole else float((y - w0[name].double()).abs().max())
                tol = rtol * movement + PARAM_ULPS * FP32_EPS * y.abs()
                excess = float((d / tol.clamp(min=1e-30)).max())
            if worst > diff.param_abs:
                diff.param_abs, diff.param_where = worst, f"{role}.{name}"
            diff.param_excess = max(diff.param_excess, excess)
            if excess > 1:
                diff.failures.append(f"{role}.{name}: max |d|={worst:.3g} is {excess:.3g} of its tolerance")


def compare_fits(a: FitResult, b: FitResult, metrics=COMPARED_METRICS, param_rtol: float | None = None,
                 probe_rtol: float = PROBE_RTOL, metric_rtol: float = METRIC_RTOL,
                 metric_atol: float = METRIC_ATOL, probes: bool = True, params: bool = True,
                 bitwise: bool = False, relative_to_whole: bool = False) -> Diff:
    """Parameters, gradient probes (every one both runs logged) and `metrics` (each required in
    every step of both runs). bitwise: every tolerance is 0. relative_to_whole: a tensor's
    gradient norm is compared relative to the whole gradient's norm, not to itself, and its
    parameters relative to the largest movement of any tensor of the role, not to its own."""
    if bitwise:
        param_rtol, probe_rtol, metric_rtol, metric_atol = 0.0, 0.0, 0.0, 0.0
    diff = Diff()
    if params:
        compare_params(diff, a, b, PARAM_RTOL[b.optimizer] if param_rtol is None else param_rtol, relative_to_whole)
    steps_a, steps_b = a.steps(), b.steps()
    if len(steps_a) != len(steps_b) or not steps_b:
        diff.failures.append(f"step counts {len(steps_a)} vs {len(steps_b)}")
    metric_scale = {name: max((abs(float(h[name])) for h in steps_b if name in h), default=0.0) for name in metrics}
    norm_scales = _norm_scales(steps_b)
    for ha, hb in zip(steps_a, steps_b):
        for name in metrics:
            if name not in ha or name not in hb:
                diff.failures.append(f"step {hb['step']}: {name} missing (a: {name in ha}, b: {name in hb})")
                continue
            y = float(hb[name])
            _compare_value(diff, f"step {hb['step']} {name}", float(ha[name]), y,
                           metric_atol + metric_rtol * metric_scale[name], "metric")
        if not probes:
            continue
        names_a, names_b = probe_names(ha), probe_names(hb)
        if names_a != names_b:
            diff.failures.append(f"step {hb['step']}: probe names differ ({sorted(set(names_a) ^ set(names_b))[:4]})")
        for role in ("actor", "critic"):
            if not any(n.startswith(f"{role}/") for n in names_b):
                diff.failures.append(f"step {hb['step']}: no {role} gradient probes")
        for name in names_b:
            if name in ha:
                y = float(hb[name])
                diff.num_probes += 1
                _compare_value(diff, f"step {hb['step']} {name}", float(ha[name]), y,
                               probe_rtol * _probe_scale(hb, name, norm_scales, relative_to_whole), "probe")
    return diff


def recorded_batches(folder: str) -> dict[int, TensorDict]:
    """{step: the rollout batch} of a trainer.record_rollouts folder."""
    from controllers.rollout_source import read_recorded, recorded_steps

    return {step: read_recorded(folder, step).batch for step in sorted(recorded_steps(folder))}


def response_lengths(record_path: str) -> list[list[int]]:
    recorded = recorded_batches(record_path)
    return [recorded[s]["response_mask"].sum(-1).tolist() for s in sorted(recorded)]
