"""scripts/submit.sh: `rlflow train` as a Ray job on a real (local, loopback) Ray cluster.

The cluster is started here with `ray start --head --block` in its own session, its own
--temp-dir and its own ports, and is stopped by signalling exactly its processes: never
`ray stop`, which kills every Ray process of the machine (the suite's own Ray included). Nothing
of the cluster touches this process's environment: RAY_ADDRESS, the auth token and everything
that talks to the job server live in subprocesses.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from conftest import tiny_overrides

REPO = Path(__file__).resolve().parents[1]
SUBMIT_SH = REPO / "scripts" / "submit.sh"
BIN = Path(sys.executable).parent


def _load_submit():
    spec = importlib.util.spec_from_file_location("rlflow_submit_script", REPO / "scripts" / "submit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------
# without a cluster
# ---------------------------------------------------------------------------------------------


def test_runtime_env_uploads_the_repo_without_venvs_and_installs_nothing_by_default():
    submit = _load_submit()
    env = submit.build_runtime_env(str(REPO))
    assert env["working_dir"] == str(REPO)
    for pattern in (".git", ".venv*", "outputs"):
        assert pattern in env["excludes"]
    assert "pip" not in env  # a cluster in the same venv must not reach for a package index
    with_pip = submit.build_runtime_env(str(REPO), pip=True, pip_packages=["extra-pkg==1.0"], env_vars={"A": "1"})
    assert any(p.startswith("torch") for p in with_pip["pip"]) and with_pip["pip"][-1] == "extra-pkg==1.0"
    assert not any(p.split("[")[0].split(">")[0].strip() == "ray" for p in with_pip["pip"])  # the cluster's own Ray stays
    assert with_pip["env_vars"] == {"RAY_JOB_STOP_WAIT_TIME_S": "900", "A": "1"}  # time to checkpoint on a stop
    assert env["env_vars"] == {"RAY_JOB_STOP_WAIT_TIME_S": "900"}
    assert submit.build_runtime_env(str(REPO), env_vars={"RAY_JOB_STOP_WAIT_TIME_S": "60"})["env_vars"] == {
        "RAY_JOB_STOP_WAIT_TIME_S": "60"}
    assert submit.build_entrypoint(["configs/x.yaml", "a.b=c d"]) == "python -m rlflow.cli train configs/x.yaml 'a.b=c d'"


def test_dry_run_prints_entrypoint_and_runtime_env():
    out = subprocess.run(["bash", str(SUBMIT_SH), "--dry-run", "--address", "http://127.0.0.1:1", "--",
                          "trainer.total_steps=3"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHON": sys.executable})
    assert out.returncode == 0, out.stderr
    spec = json.loads(out.stdout)
    assert spec["entrypoint"] == "python -m rlflow.cli train trainer.total_steps=3"
    assert spec["runtime_env"]["working_dir"] == str(REPO) and "pip" not in spec["runtime_env"]


# ---------------------------------------------------------------------------------------------
# a local cluster, started and stopped by this test only
# ---------------------------------------------------------------------------------------------


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _marked_pids(marker: str) -> list[int]:
    """Processes of this user whose environment carries the cluster's marker variable."""
    needle = f"RLFLOW_TEST_JOB_CLUSTER={marker}".encode()
    mine = {os.getpid(), os.getppid()}
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in mine:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    pids.append(int(entry))
        except OSError:  # gone, or not ours
            continue
    return pids


def _process_cpu_seconds(pid: int) -> float | None:
    """utime + stime of one process and of its reaped children, in seconds."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


class CpuSampler:
    """CPU seconds used by every process carrying RLFLOW_TEST_JOB_CLUSTER=<marker>, sampled twice a
    second (Ray's workers are not reaped into anyone's rusage, so this is how to count them; a
    process's last half second can be missed)."""

    def __init__(self, marker: str, interval_s: float = 0.5):
        import threading

        self.marker, self.interval_s = marker, interval_s
        self.seen: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def sample(self) -> None:
        for pid in _marked_pids(self.marker):
            cpu = _process_cpu_seconds(pid)
            if cpu is not None:
                self.seen[pid] = max(cpu, self.seen.get(pid, 0.0))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=5)
        return False

    @property
    def total_s(self) -> float:
        return sum(self.seen.values())


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


