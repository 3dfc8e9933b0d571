"""Helpers for tests/test_exactness.py: a tiny model that stops at varied lengths, a reward that
varies, one real fit per layout, and the comparison of parameters and metrics."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

import torch

from conftest import tiny_overrides

# the per-step metrics whose values must not depend on the layout
COMPARED_METRICS = (
    "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/entropy_loss", "actor/pg_clipfrac",
    "actor/ppo_kl", "actor/grad_norm", "critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean",
    "critic/grad_norm",
)
PARAM_RTOL, PARAM_ATOL = 1e-4, 1e-6
METRIC_RTOL, METRIC_ATOL = 1e-4, 1e-6

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


def exactness_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """A deterministic reward that varies with the text (a random model never solves the task)."""
    return (sum(map(ord, solution_str)) % 7) / 3.0 - 1.0


# every fit: 16 responses per step (8 prompts x n=2), mini-batches of 8 -> 2 per epoch, 2 epochs,
# 3 steps -> 12 optimizer steps per model; a critic (gae) and an entropy bonus
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
    # default Adam (eps 1e-8). Its per-element normalisation m/(sqrt(v)+eps) turns float-rounding
    # noise in gradient elements that are nearly zero (e.g. k_proj.bias along slowly rotating RoPE
    # dimensions) into parameter differences proportional to lr; measured, worst pair, as a
    # fraction of the parameter tolerance: lr 1e-4 -> 1.4, 3e-5 -> 0.92, 1e-5 -> 1.04 (token-sum),
    # 3e-6 -> 0.32. So a realistic RL lr (verl's defaults: actor 1e-6, critic 1e-5) for both
    "actor.optim.lr": 3e-6,
    "critic.optim.lr": 3e-6,
    "algorithm.adv_estimator": "gae",
    "trainer.total_steps": 3,
    "trainer.deterministic": True,
    "trainer.logger": "[jsonl]",
    "reward.custom_function.name": "exactness_score",
}


@dataclass
class FitResult:
    history: list[dict]
    weights: dict[str, dict[str, torch.Tensor]]
    seconds: float
    record_path: str | None = None


def run_fit(model_dir: str, out_dir: str, env: dict | None = None, **overrides) -> FitResult:
    """One real fit (Ray workers, gloo) with the final actor and critic weights captured."""
    from controllers.ppo import PPOTrainer
    from rlflow import load_config

    settings = dict(BASE)
    settings["reward.custom_function.path"] = os.path.abspath(__file__)
    settings["trainer.default_local_dir"] = out_dir
    settings.update(overrides)
    cfg = load_config(None, tiny_overrides(model_dir, **settings))
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        start = time.perf_counter()
        trainer = PPOTrainer(cfg, capture_final_weights=True)
        history = trainer.fit()
        seconds = time.perf_counter() - start
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    assert trainer.final_weights and set(trainer.final_weights) == {"actor", "critic"}
    return FitResult(history, trainer.final_weights, seconds)


# ------------------------------------------------------------------------------ comparisons


def _excess(diff: torch.Tensor, tol: torch.Tensor) -> torch.Tensor:
    """diff in units of the tolerance (<= 1 passes); a zero tolerance means bitwise equality."""
    zero = torch.zeros_like(diff)
    return torch.where(tol > 0, diff / torch.where(tol > 0, tol, torch.ones_like(tol)),
                       torch.where(diff > 0, torch.full_like(diff, math.inf), zero))


@dataclass
class Diff:
    """The worst differences between two fits."""

    param_abs: float = 0.0  # max |a - b| over all parameters of both models
    param_where: str = ""
    param_excess: float = 0.0  # max |a-b| / (atol + rtol*|b|): <= 1 passes
    metric_abs: float = 0.0
    metric_rel: float = 0.0  # max |a-b| / |b| among metric values with |b| > 1e-3
    metric_where: str = ""
    metric_excess: float = 0.0
    failures: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (f"params max|d|={self.param_abs:.3g} ({self.param_where}; {self.param_excess:.3f} of tol)  "
                f"metrics max|d|={self.metric_abs:.3g} max rel={self.metric_rel:.3g} "
                f"({self.metric_where}; {self.metric_excess:.3f} of tol)")


def compare_fits(a: FitResult, b: FitResult, metrics=COMPARED_METRICS,
                 rtol: float = PARAM_RTOL, atol: float = PARAM_ATOL,
                 metric_rtol: float = METRIC_RTOL, metric_atol: float = METRIC_ATOL) -> Diff:
    diff = Diff()
    for role in ("actor", "critic"):
        wa, wb = a.weights[role], b.weights[role]
        if set(wa) != set(wb):
            diff.failures.append(f"{role}: different parameter names {sorted(set(wa) ^ set(wb))[:5]}")
            continue
        for name in wa:
            x, y = wa[name].double(), wb[name].double()
            d = (x - y).abs()
            worst = float(d.max()) if d.numel() else 0.0
            excess = float(_excess(d, atol + rtol * y.abs()).max()) if d.numel() else 0.0
            if worst > diff.param_abs:
                diff.param_abs = worst
                diff.param_where = f"{role}.{name}"
            diff.param_excess = max(diff.param_excess, excess)
            if excess > 1:
                diff.failures.append(f"{role}.{name}: max |d|={worst:.3g} exceeds rtol={rtol}/atol={atol}")
    steps_a = [h for h in a.history if "actor/pg_loss" in h]
    steps_b = [h for h in b.history if "actor/pg_loss" in h]
    if len(steps_a) != len(steps_b) or len(steps_a) < 3:
        diff.failures.append(f"step counts {len(steps_a)} vs {len(steps_b)} (3+ expected)")
    for required in ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm"):
        if required in metrics and not all(required in h for h in steps_a + steps_b):
            diff.failures.append(f"{required} missing from a step's metrics")
    for ha, hb in zip(steps_a, steps_b):
        for name in metrics:
            if name not in ha or name not in hb:
                if (name in ha) != (name in hb):
                    diff.failures.append(f"step {ha['step']}: {name} logged by only one run")
                continue
            x, y = float(ha[name]), float(hb[name])
            if not (math.isfinite(x) and math.isfinite(y)):
                diff.failures.append(f"step {ha['step']}: {name} not finite ({x}, {y})")
                continue
            d = abs(x - y)
            excess = float(_excess(torch.tensor(d), torch.tensor(metric_atol + metric_rtol * abs(y))))
            if abs(y) > 1e-3:
                diff.metric_rel = max(diff.metric_rel, d / abs(y))
            if d > diff.metric_abs:
                diff.metric_abs = d
            if excess > diff.metric_excess:
                diff.metric_excess = excess
                diff.metric_where = f"step {ha['step']} {name} {x:.6g} vs {y:.6g}"
            if excess > 1:
                diff.failures.append(f"step {ha['step']}: {name} {x!r} vs {y!r} (|d|={d:.3g})")
    return diff


def response_lengths(record_path: str) -> list[list[int]]:
    recorded = torch.load(record_path, weights_only=True)
    return [recorded[s]["response_mask"].sum(-1).tolist() for s in sorted(recorded)]
