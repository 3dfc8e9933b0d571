"""Connecting to Ray: an already initialised Ray (Jupyter), RAY_ADDRESS / ray.address, or a new local one."""

from __future__ import annotations

import math
import os

import ray

from controllers.roles import enabled_roles, resolve_roles
from rlflow.config import RLFlowConfig


def local_num_cpus(cfg: RLFlowConfig, dp_sizes: list[int]) -> int:
    """Logical CPUs for a local Ray: every worker's share (`dp_sizes`: the ranks of each role the
    run starts), at least the machine's cores."""
    per_worker = cfg.trainer.cpus_per_worker
    if cfg.trainer.colocate:  # one pool: as many bundles as the largest role, each fits one rank of every role
        needed = per_worker * len(dp_sizes) * max(dp_sizes, default=1)
    else:
        needed = per_worker * (sum(dp_sizes) + 1)
    return max(os.cpu_count() or 1, math.ceil(needed))


# Objects up to this size travel inside the task's RPC instead of through the plasma store. Ray's
# 100 KB default sends a 128-row rollout batch (about 110 KB of int64 columns) through plasma,
# which is slower for it than inline (docs/BENCHMARKS.md); larger objects (a state dict of several
# MB) are faster through plasma, so the limit stays at 1 MiB.
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


def ensure_ray(cfg: RLFlowConfig, dp_sizes: list[int] | None = None) -> bool:
    """Returns True when this call started Ray. `dp_sizes`: the ranks of each role the run starts
    (default: the default roles' for this config)."""
    if ray.is_initialized():
        return False
    if dp_sizes is None:
        dp_sizes = [role.num_processes(cfg) for role in enabled_roles(resolve_roles(), cfg).values()]
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    # the workers import rlflow/controllers/workers from the same checkout as the driver
    if address:
        ray.init(address=address, log_to_driver=True)
        return True
    ray.init(**local_ray_options(cfg.ray.num_cpus or local_num_cpus(cfg, dp_sizes), cfg.ray.include_dashboard,
                                 cfg.ray.dashboard_host))
    return True
