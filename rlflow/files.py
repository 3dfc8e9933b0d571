"""Small file helpers shared by the checkpoint code and the model cache."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path


def sha256_file(path: str | os.PathLike) -> str:
    """The sha256 hex digest of a file, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def building_dir(final: Path, is_complete: Callable[[Path], bool]) -> Iterator[Path]:
    """A new temporary folder beside ``final`` to build a cache entry in. When the block ends
    without an error it is renamed to ``final`` (readers never see a half-written entry); where
    another process finished the same entry first and ``is_complete(final)``, theirs is kept. The
    temporary folder is removed whatever happens."""
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        yield tmp
        try:
            os.rename(tmp, final)
        except OSError:
            if not is_complete(final):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
