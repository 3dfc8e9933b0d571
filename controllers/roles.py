"""The roles of a run, as data.

A role is a group of Ray workers the driver starts, feeds and stops. Its declaration says
everything the driver needs: the worker class, whether the config turns it on, its data-parallel
size, how its model is initialised, what it adds to the step's batch in the forward phase (and
when), and whether it trains (an update every step, a checkpoint, weights gathered at the end).
Setup, the forward phase, updates, weight gathering, thread and cluster sizing, checkpoints and
shutdown iterate these declarations; adding a role is one more `Role` passed to
`PPOTrainer(cfg, roles=[...])`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, replace
from typing import Callable

from rlflow.config import RLFlowConfig

# what every model forward reads: the rollout's token layout
MODEL_INPUT_KEYS = ("prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids")


@dataclass(frozen=True)
class RunContext:
    """What setup resolved on the driver, for the roles' init calls."""

    cfg: RLFlowConfig
    model_path: str  # the policy's HF folder
    critic_path: str  # the value model's HF folder
    pad_token_id: int
    eos_token_id: int


@dataclass(frozen=True)
class Forward:
    """A no-grad pass the role runs over the step's batch before advantages are computed.

    `method` is called with the rows of MODEL_INPUT_KEYS split over the role's ranks and returns a
    TensorDict holding `produces` ([B, R] per response token) for its rows, and any other key it
    computes with it (the teacher's top-k ids and log-probs), each added to the batch.
    """

    method: str
    produces: str
    # (cfg, the update is on-policy) -> whether to run it this step
    when: Callable[[RLFlowConfig, bool], bool] = lambda cfg, on_policy: True


@dataclass(frozen=True)
class Role:
    name: str
    worker: str | type  # its worker class, or "module:Class" imported when the run starts
    enabled: Callable[[RLFlowConfig], bool]
    dp_size: Callable[[RLFlowConfig], int]
    # (method, args) that loads the role's model on every rank
    init: Callable[[RunContext], tuple[str, tuple]]
    forward: Forward | None = None
    # trained roles: update(shards) every step on the batch keys `update_keys(cfg, on_policy)`,
    # cut into mini-batches by the config section named like the role; checkpointed; gathered
    trains: bool = False
    update_keys: Callable[[RLFlowConfig, bool], tuple[str, ...]] | None = None
    section: str | None = None  # the config section of a trained role's batch sizes (default: its name)
    # batch keys the update also reads when the step's batch carries them (a replayed recording
    # or an engine without log-probs may not): sent when present, never required
    optional_update_keys: tuple[str, ...] = ()
    # ranks each data-parallel rank's sequences are split over (workers/sequence.py); the role
    # runs dp_size x sp_size processes, and the sp ranks of a dp rank receive the same rows
    sp_size: Callable[[RLFlowConfig], int] = lambda cfg: 1

    def num_processes(self, cfg: RLFlowConfig) -> int:
        return self.dp_size(cfg) * self.sp_size(cfg)

    def worker_class(self) -> type:
        if isinstance(self.worker, type):
            return self.worker
        module, _, name = self.worker.partition(":")
        return getattr(importlib.import_module(module), name)


def _actor_update_keys(cfg: RLFlowConfig, on_policy: bool) -> tuple[str, ...]:
    return (MODEL_INPUT_KEYS + ("advantages",) + (() if on_policy else ("old_log_probs",))
            + (("ref_log_prob",) if cfg.actor.use_kl_loss else ())
            + _distill_keys(cfg.actor.distill))


def _distill_keys(distill) -> tuple[str, ...]:
    """What the actor's distillation term reads of the teacher's forward (actor.distill)."""
    if distill.coef == 0:
        return ()
    return ("teacher_topk_ids", "teacher_topk_log_probs") if distill.top_k > 0 else ("teacher_log_prob",)


def _rollout_enabled(cfg: RLFlowConfig) -> bool:
    """Replaying recorded rollouts without validation generates nothing: no rollout group."""
    trainer = cfg.trainer
    return not trainer.replay_rollouts or trainer.val_before_train or trainer.test_freq > 0


ACTOR = Role(
    name="actor",
    worker="workers.actor:ActorWorker",
    enabled=lambda cfg: True,
    dp_size=lambda cfg: cfg.actor.dp_size,
    sp_size=lambda cfg: cfg.actor.sp_size,
    init=lambda ctx: ("init_model", (ctx.model_path, ctx.cfg.trainer.total_steps)),
    # the old log-probs; on-policy the update's own (detached) log-probs stand in for them
    forward=Forward("compute_log_prob", "old_log_probs", when=lambda cfg, on_policy: not on_policy),
    trains=True,
    update_keys=_actor_update_keys,
    # the rollout engine's log-probs: the mismatch metrics and the rollout correction
    optional_update_keys=("rollout_log_probs",),
)

