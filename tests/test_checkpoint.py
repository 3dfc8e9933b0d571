"""Checkpoints: layout, exact round trip, atomic save, verification, untrusted files, export.

Most tests drive controllers.checkpoint with an in-process trainer (real worker classes and the
real tiny model, no Ray): they take about a second each. The end-to-end check (4 steps straight
vs 2 steps + save + a NEW fit with resume_mode=auto, FSDP2 actor and DDP critic with dp=2, KL
controller, warm-up schedule: identical parameters, optimizer state and metrics) is
tests/reliability/test_faults.py::test_worker_death_then_exact_resume, where the first fit is
stopped by a worker dying in step 3.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import random

import pytest
import torch

from controllers import checkpoint as ckpt
from controllers.checkpoint import CheckpointError
from rlflow.files import sha256_file
from controllers.ppo import PPOTrainer
from controllers.roles import enabled_roles


# ---------------------------------------------------------------------------------------------
# an in-process trainer: the real worker state code on one rank, without Ray
# ---------------------------------------------------------------------------------------------


class LocalGroup:
    """RayWorkerGroup's interface over workers living in this process."""

    def __init__(self, workers):
        self.workers = workers
        self.world_size = len(workers)

    def call_all(self, method, *args):
        return [getattr(w, method)(*args) for w in self.workers]

    def call_per_rank_async(self, method, per_rank_args):
        return [getattr(w, method)(*args) for w, args in zip(self.workers, per_rank_args)]

    def gather(self, futures, method):
        return futures


_LOADED: dict = {}


def _make_worker(cls_name: str, cfg, model_path: str):
    """A rank-0 worker without WorkerBase.__init__ (which seeds and sets threads process-wide)."""
    from workers.actor import ActorWorker, load_causal_lm
    from workers.critic import CriticWorker, load_value_model
    from workers.trainable import build_optimizer, build_scheduler

    cls = {"actor": ActorWorker, "critic": CriticWorker}[cls_name]
    worker = object.__new__(cls)
    worker.cfg, worker.rank, worker.world_size, worker.device = cfg, 0, 1, torch.device("cpu")
    section = getattr(cfg, cls_name)
    key = (cls_name, model_path)
    if key not in _LOADED:  # from_pretrained costs ~1 s of CPU; a deep copy a few ms
        _LOADED[key] = (load_causal_lm if cls_name == "actor" else load_value_model)(model_path, "float32")
    worker.model = copy.deepcopy(_LOADED[key])
    worker.optimizer = build_optimizer(worker.model.parameters(), section.optim)
    worker.scheduler = build_scheduler(worker.optimizer, section.optim, 10)
    return worker


def _train_a_bit(worker, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 100, (2, 6), generator=gen)
    worker.optimizer.zero_grad()
    worker.model(input_ids=ids).logits.float().pow(2).mean().backward()
    worker.optimizer.step()
    worker.scheduler.step()


class InProcessTrainer(PPOTrainer):
    """The real trainer's checkpoint interface (trained_groups, driver_state, load_driver_state)
    over in-process workers; the rollout sync is only counted."""

    def __init__(self, cfg, run_dir: str, model_path: str):
        from controllers.rollout_source import RolloutQueue, RolloutSource
        from rlflow.algos import get_kl_controller
        from rlflow.data.dataset import StatefulDataLoader

        super().__init__(cfg)
        self.run_dir, self.model_path = run_dir, model_path
        self.active_roles = enabled_roles(self.roles, self.cfg)
        self.groups = {"actor": LocalGroup([_make_worker("actor", self.cfg, model_path)]),
                       "critic": LocalGroup([_make_worker("critic", self.cfg, model_path)])}
        self.loader = StatefulDataLoader(list(range(40)), 4, shuffle=True, seed=3)
        self.kl_ctrl = get_kl_controller("adaptive", 0.05, 0.1, 100)
        self.rollouts = RolloutQueue(RolloutSource(), 0, self.cfg.trainer.total_steps)  # nothing in flight
        self.synced = 0

    def sync_weights(self):
        self.synced += 1


def make_trainer(run_dir: str, model_path: str, **trainer_overrides):
    from conftest import tiny_overrides

    from rlflow import load_config

    extra = {"algorithm.kl_ctrl.type": "adaptive", **{f"trainer.{k}": v for k, v in trainer_overrides.items()}}
    return InProcessTrainer(load_config(None, tiny_overrides(model_path, **extra)), run_dir, model_path)


def advance(trainer, step: int) -> None:
    """What a training step changes, driver and workers."""
    for role in ("actor", "critic"):
        _train_a_bit(trainer.groups[role].workers[0], seed=step)
    next(trainer.loader)
    trainer.kl_ctrl.update(0.3 + step, n_steps=16)
    torch.rand(3)
    random.random()
    trainer.history.append({"step": step, "actor/pg_loss": 0.1 * step, "timing/step": 0.5})


