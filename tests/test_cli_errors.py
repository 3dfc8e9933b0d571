"""The CLI ends every error with one line on stderr: a user error `rlflow: error: ...` with exit
status 2 and no traceback; any other `rlflow: error: <Type>: ...` with exit status 1 and its
traceback in a file the line names; `--traceback` / RLFLOW_TRACEBACK=1 prints the traceback instead.

The user-error cases run the real entry point (`python -m rlflow.cli`, what the `rlflow` script
calls) in a subprocess, and every such error must come before Ray starts (quickly, no Ray
session). Those subprocesses start together when the first test asks for one (`cli_runs`): each is
one interpreter on one core. The other errors are raised into `main()` in-process, except one real
worker error after Ray started."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from rlflow.cli import SUMMARY_CHARS, error_line, is_user_error, main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMIT_S = 60  # a user error is reported before any worker or Ray starts


def _rlflow(*args: str, env: dict | None = None, code: str | None = None,
            limit_s: float = LIMIT_S) -> subprocess.CompletedProcess:
    run_env = {k: v for k, v in os.environ.items() if k not in ("RLFLOW_TRACEBACK", "RAY_ADDRESS")}
    run_env.update(env or {})
    cmd = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "rlflow.cli", *args]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=run_env, capture_output=True, text=True, timeout=limit_s)
    proc.elapsed = time.monotonic() - start
    return proc


def _assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "Ray instance" not in proc.stdout + proc.stderr  # reported before Ray starts
    assert proc.elapsed < LIMIT_S
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    assert line.startswith("rlflow: error: ") and line.strip() != "rlflow: error:"
    for needle in needles:
        assert needle in line, line
    return line


def _assert_traceback(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback (most recent call last)" in proc.stderr
    last = proc.stderr.splitlines()[-1]
    assert last.startswith("rlflow: error: ")
    for needle in needles:
        assert needle in last, last
    assert "Ray instance" not in proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def reward_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli_rewards")
    syntax = folder / "broken_reward.py"
    syntax.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None)\n    return 1.0\n")
    other_name = folder / "other_reward.py"
    other_name.write_text("def my_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    return {"missing": folder / "no_such_reward.py", "syntax": syntax, "other_name": other_name}


@pytest.fixture(scope="module")
def files(tmp_path_factory, reward_files):
    """Paths the cases name: missing ones, and a yaml whose syntax error spans lines."""
    folder = tmp_path_factory.mktemp("cli_files")
    bad_yaml = folder / "bad.yaml"
    bad_yaml.write_text("actor:\n  ppo_epochs: [1\n")
    return {"missing_yaml": str(folder / "no_such_recipe.yaml"), "bad_yaml": str(bad_yaml),
            "missing_data": str(folder / "no_such_train.parquet"), "missing_model": str(folder / "no_such_model"),
            **{f"reward_{name}": str(path) for name, path in reward_files.items()}}


def _cases(model_dir: str, f: dict) -> dict[str, tuple[tuple[str, ...], dict | None]]:
    """name -> (the `rlflow` arguments, extra environment)."""
    train = ("train", f"actor.model.path={model_dir}", "trainer.total_steps=1", "trainer.logger=[console]")
    traceback_env = {"RLFLOW_TRACEBACK": "1"}
    return {
        "config_unknown_key": (("config", "actor.ppo_mini_batch_sizee=4"), None),
        "config_missing_yaml": (("config", f["missing_yaml"]), None),
        "config_batch_algebra": (("config", "data.train_batch_size=8", "rollout.n=2", "actor.ppo_mini_batch_size=3"),
                                 None),
        "config_multi_line_yaml": (("config", f["bad_yaml"]), None),
        "config_traceback_flag": (("--traceback", "config", "actor.ppo_mini_batch_sizee=4"), None),
        "config_traceback_env": (("config", "actor.ppo_mini_batch_sizee=4"), traceback_env),
        "usage_no_command": (("no-such-command",), None),
        "usage_convert": (("convert", "no-such-model"), None),
        "train_unknown_key": (("train", "actor.ppo_mini_batch_sizee=4"), None),
        "train_unknown_key_traceback": (("train", "actor.ppo_mini_batch_sizee=4", "--traceback"), None),
        "train_missing_yaml": (("train", f["missing_yaml"]), None),
        "train_batch_algebra": (("train", "data.train_batch_size=8", "rollout.n=2", "actor.ppo_mini_batch_size=3"),
                                None),
        "train_reward_missing": ((*train, f"reward.custom_function.path={f['reward_missing']}"), None),
        "train_reward_syntax": ((*train, f"reward.custom_function.path={f['reward_syntax']}"), None),
        "train_reward_name": ((*train, f"reward.custom_function.path={f['reward_other_name']}",
                               "reward.custom_function.name=score_fn"), None),
        "train_reward_traceback_env": ((*train, f"reward.custom_function.path={f['reward_syntax']}"), traceback_env),
        "train_missing_data": ((*train, f"data.train_files=[{f['missing_data']}]"), None),
        "train_missing_model": (("train", f"actor.model.path={f['missing_model']}"), None),
    }


@pytest.fixture(scope="module")
def cli_runs(tiny_model_dir, files):
    """Every case's subprocess, started together on as many threads as there are cores; a test
    waits for its own (`cli_runs["name"]`)."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        futures = {name: pool.submit(_rlflow, *args, env=env)
                   for name, (args, env) in _cases(tiny_model_dir, files).items()}
        yield {name: future.result for name, future in futures.items()}


