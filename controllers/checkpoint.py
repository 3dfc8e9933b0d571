"""Checkpoints: atomic save, verified resume, HF export.

A checkpoint is the folder ``<run_dir>/checkpoints/step_<N>/`` (N = steps done)::

    manifest.json              format, step, and the sha256 + size of every other file
    trainer_state.pt           step, driver RNGs, and the driver state (data position, KL controller, history)
    run_config.json            the run's config (for a human, and to warn when a resume differs)
    actor/model.safetensors    full (unsharded) weights; tied weights stored once (metadata)
    actor/adapter_model.safetensors, actor/adapter_config.json
                               instead, with actor.lora: the LoRA adapters only, as peft saves an
                               adapter (PeftModel.from_pretrained(base, "<checkpoint>/actor") loads it)
    actor/optimizer.pt         {"optimizer": by parameter name, "scheduler": ...}
    actor/rng.pt               {"per_rank": [RNG states of rank 0, 1, ...]}
    critic/...                 the same, when the run has a critic
    hf/                        config.json, tokenizer and generation files of the model folder

Every ``.pt`` file holds only tensors, dicts, lists, tuples, numbers, strings and None: it is
read with ``torch.load(weights_only=True)`` (checked on save), so a checkpoint from elsewhere
cannot run code. Weights are safetensors.

Writing is atomic: the whole folder is written under ``checkpoints/.tmp-step_<N>-*``, every file
and folder fsync'ed, the manifest written last, then the folder is renamed to ``step_<N>`` and
the ``latest`` pointer (a one-line file) replaced atomically. Only then are checkpoints beyond
``trainer.max_to_keep`` (and leftovers of interrupted saves) deleted. A save killed at any point
leaves the previous checkpoint as ``latest``; a half-written folder never has a ``step_<N>`` name.

Loading verifies the manifest first: a missing file, a size or a checksum mismatch is a
CheckpointError naming the file and the checkpoint; nothing is loaded from a checkpoint that
does not verify.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import random
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Any

import ray
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from controllers.worker_group import RayWorkerGroup
from rlflow.checkpoint_paths import (LATEST, MANIFEST, CheckpointError, checkpoint_root, find_latest,
                                     list_checkpoints, resolve_checkpoint)
from rlflow.config import config_to_dict
from rlflow.files import sha256_file
from workers import lora

FORMAT_VERSION = 2  # 2: the driver state under "driver"; recorded rollouts no longer inside
TRAINER_STATE = "trainer_state.pt"
MODEL_FILE = "model.safetensors"
ADAPTER_FILE, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"  # peft's names
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")
_MAX_HF_FILE = 200 * 2**20


# ---------------------------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------------------------


@dataclass
class Snapshot:
    """A restore point: what a checkpoint holds, in the driver's memory.

    roles: {role: {"model", "optimizer", "scheduler", "adapter_config", "per_rank_rng"}} (full
    state from rank 0, every rank's RNG); None: the trained roles as their workers start (a run's
    first step, which a restart reproduces). trainer_state: step, driver RNGs, driver state.
    """

    step: int
    roles: dict[str, dict] | None
    trainer_state: dict
    source: str = "memory"  # or the checkpoint folder it was read from


def collect(trainer, step: int, workers: bool = True) -> Snapshot:
    """The state of the run after `step` steps (a collective on the FSDP2 ranks). workers=False:
    the driver's part only (valid before the first step, see Snapshot)."""
    roles = None
    if workers:
        roles = {}
        for role, group in trainer.trained_groups().items():
            states = group.call_all("state_for_checkpoint")
            full = states[0]
            missing = [k for k in ("model", "optimizer", "scheduler") if k not in full]
            if missing:
                raise CheckpointError(f"{role} rank 0 returned no {missing} from state_for_checkpoint")
            roles[role] = {"model": full["model"], "optimizer": full["optimizer"], "scheduler": full["scheduler"],
                           "adapter_config": full.get("adapter_config"),
                           "per_rank_rng": [s.get("rng") for s in states]}
    trainer_state = {
        "format": FORMAT_VERSION,
        "step": int(step),
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        # a copy: the in-flight rollouts' tensors must not change with the batches trained later
        "driver": copy.deepcopy(trainer.driver_state()),
    }
    return Snapshot(int(step), roles, trainer_state)


