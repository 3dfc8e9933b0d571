"""trainer.imports: a user's module registers a policy loss, an advantage estimator and a rollout
engine (tests/user_plugins.py); validation reads the registries, and the pieces run in the Ray
workers of a real `rlflow train` (a subprocess, so this session's registries stay as shipped)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import tiny_overrides

from rlflow.config import ConfigError, load_config
from rlflow.plugins import ENGINE_MODULES, import_modules

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLUGINS = "tests/user_plugins.py"  # relative to the repository: the driver makes it absolute
ESTIMATOR, LOSS, ENGINE = "test_constant", "test_marked", "test_one_token"


def _rlflow(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RLFLOW_TRACEBACK", "RAY_ADDRESS")}
    return subprocess.run([sys.executable, "-m", "rlflow.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlflow: error: "), proc.stderr
    return lines[0]


def test_cli_trains_with_the_registered_loss_estimator_and_engine(ray_session, tiny_model_dir, tmp_path):
    address = ray_session.get_runtime_context().gcs_address  # a new driver job: fresh worker processes
    overrides = tiny_overrides(tiny_model_dir, **{
        "trainer.imports": f"[{PLUGINS}]", "algorithm.adv_estimator": ESTIMATOR, "actor.policy_loss": LOSS,
        "rollout.name": ENGINE, "trainer.total_steps": 1, "trainer.default_local_dir": str(tmp_path),
        "ray.address": address})
    proc = _rlflow("train", *overrides, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    with open(tmp_path / "rlflow" / "default" / "metrics.jsonl", encoding="utf-8") as f:
        step = [json.loads(line) for line in f][-1]
    assert step["actor/plugin_advantage"] == pytest.approx(0.25)  # the loss ran, fed by the estimator
    assert step["response/length_mean"] == 1.0  # the engine generated
    assert "critic/vf_loss" not in step


def test_validation_reads_the_registries_a_module_fills():
    # the estimator's declared trait (needs_groups), checked before anything starts
    line = _error_line(_rlflow("config", f"trainer.imports=[{PLUGINS}]", f"algorithm.adv_estimator={ESTIMATOR}",
                               "rollout.n=1", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8"))
    assert "rollout.n" in line and ESTIMATOR in line
    proc = _rlflow("config", f"trainer.imports=[{PLUGINS}]", f"rollout.name={ENGINE}", f"actor.policy_loss={LOSS}")
    assert proc.returncode == 0, proc.stderr
    assert os.path.join(REPO, PLUGINS) in proc.stdout  # made absolute for the workers
    line = _error_line(_rlflow("config", f"rollout.name={ENGINE}"))  # without the module: unknown
    assert "rollout.name" in line and "trainer.imports" in line


def test_an_engine_name_reaches_validation(monkeypatch):
    with pytest.raises(ConfigError, match="rollout.name='mine'"):
        load_config(None, ["rollout.name=mine"])
    monkeypatch.setitem(ENGINE_MODULES, "mine", "my_package.engines")  # what @register_engine adds
    assert load_config(None, ["rollout.name=mine"]).rollout.name == "mine"


def test_import_errors_name_the_key(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"trainer.imports: no file .*missing\.py"):
        load_config(None, [f"trainer.imports=[{tmp_path / 'missing.py'}]"])
    with pytest.raises(ConfigError, match="trainer.imports: cannot import 'no_such_module_here'"):
        load_config(None, ["trainer.imports=[no_such_module_here]"])
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ConfigError, match="trainer.imports: .*broken.py failed to import: RuntimeError: boom"):
        load_config(None, [f"trainer.imports=[{broken}]"])
    # a dotted name is found in the current directory, as Ray's workers find it
    (tmp_path / "counted_plugin.py").write_text("import builtins\nbuiltins.counted_plugin_runs = "
                                               "getattr(builtins, 'counted_plugin_runs', 0) + 1\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # import_modules may append the directory
    monkeypatch.delitem(sys.modules, "counted_plugin", raising=False)
    import builtins

    try:
        load_config(None, ["trainer.imports=[counted_plugin]"])
        import_modules(["counted_plugin"])
        assert builtins.counted_plugin_runs == 1  # once per process
    finally:
        sys.modules.pop("counted_plugin", None)
        vars(builtins).pop("counted_plugin_runs", None)


def test_a_file_is_imported_once_per_process_and_left_out_of_sys_modules(tmp_path):
    plugin = tmp_path / "once.py"
    plugin.write_text("RUNS = []\nRUNS.append(1)\n")
    first, = import_modules([str(plugin)])
    assert import_modules([str(plugin)]) == [first] and first.RUNS == [1]
    assert first.__name__ not in sys.modules  # cloudpickle ships what it defines by value


def test_one_loader_serves_imports_reward_files_and_environments(tmp_path):
    """rlflow.plugins.load_file: trainer.imports and rollout.agent.env run a file once per process,
    a reward file runs afresh on every load; none stays in sys.modules (cloudpickle: by value)."""
    from rlflow.agents import load_env_class
    from rlflow.rewards import load_custom_reward_fn

    env_file = tmp_path / "envs.py"
    env_file.write_text("from rlflow.agents import Environment\nclass Env(Environment):\n    pass\n")
    first = load_env_class(f"{env_file}:Env")
    assert load_env_class(f"{env_file}:Env") is first and first.__module__ not in sys.modules
    reward_file = tmp_path / "reward.py"
    reward_file.write_text("def compute_score(*args, **kwargs):\n    return 1.0\n")
    fn = load_custom_reward_fn(reward_file)
    assert fn.__module__.startswith("rlflow_custom_reward_") and fn.__module__ not in sys.modules
    reward_file.write_text("def compute_score(*args, **kwargs):\n    return 2.0\n")
    assert load_custom_reward_fn(reward_file)("d", "s", "t") == 2.0  # edited: loaded again
    not_python = tmp_path / "reward.txt"
    not_python.write_text("x = 1\n")
    with pytest.raises(ImportError, match=r"cannot import .*reward\.txt as a python module \(is it a \.py file\?\)"):
        load_custom_reward_fn(not_python)