# ---------------------------------------------------------------------------------------------
# config errors (`rlflow config` runs the same load_config as `rlflow train`)
# ---------------------------------------------------------------------------------------------


def test_config_unknown_key_names_it_and_suggests_the_close_one(cli_runs):
    line = _assert_one_line_error(cli_runs["config_unknown_key"](), "actor.ppo_mini_batch_sizee")
    assert "did you mean 'actor.ppo_mini_batch_size'" in line


def test_config_missing_yaml_file(cli_runs, files):
    _assert_one_line_error(cli_runs["config_missing_yaml"](), files["missing_yaml"])


def test_config_impossible_batch_algebra(cli_runs):
    _assert_one_line_error(cli_runs["config_batch_algebra"](), "actor.ppo_mini_batch_size=3",
                           "data.train_batch_size * rollout.n")


def test_config_multi_line_yaml_error_is_one_line(cli_runs, files):
    _assert_one_line_error(cli_runs["config_multi_line_yaml"](), files["bad_yaml"])


def test_config_traceback_flag_and_env_var_show_the_traceback(cli_runs):
    _assert_traceback(cli_runs["config_traceback_flag"](), "actor.ppo_mini_batch_sizee")
    _assert_traceback(cli_runs["config_traceback_env"](), "actor.ppo_mini_batch_sizee")


def test_argparse_usage_error_keeps_its_format(cli_runs):
    proc = cli_runs["usage_no_command"]()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("rlflow: error: ")
    proc = cli_runs["usage_convert"]()  # a subcommand's usage error: argparse names it
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("rlflow convert: error: ")


# ---------------------------------------------------------------------------------------------
# `rlflow train`
# ---------------------------------------------------------------------------------------------


def test_train_unknown_key(cli_runs):
    line = _assert_one_line_error(cli_runs["train_unknown_key"](), "actor.ppo_mini_batch_sizee")
    assert "did you mean 'actor.ppo_mini_batch_size'" in line
    _assert_traceback(cli_runs["train_unknown_key_traceback"](), "actor.ppo_mini_batch_sizee")


def test_train_missing_yaml_file(cli_runs, files):
    _assert_one_line_error(cli_runs["train_missing_yaml"](), files["missing_yaml"])


def test_train_impossible_batch_algebra(cli_runs):
    _assert_one_line_error(cli_runs["train_batch_algebra"](), "actor.ppo_mini_batch_size=3")


def test_train_reward_file_missing(cli_runs, files):
    line = _assert_one_line_error(cli_runs["train_reward_missing"](), files["reward_missing"])
    assert "not found" in line


def test_train_reward_file_syntax_error(cli_runs, files):
    line = _assert_one_line_error(cli_runs["train_reward_syntax"](), files["reward_syntax"])
    assert "SyntaxError" in line


def test_train_reward_function_name_missing(cli_runs, files):
    line = _assert_one_line_error(cli_runs["train_reward_name"](), files["reward_other_name"], "score_fn")
    assert "my_score" in line  # the callables the file does define


def test_train_reward_error_traceback_with_env_var(cli_runs, files):
    proc = cli_runs["train_reward_traceback_env"]()
    _assert_traceback(proc, files["reward_syntax"])
    assert "load_custom_reward_fn" in proc.stderr


def test_train_missing_data_file(cli_runs, files):
    _assert_one_line_error(cli_runs["train_missing_data"](), files["missing_data"])


def test_train_missing_model_folder(cli_runs, files):
    _assert_one_line_error(cli_runs["train_missing_model"](), files["missing_model"])


# ---------------------------------------------------------------------------------------------
# not user errors: exit status 1, a one-line summary naming the type, the traceback in a file
# ---------------------------------------------------------------------------------------------


def _traceback_file(line: str) -> str:
    match = re.search(r" \(traceback: (\S+); --traceback prints it\)$", line)
    assert match, line
    return match.group(1)


@pytest.fixture
def failing_train(monkeypatch):
    """`rlflow train` whose run raises what the test sets (as a worker error surfaces from fit)."""
    import rlflow.cli

    raised = {}

    def train(args):
        raise raised["error"]

    monkeypatch.delenv("RLFLOW_TRACEBACK", raising=False)
    monkeypatch.setattr(rlflow.cli, "cmd_train", train)
    return raised