class SaveError(RuntimeError):
    """A checkpoint could not be written (a full disk, a permission); the message names the step, the
    folder and the checkpoint that is still the latest. Nothing of the failed save is left behind."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


def save(trainer, step: int) -> str:
    """Write the checkpoint of `step` (steps done) atomically; returns its folder.

    `trainer` provides cfg, run_dir, model_path, trained_groups() ({role: group} of the roles that
    train) and driver_state() (weights_only-loadable data: data position, KL controller, history).
    """
    # everything is collected first, so a failing worker leaves no folder at all
    return write(collect(trainer, step), trainer.run_dir, trainer.cfg, trainer.model_path)


def write(snapshot: Snapshot, run_dir: str, cfg, model_path: str | None) -> str:
    """Write a collected snapshot as the checkpoint of its step; returns its folder. Touches no
    worker, so it may run beside the next steps (trainer.async_save). Raises SaveError."""
    step = snapshot.step
    root = checkpoint_root(run_dir)
    final = os.path.join(root, f"step_{step}")
    tmp = None
    try:
        os.makedirs(root, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".tmp-step_{step}-", dir=root)
        writer = _Writer(tmp)
        for role, saved in (snapshot.roles or {}).items():
            _write_weights(writer, role, saved)
            writer.torch_save(f"{role}/optimizer.pt", {"optimizer": saved["optimizer"], "scheduler": saved["scheduler"]})
            writer.torch_save(f"{role}/rng.pt", {"per_rank": saved["per_rank_rng"]})
        writer.torch_save(TRAINER_STATE, snapshot.trainer_state)
        writer.json("run_config.json", config_to_dict(cfg))
        if model_path and os.path.isdir(model_path):
            for name in _hf_side_files(model_path):
                writer.copy(os.path.join(model_path, name), f"hf/{name}")
        writer.manifest(step, roles=list(snapshot.roles or {}))
        writer.sync_dirs()
        # the rename is the point where the checkpoint exists
        _rename_into_place(tmp, final)
    except CheckpointError:
        _remove_tmp(tmp)
        raise
    except Exception as err:  # noqa: BLE001 - an OSError, safetensors' own error, ...: one message for all
        _remove_tmp(tmp)
        latest = find_latest(root) if os.path.isdir(root) else None
        safe = f"{latest} is still the latest checkpoint, intact" if latest else "no earlier checkpoint exists"
        raise SaveError(f"saving the checkpoint of step {step} to {final} failed ({type(err).__name__}: "
                        f"{' '.join(str(err).split())}); nothing of it was kept, and {safe}", step) from err
    _write_latest(root, os.path.basename(final))
    _prune(root, keep=cfg.trainer.max_to_keep, current=os.path.basename(final))
    return final


def _remove_tmp(tmp: str | None) -> None:
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_weights(writer: "_Writer", role: str, full: dict) -> None:
    """The role's whole model, or (LoRA) its adapters in peft's adapter folder layout."""
    if full.get("adapter_config") is None:
        writer.safetensors(f"{role}/{MODEL_FILE}", full["model"])
        return
    # every adapter tensor under its own name (no tied-weight aliases): peft reads the file as it is
    writer.safetensors(f"{role}/{ADAPTER_FILE}", full["model"], dedupe=False)
    writer.json(f"{role}/{ADAPTER_CONFIG}", full["adapter_config"])


class _Writer:
    """Writes files under a folder, fsyncs each, records (sha256, size) for the manifest."""

    def __init__(self, base: str):
        self.base = base
        self.files: dict[str, dict] = {}
        self.dirs = {base}

    def _path(self, rel: str) -> str:
        path = os.path.join(self.base, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.dirs.add(os.path.dirname(path))
        return path

    def _done(self, rel: str, path: str) -> None:
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
        self.files[rel] = {"sha256": sha256_file(path), "size": os.path.getsize(path)}

    def torch_save(self, rel: str, obj: Any) -> None:
        _check_weights_only(obj, rel)
        path = self._path(rel)
        torch.save(obj, path)
        self._done(rel, path)

    def safetensors(self, rel: str, state: dict[str, torch.Tensor], dedupe: bool = True) -> None:
        if dedupe:
            tensors, aliases = _dedupe_tied(state)
        else:
            tensors, aliases = {name: tensor.detach().cpu().contiguous() for name, tensor in state.items()}, {}
        path = self._path(rel)
        save_file(tensors, path, metadata={"format": "pt", "rlflow_aliases": json.dumps(aliases)})
        self._done(rel, path)

    def json(self, rel: str, obj: Any) -> None:
        path = self._path(rel)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=1, sort_keys=True, default=str)
        self._done(rel, path)

    def copy(self, src: str, rel: str) -> None:
        path = self._path(rel)
        shutil.copyfile(src, path)
        self._done(rel, path)

    def manifest(self, step: int, roles: list[str]) -> None:
        path = self._path(MANIFEST)
        body = {"format": FORMAT_VERSION, "step": int(step), "roles": roles, "created": time.time(), "files": self.files}
        with open(path, "w", encoding="utf-8") as f:
            json.dump(body, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())

    def sync_dirs(self) -> None:
        for d in sorted(self.dirs, key=len, reverse=True):
            _fsync_dir(d)


def _dedupe_tied(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Store equal tensors once: tied embeddings (which arrive as copies from the workers, and which
    safetensors refuses when they share memory). Loading gives every name its value back, so
    merging tensors that are merely equal (zero-initialised biases) loses nothing."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    buckets: dict[tuple, list[str]] = {}
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"model state entry {name!r} is a {type(tensor).__name__}, not a tensor")
        tensor = tensor.detach().cpu().contiguous()
        probe = bytes(tensor.reshape(-1)[:64].contiguous().view(torch.uint8).tolist()) if tensor.numel() else b""
        key = (tensor.dtype, tuple(tensor.shape), probe)
        twin = next((other for other in buckets.get(key, ()) if torch.equal(tensors[other], tensor)), None)
        if twin is not None:
            aliases[name] = twin
            continue
        buckets.setdefault(key, []).append(name)
        tensors[name] = tensor
    # tensors still sharing memory (views of one storage) are stored as separate copies
    owners: dict[int, int] = {}
    for tensor in tensors.values():
        ptr = tensor.untyped_storage().data_ptr()
        owners[ptr] = owners.get(ptr, 0) + 1
    for name, tensor in list(tensors.items()):
        if tensor.numel() and owners[tensor.untyped_storage().data_ptr()] > 1:
            tensors[name] = tensor.clone()
    return tensors, aliases


_SAFE_LEAVES = (torch.Tensor, int, float, bool, str, type(None), torch.dtype, torch.device, torch.Size)


def _check_weights_only(obj: Any, where: str, path: str = "") -> None:
    """Everything torch.save writes here must load with weights_only=True: fail at save, not at resume."""
    if isinstance(obj, _SAFE_LEAVES):
        return
    if isinstance(obj, dict):
        for key, value in obj.items():
            if not isinstance(key, (str, int, float, bool)):
                raise CheckpointError(f"{where}: key {key!r} at {path or '/'} is a {type(key).__name__}")
            _check_weights_only(value, where, f"{path}/{key}")
        return
    if isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            _check_weights_only(value, where, f"{path}[{index}]")
        return
    raise CheckpointError(
        f"{where}: {path or '/'} is a {type(obj).__module__}.{type(obj).__name__}, which torch.load(weights_only=True) "
        "would refuse; convert it to tensors / numbers / strings before saving"
    )


def _hf_side_files(model_path: str) -> list[str]:
    """The model folder's config, generation config and tokenizer files (not its weights)."""
    names = []
    for name in sorted(os.listdir(model_path)):
        path = os.path.join(model_path, name)
        if not os.path.isfile(path) or name.startswith("."):
            continue
        if name.endswith(_WEIGHT_SUFFIXES) or name.endswith(".index.json") or os.path.getsize(path) > _MAX_HF_FILE:
            continue
        names.append(name)
    return names


