"""Where checkpoints live and which one a path means: no torch or Ray, so the config check can
tell before Ray starts whether `trainer.resume_mode=<folder>` holds a checkpoint.

A run's checkpoints are ``<run_dir>/checkpoints/step_<N>/`` (controllers/checkpoint.py writes and
reads them), with a one-line ``latest`` file naming the newest committed one.
"""

from __future__ import annotations

import os
import re
import warnings

MANIFEST = "manifest.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the checkpoint and the file."""


def checkpoint_root(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """(step, folder name) of every committed checkpoint folder under `root`."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _STEP_DIR.match(name)
        if match and os.path.isdir(os.path.join(root, name)):
            found.append((int(match.group(1)), name))
    return sorted(found)


def find_latest(root: str) -> str | None:
    """The checkpoint `latest` names; without a usable pointer, the highest step_<N> folder."""
    pointer = os.path.join(root, LATEST)
    if os.path.isfile(pointer):
        with open(pointer, encoding="utf-8") as f:
            name = f.read().strip()
        if _STEP_DIR.match(name) and os.path.isdir(os.path.join(root, name)):
            return os.path.join(root, name)
        warnings.warn(f"{pointer} names {name!r}, which is not a checkpoint folder there; using the highest step_<N> folder", stacklevel=2)
    found = list_checkpoints(root)
    return os.path.join(root, found[-1][1]) if found else None


def resolve_checkpoint(path: str) -> str:
    """A step folder, or a checkpoints folder / run folder (-> its latest checkpoint)."""
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, MANIFEST)) or _STEP_DIR.match(os.path.basename(os.path.normpath(path))):
        return path
    for root in (path, checkpoint_root(path)):
        latest = find_latest(root)
        if latest is not None:
            return latest
    raise CheckpointError(f"{path} is not an rlflow checkpoint folder (no {MANIFEST}) and holds no checkpoints")