def _params(worker) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in worker.model.state_dict().items()}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The in-process training here is tiny: extra intra-op threads only spin on 2 busy cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def trained(tmp_path, tiny_model_dir):
    trainer = make_trainer(str(tmp_path / "run"), tiny_model_dir)
    for step in (1, 2):
        advance(trainer, step)
    path = ckpt.save(trainer, 2)
    return trainer, path


# ---------------------------------------------------------------------------------------------
# layout and the exact round trip
# ---------------------------------------------------------------------------------------------


def test_layout_manifest_and_latest(trained):
    trainer, path = trained
    root = os.path.dirname(path)
    assert os.path.basename(path) == "step_2"
    with open(os.path.join(root, "latest")) as f:
        assert f.read().strip() == "step_2"
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    assert manifest["step"] == 2 and manifest["roles"] == ["actor", "critic"]
    for rel in ("actor/model.safetensors", "actor/optimizer.pt", "actor/rng.pt", "critic/model.safetensors",
                "critic/optimizer.pt", "trainer_state.pt", "run_config.json", "hf/config.json", "hf/tokenizer.json"):
        assert rel in manifest["files"], rel
        entry = manifest["files"][rel]
        assert entry["size"] == os.path.getsize(os.path.join(path, rel))
        assert entry["sha256"] == sha256_file(os.path.join(path, rel))
    # every .pt loads under weights_only=True
    for rel in manifest["files"]:
        if rel.endswith(".pt"):
            torch.load(os.path.join(path, rel), weights_only=True)
    # tied embeddings are stored once
    from safetensors import safe_open

    with safe_open(os.path.join(path, "actor/model.safetensors"), "pt") as f:
        aliases = json.loads(f.metadata()["rlflow_aliases"])
        assert aliases["lm_head.weight"] == "model.embed_tokens.weight"
        assert "lm_head.weight" not in f.keys()
    assert not [n for n in os.listdir(root) if n.startswith(".tmp-")]


def test_resume_restores_everything(trained, tiny_model_dir):
    trainer, path = trained
    fresh = make_trainer(trainer.run_dir, tiny_model_dir)  # new models, optimizers, loader, RNGs
    torch.manual_seed(123)
    random.seed(123)
    assert ckpt.resume(fresh) == 2
    assert fresh.synced == 1, "the rollout engine must get the restored actor weights"
    assert fresh.weight_version == 2, "the next rollout is generated by the weights after 2 steps"
    for role in ("actor", "critic"):
        old, new = trainer.groups[role].workers[0], fresh.groups[role].workers[0]
        a, b = _params(old), _params(new)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), role
        assert new.scheduler.state_dict() == old.scheduler.state_dict()
        so, sn = old.optimizer.state_dict(), new.optimizer.state_dict()
        assert all(torch.equal(so["state"][i][n], sn["state"][i][n]) for i in so["state"] for n in so["state"][i])
        assert sn["param_groups"][0]["lr"] == so["param_groups"][0]["lr"]
    assert fresh.loader.state_dict() == trainer.loader.state_dict()
    assert fresh.kl_ctrl.state_dict() == trainer.kl_ctrl.state_dict() and fresh.kl_ctrl.value != 0.05
    assert fresh.history == trainer.history
    # driver RNGs continue where the saved run was
    assert torch.equal(torch.rand(4), _rand_after(trainer, path)[0])
    # one more identical step on both gives identical models (optimizer moments restored)
    advance(trainer, 3)
    advance(fresh, 3)
    for role in ("actor", "critic"):
        a, b = _params(trainer.groups[role].workers[0]), _params(fresh.groups[role].workers[0])
        assert all(torch.equal(a[k], b[k]) for k in a), role


def _rand_after(trainer, path):
    state = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=True)
    saved = torch.get_rng_state()
    torch.set_rng_state(state["torch_rng"])
    out = torch.rand(4)
    torch.set_rng_state(saved)
    return out, state


def test_save_before_the_first_optimizer_step_changes_nothing(tmp_path, tiny_model_dir):
    """torch's get/set_optimizer_state_dict initialise an empty Adam state with a fake step
    (step=1): saving or resuming before the first real step must not shift the bias correction."""
    trainer = make_trainer(str(tmp_path / "run"), tiny_model_dir)
    untouched = make_trainer(str(tmp_path / "other"), tiny_model_dir)
    ckpt.save(trainer, 0)
    assert not trainer.groups["actor"].workers[0].optimizer.state
    fresh = make_trainer(trainer.run_dir, tiny_model_dir)
    assert ckpt.resume(fresh) == 0
    assert not fresh.groups["actor"].workers[0].optimizer.state
    for t in (trainer, fresh, untouched):
        advance(t, 1)
    for role in ("actor", "critic"):
        want = _params(untouched.groups[role].workers[0])
        for t in (trainer, fresh):
            got = _params(t.groups[role].workers[0])
            assert all(torch.equal(got[k], want[k]) for k in want), role