def _rename_into_place(tmp: str, final: str) -> None:
    if os.path.exists(final):
        # the same step saved again (a resumed run re-did it): swap, then delete the old one
        trash = tempfile.mkdtemp(prefix=f".trash-{os.path.basename(final)}-", dir=os.path.dirname(final))
        os.rename(final, os.path.join(trash, "old"))
        os.rename(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(os.path.dirname(final))


def _write_latest(root: str, name: str) -> None:
    tmp = os.path.join(root, f".{LATEST}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, LATEST))
    _fsync_dir(root)


def _prune(root: str, keep: int, current: str) -> None:
    """Keep the `keep` newest checkpoints (always `current`); remove leftovers of killed saves."""
    steps = sorted(list_checkpoints(root), key=lambda item: item[0])
    names = [name for _, name in steps]
    kept = set(names[-keep:]) | {current}
    for name in names:
        if name not in kept:
            _remove_dir(root, name)
    for name in os.listdir(root):
        if name.startswith((".tmp-", ".trash-")) and os.path.isdir(os.path.join(root, name)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _remove_dir(root: str, name: str) -> None:
    # rename first: a deletion cut short must not leave a broken step_<N> folder behind
    trash = os.path.join(root, f".trash-{name}-{os.getpid()}")
    os.rename(os.path.join(root, name), trash)
    shutil.rmtree(trash, ignore_errors=True)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems do not support fsync on directories
        pass
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# finding and verifying
# ---------------------------------------------------------------------------------------------


def verify(ckpt_dir: str) -> dict:
    """Check every file against the manifest; returns the manifest. Raises CheckpointError."""
    manifest_path = os.path.join(ckpt_dir, MANIFEST)
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"checkpoint {ckpt_dir} does not exist")
    if not os.path.isfile(manifest_path):
        raise CheckpointError(f"checkpoint {ckpt_dir} has no {MANIFEST}: it is incomplete or not an rlflow checkpoint")
    try:
        with open(manifest_path, encoding="utf-8") as f:
            manifest = json.load(f)
        files = manifest["files"]
        if not isinstance(files, dict):
            raise TypeError("'files' is not a mapping")
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"checkpoint {ckpt_dir}: {MANIFEST} is unreadable ({err})") from err
    if manifest.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {ckpt_dir}: format {manifest.get('format')!r}, this rlflow reads {FORMAT_VERSION}")
    base = os.path.realpath(ckpt_dir)
    for rel, entry in files.items():
        path = os.path.realpath(os.path.join(ckpt_dir, rel))
        if os.path.isabs(rel) or not path.startswith(base + os.sep):
            raise CheckpointError(f"checkpoint {ckpt_dir}: {MANIFEST} lists {rel!r}, a path outside the checkpoint")
        if not os.path.isfile(path):
            raise CheckpointError(f"checkpoint {ckpt_dir}: file {rel} is missing")
        size = os.path.getsize(path)
        if size != entry.get("size"):
            raise CheckpointError(
                f"checkpoint {ckpt_dir}: file {rel} has {size} bytes, the manifest says {entry.get('size')} "
                "(truncated or replaced)"
            )
        if sha256_file(path) != entry.get("sha256"):
            raise CheckpointError(f"checkpoint {ckpt_dir}: file {rel} does not match its sha256 in the manifest (corrupted or modified)")
    if TRAINER_STATE not in files:
        raise CheckpointError(f"checkpoint {ckpt_dir}: the manifest lists no {TRAINER_STATE}")
    return manifest


def _torch_load(ckpt_dir: str, rel: str) -> Any:
    path = os.path.join(ckpt_dir, rel)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"checkpoint {ckpt_dir}: file {rel} holds objects other than tensors and plain data; it was refused "
            f"(torch.load(weights_only=True)) and not executed: {str(err).splitlines()[0]}"
        ) from err
    except Exception as err:  # noqa: BLE001 - a broken zip, an EOF, ...
        raise CheckpointError(f"checkpoint {ckpt_dir}: file {rel} cannot be read: {type(err).__name__}: {err}") from err


