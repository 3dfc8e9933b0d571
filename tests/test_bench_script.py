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
    from controllers.roles import default_worker_classes

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


def test_rlflow_run_times_each_phase_inside_the_worker_processes(bench, ray_session, tiny_model_dir):
    """The rlflow column of the table: a real run (Ray worker processes hosting the timed worker
    classes), each phase's seconds read back from the process that ran it, each rank's pid known
    (the peak memory column)."""
    import os

    from conftest import tiny_overrides

    run = bench.RLFlowRun(tiny_overrides(tiny_model_dir, **{"algorithm.adv_estimator": "grpo"}))
    try:
        run.step(0)
        timings = run.step(1)  # the second step: its phases only, not the first step's too
        pids = dict(run.pids)
    finally:
        run.shutdown()
    assert set(pids) == {"actor.0", "rollout.0"} and os.getpid() not in pids.values()
    assert all(pid > 0 for pid in pids.values())
    assert timings["gen"] > 0 and timings["update_actor"] > 0 and timings["step"] >= timings["update_actor"]
    assert timings["update_tokens"] > 0 and timings["response_tokens"] > 0


def test_rollout_engine_table_runs_bench_rollout_and_reports_its_rows(bench, tmp_path):
    """The rollout-engine table: bench_rollout.py in another python (here this venv's, which has no
    vllm: the HF row alone), its JSON read back, one table row per engine and dtype."""
    from types import SimpleNamespace

    from rlflow.tiny import build_tiny_model

    model_dir = build_tiny_model(str(tmp_path / "tiny"))
    args = SimpleNamespace(rollout_python=sys.executable, rollout_dtypes="float32", rollout_batch=4,
                           rollout_response_len=4, prompt_len=8)
    engines = bench.rollout_engines(model_dir, args)
    assert "note" not in engines, engines
    (run,) = engines["runs"]
    assert run["dtype"] == "float32" and run["batch"] == 4 and run["vllm_compile"]
    engine_names = [row["engine"] for row in run["rows"]]
    assert engine_names[0] == "hf engine"
    assert run["rows"][0]["tokens"] > 0 and run["rows"][0]["tok_s"] > 0
    table = "\n".join(bench.rollout_report(engines))
    assert "| hf engine | float32 |" in table

    missing = bench.rollout_engines(model_dir, SimpleNamespace(**{**vars(args), "rollout_python": str(tmp_path / "nope")}))
    assert "no vllm venv at" in missing["note"] and "no vllm venv at" in "\n".join(bench.rollout_report(missing))


def test_rollout_report_gives_the_ratio_per_dtype_and_at_each_engines_fastest(bench):
    def run(dtype, hf, vllm):
        return {"dtype": dtype, "batch": 128, "response_length": 64, "load_avg": [1.0, 1.0, 1.0],
                "rows": [{"engine": "hf engine", "start_s": 0.3, "seconds": 1.0, "tokens": hf, "tok_s": hf, "sync_s": 0.1},
                         {"engine": "vllm", "start_s": 50.0, "seconds": 1.0, "tokens": vllm, "tok_s": vllm, "sync_s": 0.5}]}

    table = "\n".join(bench.rollout_report({"runs": [run("float32", 200, 400), run("bfloat16", 300, 1200)]}))
    assert "- float32: vLLM 2.00x the HF engine's tokens/s" in table
    assert "- bfloat16: vLLM 4.00x the HF engine's tokens/s" in table
    assert "- each at its fastest dtype: vLLM (bfloat16) 4.00x the HF engine (bfloat16)" in table


def test_limit_report_gives_the_updates_flops_against_the_matmul(bench):
    """6 x parameters x tokens / seconds: 6 x 1e6 x 500 / 0.5 s = 6 GFLOP/s, 50% of a 12 GFLOP/s matmul."""
    records = [{"update_actor": 0.5, "update_tokens": 500.0, "step": 1.0}] * 3
    results = {"num_parameters": 1_000_000, "matmul_gflops": {"float32": 12.0, "bfloat16": 24.0}, "matmul_threads": 2,
               "rows": [{"algo": "grpo", "scale": 1, "records": {"bare": records, "rlflow": records}}]}
    lines = bench.limit_report(results)
    assert "float32 12.0 GFLOP/s, bfloat16 24.0 GFLOP/s" in lines[1]
    assert lines[-2:] == ["| grpo x1 bare | 0.500 | 500 | 6.0 | 50% | 25% |",
                          "| grpo x1 rlflow | 0.500 | 500 | 6.0 | 50% | 25% |"]
    assert bench.limit_report({**results, "matmul_gflops": {}}) == []
