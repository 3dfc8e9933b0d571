"""The shared-memory file of the actor -> rollout weight sync (workers/weight_share.py)."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from workers import weight_share
from workers.weight_share import MappedWeights, create_share, layout_of, new_share_path

pytestmark = pytest.mark.skipif(new_share_path() is None, reason="no writable /dev/shm")


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(7, 5, generator=gen),  # 140 bytes: the next entry must be re-aligned
        "norm.weight": torch.randn(3, generator=gen).to(torch.bfloat16),
        "head.bias": torch.randn(11, generator=gen).to(torch.float16),
        "steps": torch.tensor([3, 1, 4], dtype=torch.int64),
        "scalar": torch.tensor(2.5),
    }


@pytest.fixture
def layout():
    layout = layout_of(_state(), new_share_path())
    create_share(layout)
    yield layout
    if os.path.exists(layout.path):
        os.unlink(layout.path)


def test_layout_aligns_every_entry_and_covers_the_file(layout):
    assert [e.name for e in layout.entries] == list(_state())
    for entry in layout.entries:
        assert entry.offset % 64 == 0
    last = layout.entries[-1]
    assert layout.total_bytes >= last.offset + last.nbytes
    assert os.path.getsize(layout.path) == layout.total_bytes


def test_a_second_mapping_reads_what_the_first_wrote(layout):
    writer, reader = MappedWeights(layout), MappedWeights(layout)
    state = _state()
    writer.write(state)
    for name, tensor in state.items():
        assert reader.views[name].dtype == tensor.dtype and torch.equal(reader.views[name], tensor), name
    # a later write is seen through the same mapping: no re-open per sync
    state["embed.weight"] = state["embed.weight"] * 2
    writer.write(state)
    assert torch.equal(reader.views["embed.weight"], state["embed.weight"])


def test_the_mapping_outlives_the_name(layout):
    """The controller unlinks the file once every worker mapped it: the memory stays shared."""
    writer, reader = MappedWeights(layout), MappedWeights(layout)
    os.unlink(layout.path)
    state = _state()
    writer.write(state)
    assert torch.equal(reader.views["steps"], state["steps"])


def test_a_changed_state_dict_is_refused_naming_the_entry(layout):
    writer = MappedWeights(layout)
    state = _state()
    with pytest.raises(ValueError, match="missing.*'steps'"):
        writer.write({k: v for k, v in state.items() if k != "steps"})
    state["embed.weight"] = torch.zeros(7, 6)
    with pytest.raises(ValueError, match=r"embed.weight is \(7, 6\)"):
        writer.write(state)


def test_no_space_is_an_error_at_creation_and_leaves_no_file(monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(weight_share.os, "posix_fallocate", full)
    layout = layout_of(_state(), new_share_path())
    with pytest.raises(OSError, match="No space"):
        create_share(layout)
    assert not os.path.exists(layout.path)