def _load_model_file(ckpt_dir: str, rel: str) -> dict[str, torch.Tensor]:
    path = os.path.join(ckpt_dir, rel)
    try:
        with safe_open(path, framework="pt") as f:
            aliases = json.loads((f.metadata() or {}).get("rlflow_aliases", "{}"))
            state = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as err:  # noqa: BLE001
        raise CheckpointError(f"checkpoint {ckpt_dir}: file {rel} cannot be read as safetensors: {err}") from err
    for alias, target in aliases.items():
        state[alias] = state[target]
    return state


# ---------------------------------------------------------------------------------------------
# resume
# ---------------------------------------------------------------------------------------------


def resume(trainer) -> int:
    """Restore the run per trainer.resume_mode; returns the first step to run (0: from scratch).
    The folder resumed from is trainer.resumed_from (None: from scratch)."""
    mode = str(trainer.cfg.trainer.resume_mode)
    trainer.resumed_from = None
    if mode == "disable":
        return 0
    if mode == "auto":
        ckpt = find_latest(checkpoint_root(trainer.run_dir))
        if ckpt is None:
            return 0
    else:
        ckpt = resolve_checkpoint(mode)
    step = load(trainer, ckpt)
    trainer.resumed_from = ckpt
    return step


def load(trainer, ckpt_dir: str) -> int:
    """Load a verified checkpoint into a set-up trainer; returns its step."""
    step = restore(trainer, read(ckpt_dir, trainer.cfg))
    print(f"rlflow: resumed from {ckpt_dir} (step {step})", file=sys.stderr)
    return step