def test_max_to_keep_and_resave(tmp_path, tiny_model_dir):
    trainer = make_trainer(str(tmp_path / "run"), tiny_model_dir, max_to_keep=2)
    for step in (1, 2, 3, 4):
        advance(trainer, step)
        ckpt.save(trainer, step)
    root = ckpt.checkpoint_root(trainer.run_dir)
    assert [name for _, name in ckpt.list_checkpoints(root)] == ["step_3", "step_4"]
    assert ckpt.find_latest(root).endswith("step_4")
    ckpt.save(trainer, 4)  # the same step again (a resumed run re-did it) replaces the folder
    ckpt.verify(os.path.join(root, "step_4"))
    assert sorted(os.listdir(root)) == ["latest", "step_3", "step_4"]


# ---------------------------------------------------------------------------------------------
# a save killed half-way
# ---------------------------------------------------------------------------------------------


class SimulatedKill(BaseException):
    """Not an Exception: like a SIGKILL, save() gets no chance to clean up."""


def test_kill_during_save_keeps_previous_checkpoint(trained, tiny_model_dir, monkeypatch):
    trainer, path = trained
    root = os.path.dirname(path)
    total = len(json.load(open(os.path.join(path, "manifest.json")))["files"])
    written = []

    file_written = ckpt._Writer._done

    def die_half_way(writer, rel, path):
        file_written(writer, rel, path)
        written.append(rel)
        if len(written) == total // 2:
            raise SimulatedKill(rel)

    advance(trainer, 3)
    monkeypatch.setattr(ckpt._Writer, "_done", die_half_way)  # the process "dies" after half the files
    with pytest.raises(SimulatedKill):
        ckpt.save(trainer, 3)
    monkeypatch.setattr(ckpt._Writer, "_done", file_written)
    leftovers = [n for n in os.listdir(root) if n.startswith(".tmp-step_3")]
    assert leftovers, "the simulated kill should leave a half-written folder behind"
    assert not os.path.exists(os.path.join(root, leftovers[0], "manifest.json"))
    assert not os.path.exists(os.path.join(root, "step_3"))
    assert open(os.path.join(root, "latest")).read().strip() == "step_2"
    assert ckpt.find_latest(root) == path
    fresh = make_trainer(trainer.run_dir, tiny_model_dir)
    assert ckpt.resume(fresh) == 2
    # the next good save cleans the leftovers
    ckpt.save(trainer, 3)
    assert not [n for n in os.listdir(root) if n.startswith(".tmp-")]


def test_worker_failure_during_save_writes_nothing(trained):
    trainer, path = trained

    class Failing(LocalGroup):
        def call_all(self, method, *args):
            raise RuntimeError("critic rank 0: state_for_checkpoint: the worker process died")

    trainer.groups["critic"] = Failing(trainer.groups["critic"].workers)
    with pytest.raises(RuntimeError, match="critic rank 0"):
        ckpt.save(trainer, 3)
    root = os.path.dirname(path)
    assert sorted(os.listdir(root)) == ["latest", "step_2"]


def test_full_disk_save_names_step_and_path_and_keeps_the_previous_checkpoint(trained, monkeypatch):
    """A save that hits a full disk (safetensors' own error, as the library raises it) is one
    SaveError naming the step, the folder and the checkpoint still intact; nothing is left behind."""
    from safetensors import SafetensorError

    trainer, path = trained
    root = os.path.dirname(path)
    advance(trainer, 3)

    def full_disk(*args, **kwargs):
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No '
                              'space left on device" })')

    monkeypatch.setattr(ckpt, "save_file", full_disk)
    with pytest.raises(ckpt.SaveError) as info:
        ckpt.save(trainer, 3)
    message = str(info.value)
    print(message)
    assert message.startswith(f"saving the checkpoint of step 3 to {os.path.join(root, 'step_3')} failed "
                              "(SafetensorError: Error while serializing")
    assert "No space left on device" in message and "\n" not in message
    assert message.endswith(f"nothing of it was kept, and {path} is still the latest checkpoint, intact")
    assert info.value.step == 3
    assert sorted(os.listdir(root)) == ["latest", "step_2"]
    ckpt.verify(path)


# ---------------------------------------------------------------------------------------------
# damaged and untrusted files
# ---------------------------------------------------------------------------------------------


def _truncate(path):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)


