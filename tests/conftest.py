"""Shared fixtures: one Ray instance per test session, one tiny model folder per session."""

from __future__ import annotations

import os

import pytest

# keep the worker processes from fighting over the 2 cores of the CI machine
os.environ.setdefault("RLFLOW_WORKER_THREADS", "1")


@pytest.fixture(scope="session")
def ray_session():
    import ray

    from controllers.cluster import local_ray_options

    if not ray.is_initialized():
        # as rlflow starts a local Ray; 16 logical CPUs: room for the worker sets that completed fits
        # park for later fits of the same layout (controllers/worker_group.py, IdleWorkers)
        ray.init(**local_ray_options(num_cpus=16, log_to_driver=False))
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A randomly initialised tiny Qwen2 + tokenizer (no SFT): fast, and enough for plumbing."""
    from rlflow.tiny import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("tiny_model")))


def tiny_overrides(model_dir: str, **extra) -> list[str]:
    """Small, fast settings for end-to-end tests."""
    base = {
        "actor.model.path": model_dir,
        "data.train_batch_size": 8,
        "data.synthetic_train_size": 64,
        "data.synthetic_val_size": 8,
        "data.val_batch_size": 8,
        "data.max_response_length": 6,
        "rollout.n": 2,
        "actor.ppo_mini_batch_size": 8,
        "actor.ppo_micro_batch_size_per_gpu": 4,
        "trainer.total_steps": 2,
        "trainer.test_freq": 0,
        "trainer.val_before_train": False,
        "trainer.logger": "[jsonl]",
        "trainer.remote_timeout_s": 120,
        # rewards scored in the driver: the reward pool's processes (2 per fit) are what
        # tests/test_reward_pool.py and the tests that set reward.num_workers test
        "reward.num_workers": 0,
        # a completed fit's worker processes wait for any later test that has their roles, not only
        # the next minute's (a new process costs seconds of imports; IdleWorkers keeps at most
        # MAX_PARKED_PROCESSES, least recently parked stopped first)
        "trainer.keep_workers_s": 900,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


@pytest.fixture(scope="module")
def restore_process_state():
    """For tests that build workers in this process: WorkerBase.__init__ sets torch's thread count,
    seeds every RNG, quiets transformers and registers Ray's tensor serializer (workers/wire.py) for
    the whole process; put all of it back for the tests that run after the module."""
    import random

    import numpy as np
    import torch
    from ray import cloudpickle
    from transformers.utils import logging as hf_logging

    threads = torch.get_num_threads()
    torch_rng, py_rng, np_rng = torch.get_rng_state(), random.getstate(), np.random.get_state()
    verbosity, progress = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    tensor_reducer = cloudpickle.CloudPickler.dispatch.get(torch.Tensor)
    yield
    if tensor_reducer is None:
        cloudpickle.CloudPickler.dispatch.pop(torch.Tensor, None)
    else:
        cloudpickle.CloudPickler.dispatch[torch.Tensor] = tensor_reducer
    torch.set_num_threads(threads)
    torch.set_rng_state(torch_rng)
    random.setstate(py_rng)
    np.random.set_state(np_rng)
    hf_logging.set_verbosity(verbosity)
    if progress:
        hf_logging.enable_progress_bar()