def read(ckpt_dir: str, cfg) -> Snapshot:
    """A verified checkpoint, read into memory (a config that differs in what shapes the run warns)."""
    manifest = verify(ckpt_dir)
    files = manifest["files"]
    state = _torch_load(ckpt_dir, TRAINER_STATE)
    _warn_config_changes(ckpt_dir, cfg)
    roles = {}
    for role in manifest.get("roles", []):
        model, adapter_config = _load_weights(ckpt_dir, files, role)
        optim = _torch_load(ckpt_dir, f"{role}/optimizer.pt")
        roles[role] = {"model": model, "optimizer": optim["optimizer"], "scheduler": optim["scheduler"],
                       "adapter_config": adapter_config,
                       "per_rank_rng": _torch_load(ckpt_dir, f"{role}/rng.pt")["per_rank"]}
    return Snapshot(int(state["step"]), roles, state, source=ckpt_dir)


def restore(trainer, snapshot: Snapshot) -> int:
    """Put a snapshot into a set-up trainer (its workers and its driver state); returns its step.
    A snapshot may be restored more than once: nothing of it is handed over to be changed."""
    groups = trainer.trained_groups()
    where = "the snapshot" if snapshot.source == "memory" else f"checkpoint {snapshot.source}"
    if snapshot.roles is not None:
        for role in sorted(set(snapshot.roles) - set(groups)):
            _warn(f"{where} has {role} state but this run has no {role}; it is ignored")
        pending = []
        for role, group in groups.items():
            if role not in snapshot.roles:
                raise CheckpointError(f"{where} has no {role} state, but this run trains a {role}")
            saved = snapshot.roles[role]
            per_rank = saved["per_rank_rng"]
            if len(per_rank) != group.world_size:
                _warn(f"{where}: {role} had {len(per_rank)} ranks, this run has {group.world_size}; "
                      "weights and optimizer load exactly, the extra ranks keep their seeded RNG")
            payload = _share(group, {key: saved[key] for key in ("model", "optimizer", "scheduler", "adapter_config")})
            futures = group.call_per_rank_async(
                "load_checkpoint_state",
                [(payload, per_rank[r] if r < len(per_rank) else None) for r in range(group.world_size)])
            pending.append((group, futures))
        for group, futures in pending:
            group.gather(futures, "load_checkpoint_state")
    state = snapshot.trainer_state
    torch.set_rng_state(state["torch_rng"])
    version, internal, gauss = state["python_rng"]
    random.setstate((version, tuple(internal), gauss))
    trainer.load_driver_state(copy.deepcopy(state["driver"]), int(state["step"]))
    return int(state["step"])


def _load_weights(ckpt_dir: str, files: dict, role: str) -> tuple[dict[str, torch.Tensor], dict | None]:
    """(the role's saved weights, its adapter config or None): the whole model, or LoRA adapters."""
    if f"{role}/{ADAPTER_FILE}" in files:
        return _load_model_file(ckpt_dir, f"{role}/{ADAPTER_FILE}"), _load_json(ckpt_dir, f"{role}/{ADAPTER_CONFIG}")
    if f"{role}/{MODEL_FILE}" not in files:
        raise CheckpointError(f"checkpoint {ckpt_dir} has no {role} state, but this run trains a {role}")
    return _load_model_file(ckpt_dir, f"{role}/{MODEL_FILE}"), None