def test_internal_error_is_one_line_naming_its_type_with_the_traceback_in_a_file(failing_train, capsys):
    from controllers.worker_group import WorkerError

    message = ("step 3 (of 40): rollout rank 0: generate did not return within trainer.remote_timeout_s=5 s\n"
               "(then: actor rank 1: update raised RuntimeError: gloo)")
    try:
        raise KeyError("internal")  # chained: the file shows the cause too
    except KeyError as cause:
        try:
            raise WorkerError(message) from cause
        except WorkerError as err:
            failing_train["error"] = err
    assert main(["train", "trainer.total_steps=40"]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("rlflow: error: WorkerError: step 3 (of 40): rollout rank 0: generate did not return "
                               "within trainer.remote_timeout_s=5 s (then: actor rank 1: update raised RuntimeError: gloo)")
    path = _traceback_file(lines[0])
    try:
        assert os.path.basename(path).startswith("rlflow-error-") and os.path.dirname(path) == tempfile.gettempdir()
        with open(path, encoding="utf-8") as f:
            saved = f.read()
        assert "Traceback (most recent call last)" in saved and "KeyError: 'internal'" in saved
        assert "controllers.worker_group.WorkerError: step 3 (of 40)" in saved and "raise WorkerError" in saved
    finally:
        os.remove(path)


@pytest.mark.parametrize("how", ["flag", "env"])
def test_internal_error_traceback_flag_prints_it_before_the_line(failing_train, capsys, monkeypatch, how):
    failing_train["error"] = KeyError("internal")
    monkeypatch.setattr(tempfile, "mkstemp", lambda **kw: pytest.fail("no file with --traceback"))
    if how == "env":
        monkeypatch.setenv("RLFLOW_TRACEBACK", "1")
    assert main(["train", *(["--traceback"] if how == "flag" else [])]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "KeyError: 'internal'" in err
    assert err.splitlines()[-1] == "rlflow: error: KeyError: internal"


def test_internal_error_line_is_cut_and_a_failed_file_prints_the_traceback(failing_train, capsys, monkeypatch):
    failing_train["error"] = RuntimeError("x" * 5000)

    def no_space(**kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tempfile, "mkstemp", no_space)
    assert main(["train"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err  # nowhere else to keep it
    last = err.splitlines()[-1]
    assert last.startswith("rlflow: error: RuntimeError: xxx") and last.endswith("x...")
    assert len(last) == len("rlflow: error: RuntimeError: ") + SUMMARY_CHARS


def test_a_value_error_after_ray_started_is_not_a_user_error(failing_train, capsys, monkeypatch):
    import rlflow.cli

    failing_train["error"] = ValueError("shapes do not match")
    monkeypatch.setattr(rlflow.cli, "_ray_started", lambda: True)
    assert main(["train"]) == 1
    line = capsys.readouterr().err.splitlines()[-1]
    assert line.startswith("rlflow: error: ValueError: shapes do not match (traceback: ")
    os.remove(_traceback_file(line))


def test_keyboard_interrupt_is_not_caught(failing_train, capsys):
    failing_train["error"] = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        main(["train"])
    assert capsys.readouterr().err == ""


def test_a_worker_error_after_ray_started_ends_in_one_line(ray_session, tiny_model_dir, tmp_path, capsys):
    """The real thing, in this process on the session's Ray: the workers load the model, the first
    generate call cannot return within trainer.remote_timeout_s; the driver raises WorkerError."""
    code = main(["train", f"actor.model.path={tiny_model_dir}", "data.train_batch_size=8",
                 "data.synthetic_train_size=64", "data.synthetic_val_size=8", "rollout.n=2",
                 "actor.ppo_mini_batch_size=8", "trainer.total_steps=1", "trainer.val_before_train=false",
                 "trainer.logger=[console]", "reward.num_workers=0", "algorithm.adv_estimator=grpo",
                 "trainer.remote_timeout_s=0.001", f"trainer.default_local_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "Traceback" not in err
    last = err.splitlines()[-1]
    assert last.startswith("rlflow: error: WorkerError: ") and "trainer.remote_timeout_s=0.001" in last, last
    path = _traceback_file(last)
    try:
        with open(path, encoding="utf-8") as f:
            assert "Traceback (most recent call last)" in f.read()
    finally:
        os.remove(path)


def test_rule_by_type_and_by_whether_ray_started():
    from rlflow.config import ConfigError

    assert is_user_error(ConfigError("x"), ray_started=False)
    assert is_user_error(ConfigError("x"), ray_started=True)
    for err in (ValueError("x"), FileNotFoundError("x")):
        assert is_user_error(err, ray_started=False)
        assert not is_user_error(err, ray_started=True)  # may be a bug once the run is under way
    for err in (RuntimeError("x"), KeyError("x"), AttributeError("x"), TypeError("x"), ZeroDivisionError()):
        assert not is_user_error(err, ray_started=False)


def test_reward_loader_errors_count_whatever_their_type(reward_files):
    from rlflow.rewards import load_custom_reward_fn

    with pytest.raises(AttributeError) as info:
        load_custom_reward_fn(reward_files["other_name"], "score_fn")
    assert is_user_error(info.value, ray_started=True)
    assert not is_user_error(AttributeError("score_fn"), ray_started=False)  # not raised by the loader


def test_error_line_is_one_line():
    assert error_line(ValueError("first\n  second\n\nthird")) == "rlflow: error: first second third"
    assert error_line(KeyError("a key")) == "rlflow: error: a key"
    assert error_line(ValueError()) == "rlflow: error: ValueError"
