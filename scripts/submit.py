#!/usr/bin/env python
"""Submit `rlflow train ...` to a Ray cluster as a Ray job (the job server of its dashboard).

    scripts/submit.sh [options] [--] [CONFIG.yaml] [key=value ...]

    RAY_ADDRESS=http://head:8265 scripts/submit.sh configs/gsm8k_qwen2.5_0.5b.yaml trainer.total_steps=100
    scripts/submit.sh --address http://127.0.0.1:8265 --no-wait -- trainer.total_steps=5

The repository is uploaded as the job's working_dir (Ray puts it first on PYTHONPATH, so the
driver and every worker import `rlflow`, `controllers` and `workers` from this copy, whether or
not rlflow is installed on the cluster). Left out of the upload: .git, .venv*, outputs/, runs/,
caches and build outputs. The entrypoint is `python -m rlflow.cli train <your arguments>`.

By default nothing is pip-installed: the cluster's Python must have rlflow's dependencies
(torch, ray, transformers, ...). `--pip` adds them (read from pyproject.toml) to the runtime_env,
so Ray builds a virtualenv for the job on each node — that needs the nodes to reach a package
index. `--pip-package PKG` adds more.

Relative paths in the config (data.train_files, trainer.default_local_dir, ...) resolve inside
the job's working-dir copy on the head node: point them at shared or absolute storage.

Waits for the job and streams its logs unless --no-wait; the exit status is 0 for SUCCEEDED,
1 for FAILED or STOPPED, 124 when --timeout ran out (the job is then stopped).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_ADDRESS = "http://127.0.0.1:8265"

#: gitignore-style patterns left out of the uploaded working_dir
EXCLUDES = [
    ".git",
    ".venv*",
    "outputs",
    "runs",
    "__pycache__",
    "*.pyc",
    "*.egg-info",
    "build",
    "dist",
    ".pytest_cache",
    ".hypothesis",
    ".ipynb_checkpoints",
]


def project_dependencies(pyproject: str | None = None) -> list[str]:
    """The `[project] dependencies` of pyproject.toml (what `--pip` installs on the cluster), less
    ray itself: the cluster runs Ray already, and a second Ray in the job's env would not match it."""
    import re
    import tomllib

    with open(pyproject or os.path.join(REPO, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    return [d for d in deps if re.split(r"[\[<>=!~; ]", d, maxsplit=1)[0].strip().lower() != "ray"]


STOP_WAIT_KEY, STOP_WAIT_S = "RAY_JOB_STOP_WAIT_TIME_S", 900


def build_runtime_env(
    working_dir: str = REPO,
    pip: bool = False,
    pip_packages: list[str] | None = None,
    env_vars: dict[str, str] | None = None,
) -> dict:
    """The runtime_env of the job. No "pip" key unless asked for: a cluster whose Python already
    has the dependencies (a local test cluster in the same venv) then installs nothing."""
    runtime_env: dict = {"working_dir": os.path.abspath(working_dir), "excludes": list(EXCLUDES)}
    packages = (project_dependencies(os.path.join(working_dir, "pyproject.toml")) if pip else []) + list(pip_packages or [])
    if packages:
        runtime_env["pip"] = packages
    # `ray job stop` sends SIGTERM, then SIGKILL after this many seconds (Ray's default: 3); rlflow
    # finishes the step and checkpoints it on SIGTERM (docs/LONG_RUNS.md), which takes longer
    runtime_env["env_vars"] = {STOP_WAIT_KEY: str(STOP_WAIT_S), **(env_vars or {})}
    return runtime_env


def build_entrypoint(train_args: list[str], python: str = "python") -> str:
    # `python -m` (not the `rlflow` console script): the job's cwd is the working_dir copy, so
    # the driver imports the uploaded code even where an older rlflow is installed
    return shlex.join([python, "-m", "rlflow.cli", "train", *train_args])


def _parse_env(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        if "=" not in item:
            raise SystemExit(f"submit: --env {item!r} is not KEY=VALUE")
        key, value = item.split("=", 1)
        env[key] = value
    return env


def _enable_token_auth_if_available() -> None:
    """Ray 2.5x clusters started with `ray start` use token authentication when a token exists
    (~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN); Ray's job client only sends the
    token when RAY_AUTH_MODE=token. Do what `ray start` does: token mode if a token is there."""
    if os.environ.get("RAY_AUTH_MODE"):
        return
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
    if os.environ.get("RAY_AUTH_TOKEN") or os.path.isfile(path):
        os.environ["RAY_AUTH_MODE"] = "token"


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="scripts/submit.sh",
        description="Submit `rlflow train [CONFIG.yaml] [key=value ...]` to a Ray cluster as a Ray job.",
        epilog="Everything after the options (or after --) is passed to `rlflow train`.",
    )
    ap.add_argument("--address", default=None,
                    help=f"the cluster's dashboard / job server URL (default: $RAY_ADDRESS, else {DEFAULT_ADDRESS})")
    ap.add_argument("--working-dir", default=REPO, help="folder uploaded as the job's working_dir (default: this repository)")
    ap.add_argument("--pip", action="store_true",
                    help="pip-install rlflow's dependencies (from pyproject.toml) into the job's environment")
    ap.add_argument("--pip-package", action="append", default=[], metavar="PKG", help="one more pip package (repeatable)")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="an environment variable of the job (repeatable)")
    ap.add_argument("--submission-id", default=None, help="the job's id (default: one Ray picks)")
    ap.add_argument("--entrypoint-num-cpus", type=float, default=None, help="CPUs reserved for the driver process")
    ap.add_argument("--entrypoint-num-gpus", type=float, default=None, help="GPUs reserved for the driver process")
    ap.add_argument("--python", default="python", help="the Python the job runs (default: python on the cluster's PATH)")
    ap.add_argument("--no-wait", action="store_true", help="submit and return the job id; do not follow the logs")
    ap.add_argument("--timeout", type=float, default=None, help="stop the job and exit 124 after this many seconds")
    ap.add_argument("--dry-run", action="store_true", help="print the entrypoint and runtime_env as JSON; submit nothing")
    ns, rest = ap.parse_known_args(argv)
    if rest and rest[0] == "--":
        rest = rest[1:]
    unknown = [a for a in rest if a.startswith("--")]
    if unknown:
        ap.error(f"unknown option(s) {unknown} (rlflow train takes CONFIG.yaml and key=value overrides)")
    ns.train_args = rest
    return ns


def _follow_logs(client, job_id: str, deadline: float | None) -> bool:
    """Stream the job's logs until it ends; False if the deadline passed first."""
    import asyncio

    async def tail():
        async for lines in client.tail_job_logs(job_id):
            print(lines, end="", flush=True)

    timeout = None if deadline is None else max(1.0, deadline - time.monotonic())
    try:
        asyncio.run(asyncio.wait_for(tail(), timeout))
    except asyncio.TimeoutError:
        return False
    except Exception as err:  # noqa: BLE001 - the log stream is a convenience; fall back to polling
        print(f"submit: log stream ended ({type(err).__name__}: {err}); polling the job status", file=sys.stderr)
    return True


def wait_for_job(client, job_id: str, deadline: float | None, poll_s: float = 1.0):
    from ray.job_submission import JobStatus

    terminal = {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}
    while True:
        status = client.get_job_status(job_id)
        if status in terminal:
            return status
        if deadline is not None and time.monotonic() > deadline:
            return None
        time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(list(sys.argv[1:] if argv is None else argv))
    address = ns.address or os.environ.get("RAY_ADDRESS") or DEFAULT_ADDRESS
    runtime_env = build_runtime_env(ns.working_dir, ns.pip, ns.pip_package, _parse_env(ns.env))
    entrypoint = build_entrypoint(ns.train_args, ns.python)
    if ns.dry_run:
        print(json.dumps({"address": address, "entrypoint": entrypoint, "runtime_env": runtime_env}, indent=2))
        return 0

    _enable_token_auth_if_available()  # before ray is imported: it reads the mode once
    from ray.job_submission import JobStatus, JobSubmissionClient

    deadline = None if ns.timeout is None else time.monotonic() + ns.timeout
    client = JobSubmissionClient(address)
    job_id = client.submit_job(
        entrypoint=entrypoint, runtime_env=runtime_env, submission_id=ns.submission_id,
        entrypoint_num_cpus=ns.entrypoint_num_cpus, entrypoint_num_gpus=ns.entrypoint_num_gpus,
    )
    print(f"submit: job {job_id} submitted to {address}: {entrypoint}", flush=True)
    if ns.no_wait:
        print(f"submit: follow it with: ray job logs --address {address} --follow {job_id}")
        return 0
    finished = _follow_logs(client, job_id, deadline)
    status = wait_for_job(client, job_id, deadline) if finished else None
    if status is None:
        print(f"submit: job {job_id} still running after --timeout {ns.timeout:g} s; stopping it", file=sys.stderr)
        client.stop_job(job_id)
        return 124
    print(f"submit: job {job_id} {status.value}", flush=True)
    return 0 if status == JobStatus.SUCCEEDED else 1


if __name__ == "__main__":
    sys.exit(main())