CRITIC = Role(
    name="critic",
    worker="workers.critic:CriticWorker",
    enabled=lambda cfg: bool(cfg.critic.enable),
    dp_size=lambda cfg: cfg.critic.dp_size,
    sp_size=lambda cfg: cfg.critic.sp_size,
    init=lambda ctx: ("init_model", (ctx.critic_path, ctx.cfg.trainer.total_steps)),
    forward=Forward("compute_values", "values"),
    trains=True,
    update_keys=lambda cfg, on_policy: MODEL_INPUT_KEYS + ("values", "returns"),
)

REFERENCE = Role(
    name="reference",
    worker="workers.actor:ReferenceWorker",
    enabled=lambda cfg: bool(cfg.reference.enable),
    dp_size=lambda cfg: cfg.reference.dp_size,
    sp_size=lambda cfg: cfg.reference.sp_size,
    init=lambda ctx: ("init_model", (ctx.model_path,)),
    forward=Forward("compute_ref_log_prob", "ref_log_prob"),
)

def teacher_model_path(cfg: RLFlowConfig) -> str:
    """teacher.model.path resolved on the driver as actor.model.path is ("tiny", an alias, a folder)."""
    from rlflow.models import resolve_model_name

    return resolve_model_name(cfg.teacher.model.path, cfg.data.synthetic_task)


# on-policy distillation's teacher (actor.distill): the reference's forward on another model folder
TEACHER = Role(
    name="teacher",
    worker="workers.teacher:TeacherWorker",
    enabled=lambda cfg: bool(cfg.teacher.enable),
    dp_size=lambda cfg: cfg.teacher.dp_size,
    sp_size=lambda cfg: cfg.teacher.sp_size,
    init=lambda ctx: ("init_model", (teacher_model_path(ctx.cfg),)),
    forward=Forward("compute_teacher_log_prob", "teacher_log_prob"),
)

ROLLOUT = Role(
    name="rollout",
    worker="workers.rollout.worker:RolloutWorker",
    enabled=_rollout_enabled,
    dp_size=lambda cfg: cfg.rollout.dp_size,
    init=lambda ctx: ("init_engine", (ctx.model_path, ctx.pad_token_id, ctx.eos_token_id)),
)

REWARD_MODEL = Role(
    name="reward_model",
    worker="workers.reward_model:RewardModelWorker",
    enabled=lambda cfg: bool(cfg.reward_model.enable),
    dp_size=lambda cfg: cfg.reward_model.dp_size,
    # no forward phase: the Scorer calls it when a rollout is scored (rlflow/rewards/model.py)
    init=lambda ctx: ("init_model", (ctx.cfg.reward_model.path,)),
)

DEFAULT_ROLES = (ACTOR, ROLLOUT, CRITIC, REFERENCE, TEACHER, REWARD_MODEL)


def resolve_roles(extra: list[Role] | tuple[Role, ...] | None = None,
                  worker_classes: dict[str, type] | None = None) -> dict[str, Role]:
    """The default roles, then `extra` (a new name adds a role, an existing one replaces it), then
    a subclass per role where `worker_classes` gives one (custom or test workers). Checked before
    Ray starts."""
    roles = {role.name: role for role in DEFAULT_ROLES}
    for role in extra or ():
        if not isinstance(role, Role):
            raise TypeError(f"roles: expected controllers.roles.Role declarations, got {role!r}")
        if role.trains and role.update_keys is None:
            raise ValueError(f"role {role.name!r} trains but declares no update_keys")
        roles[role.name] = role
    for name, cls in (worker_classes or {}).items():
        if name not in roles:
            raise ValueError(f"worker_classes: unknown role {name!r}; roles: {', '.join(roles)}")
        base = roles[name].worker_class()
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise TypeError(f"worker_classes[{name!r}] must be a subclass of {base.__name__}, got {cls!r}")
        roles[name] = replace(roles[name], worker=cls)
    return roles


def default_worker_classes() -> dict[str, type]:
    """The worker class of each default role."""
    return {name: role.worker_class() for name, role in resolve_roles().items()}


def enabled_roles(roles: dict[str, Role], cfg: RLFlowConfig) -> dict[str, Role]:
    return {name: role for name, role in roles.items() if role.enabled(cfg)}


def num_worker_processes(roles: dict[str, Role], cfg: RLFlowConfig) -> int:
    return sum(role.num_processes(cfg) for role in enabled_roles(roles, cfg).values())
