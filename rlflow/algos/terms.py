"""A role's micro-batch loss as a sum of loss terms (the contract in losses.py), built from config.

The actor's loss is its policy loss, plus the entropy bonus when entropy_coeff != 0, plus the KL
loss when use_kl_loss; the critic's is the value loss. Each term aggregates through agg_loss with
the mini-batch's BatchMeta, so the sum does too. The builders read a config section by attribute
(rlflow.config's ActorConfig / CriticConfig, or its DictConfig): this module imports no omegaconf.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from rlflow.metrics import Metric

from .losses import (
    LOSS_TERMS,
    POLICY_LOSSES,
    Batch,
    LossOptionError,
    LossOptions,
    TermSpec,
    get_policy_loss,
    option_names,
)


@dataclass(frozen=True)
class LossTerm:
    """A term bound to its options: term(batch, meta) -> (contribution to the loss, metrics)."""

    name: str
    spec: TermSpec
    options: LossOptions

    def __call__(self, batch: Batch, meta) -> tuple[torch.Tensor, dict[str, Metric]]:
        missing = [key for key in self.spec.inputs if key not in batch]
        if missing:
            raise KeyError(f"loss term {self.name!r} reads batch keys {missing}, which this batch lacks")
        return self.spec.fn(batch, meta, self.options)


def registered_terms() -> dict[str, TermSpec]:
    """Every term a role's loss can hold: each policy loss ("policy_loss:<name>") and the others."""
    return {**{f"policy_loss:{name}": spec for name, spec in POLICY_LOSSES.items()}, **LOSS_TERMS}


def options_from_section(options_cls: type, section, own: Mapping | None = None, **shared) -> LossOptions:
    """options_cls with its section_defaults read from `section` (the config key of the same name),
    then `own` (a term's own settings, e.g. actor.policy_loss_options) on top; `shared`:
    loss_agg_mode and loss_scale_factor."""
    own = dict(own or {})
    valid = option_names(options_cls)
    unknown = sorted(set(own) - set(valid))
    if unknown:
        raise LossOptionError(unknown[0], f"is not an option of {options_cls.__name__}; valid: {', '.join(valid) or 'none'}")
    inherited = {key: getattr(section, key) for key in options_cls.section_defaults}
    return options_cls(**shared, **{**inherited, **own})


def _shared(section) -> dict:
    return {"loss_agg_mode": section.loss_agg_mode, "loss_scale_factor": section.loss_scale_factor}


def policy_loss_term(actor) -> LossTerm:
    """actor.policy_loss with its options: the loss's own defaults, the actor's clip_ratio_* for
    the losses that declare them (vanilla, gspo), then actor.policy_loss_options."""
    spec = get_policy_loss(actor.policy_loss)
    options = options_from_section(spec.options, actor, actor.policy_loss_options, **_shared(actor))
    return LossTerm("policy_loss", spec, options)


def _section_term(name: str, section) -> LossTerm:
    spec = LOSS_TERMS[name]
    return LossTerm(name, spec, options_from_section(spec.options, section, **_shared(section)))


def distilling(actor) -> bool:
    """Whether the actor's loss holds the distillation term (actor.distill.coef > 0)."""
    distill = getattr(actor, "distill", None)
    return distill is not None and distill.coef > 0


def distill_term(actor) -> LossTerm:
    """actor.distill's term: its coef and kl_type (or with top_k > 0 the top-k forward KL), the
    actor's loss_agg_mode / loss_scale_factor."""
    if getattr(actor.distill, "top_k", 0) > 0:
        spec = LOSS_TERMS["distill_topk_loss"]
        return LossTerm("distill_topk_loss", spec, spec.options(coef=actor.distill.coef, **_shared(actor)))
    spec = LOSS_TERMS["distill_loss"]
    return LossTerm("distill_loss", spec, spec.options(coef=actor.distill.coef, kl_type=actor.distill.kl_type,
                                                       **_shared(actor)))


def actor_loss_terms(actor) -> list[LossTerm]:
    # actor.distill.use_policy_loss=false: pure distillation, the policy loss is not in the loss
    pure_distillation = distilling(actor) and not actor.distill.use_policy_loss
    terms = [] if pure_distillation else [policy_loss_term(actor)]
    # absent rather than multiplied by 0: no entropy backward and no entropy_loss metric
    if actor.entropy_coeff != 0:
        terms.append(_section_term("entropy_bonus", actor))
    if actor.use_kl_loss:
        terms.append(_section_term("kl_loss", actor))
    if distilling(actor):
        terms.append(distill_term(actor))
    return terms


def critic_loss_terms(critic) -> list[LossTerm]:
    return [_section_term("value_loss", critic)]


def compose_loss(terms: Iterable[LossTerm], batch: Batch, meta, prefix: str = "") -> tuple[torch.Tensor, dict[str, Metric]]:
    """The sum of the terms' contributions, in order, and their metrics named prefix + name."""
    total = None
    metrics: dict[str, Metric] = {}
    for term in terms:
        loss, term_metrics = term(batch, meta)
        total = loss if total is None else total + loss
        for name, metric in term_metrics.items():
            if prefix + name in metrics:
                raise ValueError(f"metric {prefix + name!r} is reported by two loss terms")
            metrics[prefix + name] = metric
    if total is None:
        raise ValueError("a loss needs at least one term")
    return total, metrics
