"""Multi-node: a Ray cluster of four nodes on this machine (ray.cluster_utils.Cluster: a head and
three worker raylets, each with its own resources).

Every node has 1 CPU and every worker reserves 1 (trainer.cpus_per_worker=1, trainer.colocate=false:
one placement group per role, PACK), so no node holds two workers: actor rank 0, actor rank 1, the
critic and the rollout land on four different nodes. The dp=2 run generates (the rollout takes the
actor's weights across nodes: rollout.weight_sync=auto must choose object_store), records its
rollouts and writes checkpoints to trainer.default_local_dir; a dp=1 run replays the recording, and
the two take the same gradient at every optimizer step (the gradient probes, plain SGD, token-mean:
tests/test_exactness.py's S1 family) and end at the same parameters.

The cluster runs in a subprocess with its own RAY_TMPDIR, so the session's Ray (tests/conftest.py
ray_session) is left alone whatever the order of the tests, and no other ray.init() on this machine
finds this cluster (Cluster writes its address to <RAY_TMPDIR>/ray/ray_current_cluster).

Run as a script (`python tests/test_multinode.py MODEL_DIR OUT_DIR`) it is that subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SGD_LR = {"actor": 0.05, "critic": 0.005}  # tests/test_exactness.py's S1 family
FAMILY = {
    "actor.loss_agg_mode": "token-mean", "critic.loss_agg_mode": "token-mean",
    "actor.optim.name": "sgd", "critic.optim.name": "sgd",
    "actor.optim.lr": SGD_LR["actor"], "critic.optim.lr": SGD_LR["critic"],
    "trainer.total_steps": 2,
    "reward.num_workers": 0,  # score in the driver: no reward processes
    "trainer.colocate": False,  # a placement group per role
    "trainer.cpus_per_worker": 1,  # = a node's CPUs: one worker per node
    "critic.dp_size": 1,
    "actor.ppo_micro_batch_size_per_gpu": 2,
}
# rank 0 and rank 1 (2 micro-batches of 2 rows each, unequal token counts) vs one rank (4 of 2)
DP2 = {"actor.dp_size": 2}
DP1 = {"actor.dp_size": 1}
NODES = 4  # head + 3 worker raylets; the dp=2 run's workers: actor x2, critic, rollout


# --------------------------------------------------------------------------------- the subprocess


def _run(model_dir: str, out_dir: str, **overrides):
    """One real fit on the connected cluster; its FitResult, where each worker ran, the sync path."""
    import torch

    import exactness_workers
    from exactness_helpers import BASE, FitResult
    from text_rewards import REWARD_FILE
    from conftest import tiny_overrides
    from rlflow import load_config
    from trainers import CapturingTrainer

    class PlacedTrainer(CapturingTrainer):
        def setup(self):
            super().setup()
            self.placement = {name: list(group.node_ids) for name, group in self.groups.items()}
            self.network = {name: {"master_addr": group.master_addr, "ranks": group.network}
                            for name, group in self.groups.items()}

    settings = {**BASE, **FAMILY, **overrides}
    settings["reward.custom_function.path"] = REWARD_FILE
    settings["trainer.default_local_dir"] = out_dir
    cfg = load_config(None, tiny_overrides(model_dir, **settings))
    start = time.perf_counter()
    trainer = PlacedTrainer(cfg, worker_classes=exactness_workers.RECORDING)
    history = trainer.fit()
    initial = {role: torch.load(exactness_workers.initial_weights_path(out_dir, role), weights_only=True)
               for role in trainer.final_weights}
    result = FitResult(history, trainer.final_weights, initial, cfg.actor.optim.name, time.perf_counter() - start)
    return result, trainer


def _run_losing_a_node(model_dir: str, out_dir: str, cluster, **overrides):
    """The replaying dp=1 fit again, on a cluster with a spare node: at the start of step 2 the
    node that holds the actor (or, when the actor is on the head node, the critic) is removed from the cluster (its raylet and every process on it stop);
    with trainer.max_failures the run restarts its workers on the nodes left and goes on."""
    from trainers import CapturingTrainer

    class NodeLosingTrainer(CapturingTrainer):
        removed = None

        def train_step(self, step):
            if step == 1 and self.removed is None:
                # the node of a trained role's rank 0; not the head (the driver's node)
                role, node = next((role, node) for role in ("actor", "critic") for node in cluster.worker_nodes
                                  if node.node_id == self.groups[role].node_ids[0])
                self.removed = {"node": node.node_id, "role": role, "at": time.time()}
                cluster.remove_node(node)
            return super().train_step(step)

        def start_workers(self, *restarting):
            super().start_workers(*restarting)
            self.placements = getattr(self, "placements", []) + [{n: list(g.node_ids) for n, g in self.groups.items()}]

    from exactness_helpers import BASE
    from text_rewards import REWARD_FILE
    from conftest import tiny_overrides
    from rlflow import load_config

    settings = {**BASE, **FAMILY, **overrides, "reward.custom_function.path": REWARD_FILE,
                "trainer.default_local_dir": out_dir}
    trainer = NodeLosingTrainer(load_config(None, tiny_overrides(model_dir, **settings)),
                                worker_classes=__import__("exactness_workers").RECORDING)
    history = trainer.fit()
    return history, trainer


def _stale_mismatch(model_dir: str, record: str, step: int) -> float:
    """The control of the weight sync check: max |log p - rollout log p| over the recorded batch of
    `step` (0-based) under the initial weights, i.e. had the rollout not received the update."""
    import torch

    from controllers.rollout_source import read_recorded
    from workers.actor import load_causal_lm
    from workers.forward import response_log_probs

    batch = read_recorded(record, step).batch
    with torch.no_grad():
        log_probs, _ = response_log_probs(load_causal_lm(model_dir, "float32").eval(), batch, temperature=1.0)
    mask = batch["response_mask"].bool()
    return float((log_probs - batch["rollout_log_probs"]).abs()[mask].max())


def main(model_dir: str, out_dir: str) -> None:
    import ray
    import torch
    from ray.cluster_utils import Cluster

    from controllers import checkpoint as ckpt
    from exactness_helpers import COMPARED_METRICS, compare_fits

    cluster = Cluster(initialize_head=True, connect=True, head_node_args={"num_cpus": 1})
    try:
        for _ in range(NODES - 1):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
        report = {"nodes": nodes, "driver_node": ray.get_runtime_context().get_node_id(), "seconds": {}}
        record = os.path.join(out_dir, "rollouts")
        # dp=2 across nodes: generates (rollout on its own node), records, checkpoints every step
        dp2, trainer = _run(model_dir, os.path.join(out_dir, "dp2"), **DP2,
                            **{"trainer.record_rollouts": record, "trainer.save_freq": 1})
        report["seconds"]["dp2"] = dp2.seconds
        report["placement"] = trainer.placement
        report["network"] = trainer.network
        report["weight_sync"] = trainer.weight_sync
        report["run_dir"] = trainer.run_dir
        root = ckpt.checkpoint_root(trainer.run_dir)
        report["checkpoints"] = [[step, os.path.join(root, name), sorted(ckpt.verify(os.path.join(root, name))["files"])]
                                 for step, name in sorted(ckpt.list_checkpoints(root))]
        report["latest"] = ckpt.find_latest(root)
        report["mismatch"] = [h.get("rollout_corr/abs_diff_max") for h in dp2.steps()]
        report["stale_mismatch"] = _stale_mismatch(model_dir, record, step=1)
        # dp=1 replays the dp=2 run's rollouts: the same batches, so the same gradients
        dp1, trainer = _run(model_dir, os.path.join(out_dir, "dp1"), **DP1, **{"trainer.replay_rollouts": record})
        report["seconds"]["dp1"] = dp1.seconds
        report["placement_dp1"] = trainer.placement
        diff = compare_fits(dp2, dp1, metrics=COMPARED_METRICS)
        report["diff"] = {"line": diff.line(), "failures": diff.failures, "num_probes": diff.num_probes,
                          "probe_excess": diff.probe_excess, "param_excess": diff.param_excess,
                          "metric_excess": diff.metric_excess}
        report["steps"] = [len(dp2.steps()), len(dp1.steps())]
        # the dp=1 run again, losing a trained role's node at step 2, with a spare node to go to
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        lost, trainer = _run_losing_a_node(model_dir, os.path.join(out_dir, "lost"), cluster, **DP1,
                                           **{"trainer.replay_rollouts": record, "trainer.max_failures": 1,
                                              "trainer.save_freq": 1})
        with open(os.path.join(trainer.run_dir, "recoveries.jsonl")) as f:
            recovery = json.loads(f.readline())
        same_weights = all(torch.equal(trainer.final_weights[role][name], dp1.weights[role][name])
                           for role in dp1.weights for name in dp1.weights[role])

        def compared(history):
            return [{k: v for k, v in h.items() if not k.startswith(("timing/", "trainer/recoveries"))}
                    for h in history]

        report["lost_node"] = {
            "removed": trainer.removed, "recovery": recovery, "placements": trainer.placements,
            "same_metrics": compared(lost) == compared(dp1.history), "same_weights": same_weights,
            "steps": [h["step"] for h in lost if h["step"] > 0]}
    finally:
        ray.shutdown()
        cluster.shutdown()
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=1)


# --------------------------------------------------------------------------------- the tests


def _free_of_ray_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.setdefault("RLFLOW_WORKER_THREADS", "1")
    return env


def test_cluster_of_nodes_places_syncs_checkpoints_and_matches_dp1(tmp_path):
    from exactness_helpers import build_varied_length_model

    model_dir = build_varied_length_model(str(tmp_path / "model"))
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    env = _free_of_ray_env()
    # its own Ray temp dir (short: Ray's socket paths must stay under 108 characters)
    env["RAY_TMPDIR"] = ray_tmp = tempfile.mkdtemp(prefix="rlmn", dir="/tmp")
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), model_dir, str(out_dir)], cwd=HERE, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=420)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # lets the script shut its cluster down
        try:
            output, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        pytest.fail(f"the multi-node run did not finish in 420 s:\n{output[-6000:]}")
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    wall = time.perf_counter() - start
    assert proc.returncode == 0, f"the multi-node run failed (exit {proc.returncode}):\n{output[-8000:]}"
    report = json.loads((out_dir / "report.json").read_text())
    print(f"\nmulti-node: {wall:.0f} s in all (fits: dp2 {report['seconds']['dp2']:.0f} s, "
          f"dp1 {report['seconds']['dp1']:.0f} s); rollout mismatch {report['mismatch']} "
          f"(stale weights: {report['stale_mismatch']:.3g}); {report['diff']['line']}")

    # four nodes; the driver on the head
    assert len(report["nodes"]) == NODES and report["driver_node"] in report["nodes"]
    # actor ranks 0 and 1 on different nodes, the rollout on a third, the critic on a fourth
    placement = report["placement"]
    actor0, actor1 = placement["actor"]
    (rollout,), (critic,) = placement["rollout"], placement["critic"]
    assert len({actor0, actor1, rollout, critic}) == 4, placement
    assert set(placement) == {"actor", "rollout", "critic"}
    # the actor group met on rank 0's node IP (not loopback), gloo bound to the interface holding it
    network = report["network"]["actor"]
    node_ip = network["ranks"][0]["node_ip"]
    assert network["master_addr"] == node_ip and not node_ip.startswith("127."), network
    expected_interface = next(name for name, ips in _interfaces().items() if node_ip in ips)
    assert [rank["gloo"] for rank in network["ranks"]] == [expected_interface] * 2, network
    # weights crossed nodes through Ray's object store, and the rollout really had them: at step 2
    # (after one SGD update at lr 0.05) the engine's log-probs still match the actor's forward
    assert report["weight_sync"] == "object_store"
    # (control: under the initial weights the step-2 batch's log-probs are report["stale_mismatch"] off)
    mismatch = report["mismatch"]
    assert len(mismatch) == 2 and all(m is not None and m < 1e-4 for m in mismatch), mismatch
    assert report["stale_mismatch"] > 100 * mismatch[1], (report["stale_mismatch"], mismatch)
    # checkpoints of both steps in trainer.default_local_dir, verified against their manifests
    run_dir = report["run_dir"]
    assert run_dir.startswith(str(out_dir / "dp2") + os.sep)
    steps = [step for step, _, _ in report["checkpoints"]]
    assert steps == [1, 2], report["checkpoints"]
    for _, path, files in report["checkpoints"]:
        assert path.startswith(os.path.join(run_dir, "checkpoints") + os.sep)
        assert "actor/model.safetensors" in files and "critic/model.safetensors" in files
    assert report["latest"] and report["latest"].endswith("step_2")
    # dp=2 across nodes == dp=1, gradient by gradient: probes, parameters and metrics within the
    # exactness tolerances
    assert report["steps"] == [2, 2]
    diff = report["diff"]
    assert diff["num_probes"] > 0
    assert not diff["failures"], "\n".join(diff["failures"][:20])
    # the dp=1 run again, losing a trained role's node at step 2: recovered on the spare node, and ends
    # exactly as the run that lost nothing (trainer.max_failures, controllers/recovery.py)
    lost = report["lost_node"]
    recovery = lost["recovery"]
    print(f"node lost at step 2: {recovery['error'][:160]}; going on after {recovery['seconds']:.1f} s "
          f"(noticed {recovery['detected'] - lost['removed']['at']:.1f} s after the removal)")
    removed = lost["removed"]
    assert (recovery["step"], recovery["role"], recovery["cause"], recovery["restored_step"]) == \
        (2, removed["role"], "died", 1), recovery
    before, after = lost["placements"]
    assert removed["node"] == before[removed["role"]][0]
    assert lost["removed"]["node"] not in {node for nodes in after.values() for node in nodes}, after
    assert lost["steps"] == [1, 2] and lost["same_metrics"] and lost["same_weights"], lost


def _interfaces() -> dict[str, list[str]]:
    from workers.base import interface_addresses

    return interface_addresses()


# --------------------------------------------------------------------------------- no cluster


@pytest.mark.parametrize("value, ok", [
    (None, True), ("eth0", True), ("10.1.2.3", True),
    ("fe80::1", False), ("not an interface", False), ("a-name-longer-than-15", False), ("10.0.0.0/8", False),
])
def test_dist_interface_config(value, ok):
    from rlflow.config import ConfigError, load_config

    overrides = [] if value is None else [f"trainer.dist_interface={value}"]
    if ok:
        assert load_config(None, overrides).trainer.dist_interface == value
    else:
        with pytest.raises(ConfigError, match=r"trainer\.dist_interface="):
            load_config(None, overrides)


def _worker(monkeypatch, dist_interface, node_ip="192.0.2.77", rank=0):
    """A WorkerBase without its __init__ (no Ray, no seeding): its config and rank only."""
    import torch

    import workers.base as base
    from rlflow import load_config
    from rlflow.config import to_dataclass

    overrides = [] if dist_interface is None else [f"trainer.dist_interface={dist_interface}"]
    worker = object.__new__(base.WorkerBase)
    worker.cfg = to_dataclass(load_config(None, overrides))
    worker.rank, worker.world_size, worker.device = rank, 2, torch.device("cpu")
    monkeypatch.setattr(base, "ray_node_ip", lambda: node_ip)
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    return worker


def test_rendezvous_address(monkeypatch):
    from workers.base import interface_addresses

    loopback = next(name for name, ips in interface_addresses().items() if "127.0.0.1" in ips)
    # null: loopback on one node (as before), the node's IP as Ray sees it across nodes
    worker = _worker(monkeypatch, None, node_ip="127.0.0.1")
    assert worker.node_address(spans_nodes=False)[0] == "127.0.0.1"
    assert worker.node_address(spans_nodes=True)[0] == "127.0.0.1"  # this node's IP here
    # across nodes, gloo binds the interface that holds the node's IP; on one node nothing changes
    assert worker.bind_network(spans_nodes=False)["gloo"] is None
    assert worker.bind_network(spans_nodes=True)["gloo"] == loopback
    # an interface name: its address on rank 0's node, and the socket interface of both backends
    worker = _worker(monkeypatch, loopback)
    host, port = worker.node_address()
    assert host == "127.0.0.1" and 0 < port < 65536
    assert worker.bind_network(spans_nodes=True) == {"node_ip": "192.0.2.77", "gloo": loopback, "nccl": loopback}
    assert os.environ["GLOO_SOCKET_IFNAME"] == os.environ["NCCL_SOCKET_IFNAME"] == loopback
    # a literal IP of this node
    assert _worker(monkeypatch, "127.0.0.1").node_address()[0] == "127.0.0.1"


def test_rendezvous_errors_name_the_key(monkeypatch):
    worker = _worker(monkeypatch, "nosuchif0")
    with pytest.raises(ValueError, match=r"trainer\.dist_interface='nosuchif0'.*no network interface of that name"):
        worker.node_address()
    with pytest.raises(ValueError, match=r"trainer\.dist_interface='nosuchif0': the node 192\.0\.2\.77 of worker rank 0"):
        worker.bind_network(spans_nodes=True)
    # an address that is not this node's (TEST-NET-3, never assigned)
    with pytest.raises(ValueError, match=r"trainer\.dist_interface='203\.0\.113\.9'.*not an address"):
        _worker(monkeypatch, "203.0.113.9").node_address()


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    main(sys.argv[1], sys.argv[2])