class LocalCluster:
    """`ray start --head` on loopback with its own temp dir, ports and auth token."""

    def __init__(self, num_cpus: int = 4):
        # short: Ray's unix sockets live under it (108-byte limit); not named "ray" (shadowing)
        self.temp_dir = tempfile.mkdtemp(prefix="rlfjob-", dir="/tmp")
        self.marker = os.path.basename(self.temp_dir)
        (self.gcs_port, self.dashboard_port, client_port, agent_http, agent_grpc, metrics, runtime_env_port,
         node_manager, object_manager) = _free_ports(9)
        self.address = f"http://127.0.0.1:{self.dashboard_port}"
        self.token = secrets.token_hex(32)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RLFLOW_TEST_JOB"))}
        env.update({
            "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",  # `python` in the job = this venv's
            "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token,  # this cluster's own token
            "RAY_USAGE_STATS_ENABLED": "0",
            "RLFLOW_WORKER_THREADS": "1", "OMP_NUM_THREADS": "1",
            "RLFLOW_TEST_JOB_CLUSTER": self.marker,  # finds every process of this cluster at teardown
        })
        self.env = env
        self.log_path = os.path.join(self.temp_dir, "ray-start.log")
        cmd = [
            str(BIN / "ray"), "start", "--head", "--block", "--disable-usage-stats",
            f"--num-cpus={num_cpus}", "--num-gpus=0", f"--temp-dir={self.temp_dir}",
            "--node-ip-address=127.0.0.1", f"--port={self.gcs_port}",
            "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}",
            f"--ray-client-server-port={client_port}", f"--dashboard-agent-listen-port={agent_http}",
            f"--dashboard-agent-grpc-port={agent_grpc}", f"--metrics-export-port={metrics}",
            f"--runtime-env-agent-port={runtime_env_port}", f"--node-manager-port={node_manager}",
            f"--object-manager-port={object_manager}",
        ]
        self._log = open(self.log_path, "w")
        # its own session: a signal meant for it never reaches pytest, and the reverse
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.temp_dir)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return Path(self.log_path).read_text()[-n:]
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        request = urllib.request.Request(f"{self.address}/api/version", headers={"Authorization": f"Bearer {self.token}"})
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(request, timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"the test cluster's job server was not up within {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM to `ray start --block` (it then stops raylet, GCS, dashboard, ...), then any of
        this cluster's processes still alive — found by the marker in their environment, so the
        suite's own Ray and other users' processes are never touched."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=10)
            deadline = time.monotonic() + 15
            left = _marked_pids(self.marker)
            _signal_all(left, signal.SIGTERM)
            while left and time.monotonic() < deadline:
                time.sleep(0.5)
                left = _marked_pids(self.marker)
            _signal_all(left, signal.SIGKILL)
        finally:
            self._log.close()
            shutil.rmtree(self.temp_dir, ignore_errors=True)


# Runs in a subprocess with the cluster's token: reads the training job's status and logs, then
# submits a second job with the same runtime_env that reports where the driver and a Ray worker
# imported rlflow, controllers and workers from.
_PROBE = r"""
import json, shlex, sys, time
sys.path.insert(0, sys.argv[3])
import submit
from ray.job_submission import JobStatus, JobSubmissionClient

address, job_id = sys.argv[1], sys.argv[2]
client = JobSubmissionClient(address)
out = {"status": str(client.get_job_status(job_id).value), "logs": client.get_job_logs(job_id)}
code = '''
import json, os, ray, rlflow, controllers, workers
def where():
    import rlflow, controllers, workers
    return {m.__name__: os.path.dirname(os.path.abspath(m.__file__)) for m in (rlflow, controllers, workers)}
ray.init()
print("PROBE", json.dumps({"cwd": os.getcwd(), "driver": where(), "worker": ray.get(ray.remote(num_cpus=0)(where).remote())}))
'''
probe_id = client.submit_job(entrypoint="python -c " + shlex.quote(code), runtime_env=submit.build_runtime_env(sys.argv[4]))
deadline = time.monotonic() + float(sys.argv[5])
while client.get_job_status(probe_id) not in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
    if time.monotonic() > deadline:
        client.stop_job(probe_id)
        break
    time.sleep(0.5)
out["probe_status"] = str(client.get_job_status(probe_id).value)
out["probe_logs"] = client.get_job_logs(probe_id)

# `ray job stop` on a training job once its first step is logged: SIGTERM, the step finishes and is
# checkpointed, the driver exits (within submit's RAY_JOB_STOP_WAIT_TIME_S)
long_id = client.submit_job(entrypoint=submit.build_entrypoint(json.loads(sys.argv[6])),
                            runtime_env=submit.build_runtime_env(sys.argv[4]))
while "step 1/" not in client.get_job_logs(long_id) and time.monotonic() < deadline:
    if client.get_job_status(long_id) in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
        break
    time.sleep(0.3)
stop_sent = time.monotonic()
client.stop_job(long_id)
while client.get_job_status(long_id) not in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
    if time.monotonic() > deadline:
        break
    time.sleep(0.3)
out["stop_seconds"] = time.monotonic() - stop_sent
out["stopped_status"] = str(client.get_job_status(long_id).value)
out["stopped_logs"] = client.get_job_logs(long_id)
print(json.dumps(out))
"""


@pytest.mark.timeout(600)
def test_submit_runs_rlflow_train_as_a_ray_job(tiny_model_dir, tmp_path):
    t0 = time.monotonic()
    cluster = LocalCluster(num_cpus=4)
    with CpuSampler(cluster.marker) as sampler:
        try:
            cluster.wait_ready()
            ready_s = time.monotonic() - t0
            job_id = f"rlflow-test-{uuid.uuid4().hex[:8]}"
            overrides = tiny_overrides(tiny_model_dir, **{
                "trainer.total_steps": 1, "trainer.logger": "[console,jsonl]",
                "trainer.default_local_dir": str(tmp_path / "outputs"), "trainer.experiment_name": "job",
            })
            started = time.monotonic()
            # the address goes to the script only (--address): RAY_ADDRESS stays out of every environment
            submitted = subprocess.run(
                ["bash", str(SUBMIT_SH), "--address", cluster.address, "--submission-id", job_id, "--timeout", "300", "--",
                 *overrides],
                env={**cluster.env, "PYTHON": sys.executable}, cwd=str(tmp_path), capture_output=True, text=True, timeout=420,
            )
            job_seconds = time.monotonic() - started
            assert submitted.returncode == 0, (
                f"submit.sh exited {submitted.returncode}\n{submitted.stdout[-6000:]}\n{submitted.stderr[-4000:]}")
            assert f"job {job_id} SUCCEEDED" in submitted.stdout
            assert "step 1/1" in submitted.stdout  # the logs were streamed to the caller

            t1 = time.monotonic()
            long_run = tiny_overrides(tiny_model_dir, **{
                "trainer.total_steps": 200, "trainer.logger": "[console]",
                "trainer.default_local_dir": str(tmp_path / "outputs"), "trainer.experiment_name": "stopped",
            })
            probe = subprocess.run(
                [sys.executable, "-c", _PROBE, cluster.address, job_id, str(REPO / "scripts"), str(REPO), "180",
                 json.dumps(long_run)],
                env=cluster.env, cwd=str(tmp_path), capture_output=True, text=True, timeout=300,
            )
            assert probe.returncode == 0, probe.stderr[-4000:]
            result = json.loads(probe.stdout.strip().splitlines()[-1])
            assert result["status"] == "SUCCEEDED"
            logs = result["logs"]
            # the console tracker's line of the one training step, with its metrics
            line = next((ln for ln in logs.splitlines() if ln.startswith("step 1/1")), None)
            assert line is not None, logs[-4000:]
            for metric in ("actor/pg_loss", "critic/vf_loss", "reward/score_mean"):
                assert metric in line, line
            records = [json.loads(ln) for ln in (tmp_path / "outputs" / "rlflow" / "job" / "metrics.jsonl").read_text().splitlines()]
            assert [r["step"] for r in records] == [1] and "actor/pg_loss" in records[0]

            # driver and workers import the uploaded copy (first on PYTHONPATH), not the checkout
            assert result["probe_status"] == "SUCCEEDED", result["probe_logs"][-4000:]
            where = json.loads(next(ln for ln in result["probe_logs"].splitlines() if ln.startswith("PROBE "))[6:])
            copy = where["cwd"]
            assert copy != str(REPO) and "working_dir_files" in copy
            for side in ("driver", "worker"):
                for name, folder in where[side].items():
                    assert folder == os.path.join(copy, name), (side, name, folder, copy)
            # what was uploaded: the code, without venvs, git or outputs
            uploaded = set(os.listdir(copy))
            assert {"rlflow", "controllers", "workers", "scripts", "configs", "pyproject.toml"} <= uploaded
            assert not uploaded & {".git", ".venv", ".venv-vllm", ".venv-trl", "outputs"}, uploaded
            # `ray job stop`: the run checkpointed the step it was in and said how to go on
            stopped = result["stopped_logs"]
            line = next((ln for ln in stopped.splitlines() if ln.startswith("rlflow: stopped by SIGTERM after step")), None)
            assert result["stopped_status"] == "STOPPED" and line is not None, stopped[-4000:]
            steps_done = int(line.split("after step ", 1)[1].split(" ", 1)[0])
            root = tmp_path / "outputs" / "rlflow" / "stopped" / "checkpoints"
            assert (root / "latest").read_text().strip() == f"step_{steps_done}", line
            assert (root / f"step_{steps_done}" / "manifest.json").is_file()
            print(f"\nray job stop: {line} ({result['stop_seconds']:.1f} s after the stop)")
            probe_s = time.monotonic() - t1
        finally:
            t2 = time.monotonic()
            cluster.stop()
    print(f"\njob submit: cluster up {ready_s:.1f} s, training job {job_seconds:.1f} s, probe job {probe_s:.1f} s, "
          f"teardown {time.monotonic() - t2:.1f} s; CPU of the cluster's and clients' processes "
          f"{sampler.total_s:.1f} s ({len(sampler.seen)} processes)")
    assert not _marked_pids(cluster.marker), "processes of the test cluster survived its teardown"
