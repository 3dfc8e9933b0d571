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


# Objects up to this size travel inside the task's RPC instead of through the plasma store. Ray's
# 100 KB default sends a 128-row rollout batch (about 110 KB of int64 columns) through plasma:
# measured on the 2-core CI machine, one call carrying it took 3.7 ms that way and 2.0 ms inline.
# Larger objects (a state dict of several MB) are faster through plasma, so the limit stays at 1 MiB.
INLINE_OBJECT_BYTES = 1 << 20


def local_ray_options(num_cpus: int, include_dashboard: bool = False, dashboard_host: str = "127.0.0.1",
                      log_to_driver: bool = True) -> dict:
    """ray.init arguments for a local Ray instance that rlflow starts (the CLI, the API, the tests)."""
    return dict(
        num_cpus=num_cpus,
        include_dashboard=include_dashboard,
        dashboard_host=dashboard_host,
        log_to_driver=log_to_driver,
        _system_config={"max_direct_call_object_size": INLINE_OBJECT_BYTES},
    )


def ensure_ray(cfg: RLFlowConfig) -> bool:
    """Returns True when this call started Ray (and so the caller may shut it down)."""
    if ray.is_initialized():
        return False
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    # the workers import rlflow/controllers/workers from the same checkout as the driver
    if address:
        ray.init(address=address, log_to_driver=True)
        return True
    ray.init(**local_ray_options(cfg.ray.num_cpus or local_num_cpus(cfg), cfg.ray.include_dashboard,
                                 cfg.ray.dashboard_host))
    return True