def _load_json(ckpt_dir: str, rel: str) -> dict:
    try:
        with open(os.path.join(ckpt_dir, rel), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint {ckpt_dir}: file {rel} cannot be read as JSON: {err}") from err


def _share(group, payload):
    """One copy in the object store for all ranks, rather than one per call."""
    if isinstance(group, RayWorkerGroup):
        return ray.put(payload)
    return payload


# keys whose change makes a resumed run a different run (a warning, since it may be intended)
_RESUME_SENSITIVE = ("data", "rollout", "algorithm", "actor.ppo_mini_batch_size", "actor.ppo_epochs", "actor.model.path",
                     "critic.ppo_mini_batch_size", "trainer.seed")


def _warn_config_changes(ckpt_dir: str, cfg) -> None:
    path = os.path.join(ckpt_dir, "run_config.json")
    if not os.path.isfile(path):
        return
    try:
        with open(path, encoding="utf-8") as f:
            old = json.load(f)
    except ValueError:
        return
    new = json.loads(json.dumps(config_to_dict(cfg), default=str))
    changed = [key for key in _RESUME_SENSITIVE if _get(old, key) != _get(new, key)]
    if changed:
        _warn(f"resuming from {ckpt_dir} with a different config for {', '.join(changed)}: the run will not "
              "continue exactly as it would have")


def _get(tree: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(tree, dict):
            return None
        tree = tree.get(part)
    return tree


def _warn(message: str) -> None:
    warnings.warn(message, stacklevel=3)


# ---------------------------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------------------------


def export_hf(ckpt_dir: str, out_dir: str) -> str:
    """Write the checkpoint's actor as a HF model folder (AutoModelForCausalLM.from_pretrained)."""
    ckpt_dir = resolve_checkpoint(ckpt_dir)
    manifest = verify(ckpt_dir)
    files = manifest["files"]
    if f"actor/{MODEL_FILE}" not in files and f"actor/{ADAPTER_FILE}" not in files:
        raise CheckpointError(f"checkpoint {ckpt_dir} has no actor weights")
    if "hf/config.json" not in files:
        raise CheckpointError(f"checkpoint {ckpt_dir} has no hf/config.json: the run's model folder was not recorded")
    out_dir = os.fspath(out_dir)
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise FileExistsError(f"export target {out_dir} exists and is not an empty folder")
    with open(os.path.join(ckpt_dir, "hf", "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    state = _actor_weights(ckpt_dir, files)
    tied = bool(config.get("tie_word_embeddings", False))
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in state.items():
        if tied and name == "lm_head.weight":
            continue  # transformers ties it to the input embedding on load
        if tensor.untyped_storage().data_ptr() in seen:
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        tensors[name] = tensor.contiguous()
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".tmp-{os.path.basename(os.path.abspath(out_dir))}-", dir=parent)
    try:
        for rel in sorted(files):
            if rel.startswith("hf/"):
                shutil.copyfile(os.path.join(ckpt_dir, rel), os.path.join(tmp, rel[len("hf/"):]))
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        for name in os.listdir(tmp):
            with open(os.path.join(tmp, name), "rb+") as f:
                os.fsync(f.fileno())
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty, checked above
        os.rename(tmp, out_dir)
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _actor_weights(ckpt_dir: str, files: dict) -> dict[str, torch.Tensor]:
    """The actor's full weights: saved whole, or (LoRA) its adapters merged into the base model
    they were trained on (adapter_config.json's base_model_name_or_path, as peft records it)."""
    if f"actor/{ADAPTER_FILE}" not in files:
        return _load_model_file(ckpt_dir, f"actor/{MODEL_FILE}")
    config = _load_json(ckpt_dir, f"actor/{ADAPTER_CONFIG}")
    base_path = config.get("base_model_name_or_path")
    if not base_path or not os.path.isdir(base_path):
        raise CheckpointError(f"checkpoint {ckpt_dir} holds LoRA adapters; merging them needs their base model "
                              f"folder {base_path!r} (actor/{ADAPTER_CONFIG}: base_model_name_or_path), "
                              "which is not there")
    from transformers import AutoModelForCausalLM  # deferred: only merging LoRA adapters needs it (~2 s to import)

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype="auto").state_dict()
    _, adapters = lora.split_adapters(_load_model_file(ckpt_dir, f"actor/{ADAPTER_FILE}"))
    return lora.merge_adapters(base, adapters, lora.scaling(config["lora_alpha"], config["r"]))