def _flip_byte(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("damage, rel, expected", [
    (_truncate, "actor/model.safetensors", r"file actor/model.safetensors has \d+ bytes, the manifest says \d+ \(truncated"),
    (_flip_byte, "critic/optimizer.pt", r"file critic/optimizer.pt does not match its sha256"),
    (os.remove, "actor/rng.pt", r"file actor/rng.pt is missing"),
    (os.remove, "manifest.json", r"has no manifest.json"),
])
def test_damaged_checkpoint_is_refused(trained, tiny_model_dir, damage, rel, expected):
    trainer, path = trained
    damage(os.path.join(path, rel))
    fresh = make_trainer(trainer.run_dir, tiny_model_dir)
    before = _params(fresh.groups["actor"].workers[0])
    with pytest.raises(CheckpointError, match=expected) as info:
        ckpt.resume(fresh)
    assert path in str(info.value)
    after = _params(fresh.groups["actor"].workers[0])
    assert all(torch.equal(before[k], after[k]) for k in before), "nothing may be loaded from a bad checkpoint"
    assert fresh.synced == 0


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('pwned')",))


@pytest.mark.parametrize("fmt", ["pickle", "torch.save"])
def test_malicious_pickle_is_refused_not_executed(trained, tiny_model_dir, tmp_path, fmt):
    """An attacker who can write the checkpoint can rewrite the manifest too: weights_only stops them."""
    trainer, path = trained
    marker = str(tmp_path / "executed")
    target = os.path.join(path, "actor", "optimizer.pt")
    payload = {"optimizer": _Evil(marker), "scheduler": {}}
    if fmt == "pickle":
        with open(target, "wb") as f:
            pickle.dump(payload, f)
    else:
        torch.save(payload, target)
    manifest_path = os.path.join(path, "manifest.json")
    manifest = json.load(open(manifest_path))
    manifest["files"]["actor/optimizer.pt"] = {"sha256": sha256_file(target), "size": os.path.getsize(target)}
    json.dump(manifest, open(manifest_path, "w"))
    assert not os.path.exists(marker)
    fresh = make_trainer(trainer.run_dir, tiny_model_dir)
    with pytest.raises(CheckpointError, match=r"actor/optimizer.pt holds objects other than tensors.*refused") as info:
        ckpt.resume(fresh)
    assert not os.path.exists(marker), "the pickle's payload ran"
    print(info.value)


def test_unsafe_state_is_refused_at_save(trained):
    import numpy as np

    trainer, _ = trained
    trainer.history.append({"step": 3, "reward/score_mean": np.float32(0.5)})
    with pytest.raises(CheckpointError, match=r"trainer_state.pt: /driver/history\[2\]/reward/score_mean is a numpy"):
        ckpt.save(trainer, 3)


# ---------------------------------------------------------------------------------------------
# resume modes
# ---------------------------------------------------------------------------------------------


def test_resume_modes(trained, tiny_model_dir, tmp_path):
    trainer, path = trained
    advance(trainer, 3)
    ckpt.save(trainer, 3)
    root = os.path.dirname(path)
    assert ckpt.resume(make_trainer(trainer.run_dir, tiny_model_dir, resume_mode="disable")) == 0
    assert ckpt.resume(make_trainer(trainer.run_dir, tiny_model_dir)) == 3  # auto: latest
    assert ckpt.resume(make_trainer(str(tmp_path / "other"), tiny_model_dir, resume_mode=path)) == 2  # a step folder
    assert ckpt.resume(make_trainer(str(tmp_path / "other"), tiny_model_dir, resume_mode=trainer.run_dir)) == 3  # a run dir
    assert ckpt.resume(make_trainer(str(tmp_path / "empty"), tiny_model_dir)) == 0  # auto, nothing there
    # a pointer naming a folder that is gone falls back to the highest step folder, with a warning
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("step_9\n")
    with pytest.warns(UserWarning, match="step_9"):
        assert ckpt.find_latest(root).endswith("step_3")


def test_config_change_on_resume_warns(trained, tiny_model_dir):
    trainer, _ = trained
    fresh = make_trainer(trainer.run_dir, tiny_model_dir, seed=7)
    with pytest.warns(UserWarning, match="trainer.seed"):
        ckpt.resume(fresh)


# ---------------------------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------------------------


def test_export_hf_loads_with_transformers(trained, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlflow.cli import main

    trainer, path = trained
    out = str(tmp_path / "exported")
    assert main(["export", path, out]) == 0
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(out)
    trained_model = trainer.groups["actor"].workers[0].model
    ids = torch.tensor([tokenizer("1+2=")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, trained_model(input_ids=ids).logits)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied
    with pytest.raises(FileExistsError, match="not an empty folder"):
        ckpt.export_hf(path, out)
    # a run folder resolves to its latest checkpoint
    assert ckpt.export_hf(trainer.run_dir, str(tmp_path / "again")) == str(tmp_path / "again")
