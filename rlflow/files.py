"""Small file helpers shared by the checkpoint code and the model cache."""

from __future__ import annotations

import hashlib
import os


def sha256_file(path: str | os.PathLike) -> str:
    """The sha256 hex digest of a file, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()
