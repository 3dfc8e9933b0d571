"""Connecting to Ray: an already initialised Ray (Jupyter), RAY_ADDRESS / ray.address, or a new local one."""

from __future__ import annotations

import math
import os

import ray

from rlflow.config import RLFlowConfig


def local_num_cpus(cfg: RLFlowConfig) -> int:
    """Logical CPUs for a local Ray: enough for every worker's share, at least the machine's cores."""
    roles = 2 + int(bool(cfg.critic.enable)) + int(bool(cfg.reference.enable))
    bundles = max(cfg.actor.dp_size, cfg.critic.dp_size or 1, cfg.rollout.dp_size)
    needed = cfg.trainer.cpus_per_worker * roles * (bundles if cfg.trainer.colocate else 1)
    if not cfg.trainer.colocate:
        needed = cfg.trainer.cpus_per_worker * (cfg.actor.dp_size + cfg.rollout.dp_size + (cfg.critic.dp_size or 0) + 1)
    return max(os.cpu_count() or 1, math.ceil(needed))


def ensure_ray(cfg: RLFlowConfig) -> bool:
    """Returns True when this call started Ray (and so the caller may shut it down)."""
    if ray.is_initialized():
        return False
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    # the workers import rlflow/controllers/workers from the same checkout as the driver
    if address:
        ray.init(address=address, log_to_driver=True)
        return True
    ray.init(
        num_cpus=cfg.ray.num_cpus or local_num_cpus(cfg),
        include_dashboard=cfg.ray.include_dashboard,
        dashboard_host=cfg.ray.dashboard_host,
        log_to_driver=True,
    )
    return True
