"""Per-token KL estimators between the policy and the reference, and KL coefficient controllers.

Estimators follow Schulman's "Approximating KL divergence" naming (k1, k2, k3) with verl's aliases.
All take per-token log-probs of the SAMPLED tokens and return a per-token tensor; aggregate it with
agg_loss (KL in the loss) or subtract kl_coef * it from the rewards (KL in the reward).
"""

from __future__ import annotations

import torch

KL_PENALTY_MODES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")

# exp() stays finite and k3's heavy tail stays bounded (common practice: inner 20, outer 10).
_K3_LOG_RATIO_CLAMP = 20.0
_K3_VALUE_CLAMP = 10.0


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty_mode: str) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate from sampled-token log-probs.

    - "kl"/"k1": logprob - ref_logprob (unbiased, high variance, can be negative)
    - "abs": |logprob - ref_logprob|
    - "mse"/"k2": 0.5 * (logprob - ref_logprob)^2
    - "low_var_kl"/"k3": r - log r - 1 with r = ref/pi (>= 0, unbiased, low variance), clamped to
      [-10, 10]
    """
    log_ratio = logprob - ref_logprob
    if kl_penalty_mode in ("kl", "k1"):
        return log_ratio
    if kl_penalty_mode == "abs":
        return log_ratio.abs()
    if kl_penalty_mode in ("mse", "k2"):
        return 0.5 * log_ratio.square()
    if kl_penalty_mode in ("low_var_kl", "k3"):
        ref_over_pi = torch.clamp(-log_ratio, -_K3_LOG_RATIO_CLAMP, _K3_LOG_RATIO_CLAMP)
        k3 = torch.exp(ref_over_pi) - ref_over_pi - 1.0
        return torch.clamp(k3, -_K3_VALUE_CLAMP, _K3_VALUE_CLAMP)
    if kl_penalty_mode == "full":
        raise NotImplementedError("kl_penalty_mode='full' needs full-vocabulary logits; not supported")
    raise ValueError(
        f"Unknown kl_penalty_mode {kl_penalty_mode!r}; expected one of: {', '.join(KL_PENALTY_MODES)}"
    )


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""

    def state_dict(self) -> dict:
        return {"type": "fixed", "value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019): steer the measured KL towards target_kl.

    value *= 1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if not target_kl > 0:
            raise ValueError(f"AdaptiveKLController needs target_kl > 0, got {target_kl!r}")
        if not horizon > 0:
            raise ValueError(f"AdaptiveKLController needs horizon > 0, got {horizon!r}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"type": "adaptive", "value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        # target/horizon come from the config; only the learned coefficient is restored, but a
        # stored target/horizon is honoured so a resumed run continues exactly.
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = state.get("horizon", self.horizon)


def get_kl_controller(type: str = "fixed", kl_coef: float = 0.001, target_kl=None, horizon=None):
    """Build the KL controller named by ``type`` ("fixed" or "adaptive")."""
    if type == "fixed":
        return FixedKLController(kl_coef)
    if type == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError("the adaptive KL controller needs target_kl and horizon")
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"Unknown KL controller type {type!r}; expected 'fixed' or 'adaptive'")
