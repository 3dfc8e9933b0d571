"""scripts/bench.py keeps working as roles are added: every role's worker class gets its timed
subclass (the per-phase table), and a role the script does not know stops it naming the role."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("rlflow_bench_script", BENCH)
    module = importlib.util.module_from_spec(spec)
    argv = sys.argv
    try:
        sys.argv = [str(BENCH)]
        spec.loader.exec_module(module)
    finally:
        sys.argv = argv
    return module


def test_every_role_has_a_timed_worker(bench):
    from controllers.ppo import default_worker_classes

    timed = bench.timed_workers()
    assert set(timed) == set(default_worker_classes())
    for role, cls in timed.items():
        for method in bench._TIMED_METHODS[role]:
            assert hasattr(default_worker_classes()[role], method), f"{role} has no {method}: the bench would time nothing"
            assert getattr(cls, method).__name__ == method


def test_an_unknown_role_names_itself(bench, monkeypatch):
    monkeypatch.delitem(bench._TIMED_METHODS, "critic")
    with pytest.raises(KeyError, match=r"no entry for the role\(s\) \['critic'\]"):
        bench.timed_workers()
