"""workers/wire.py: tensors through Ray's pickling arrive bit-identical, owned and writable."""

from __future__ import annotations

import pickle

import pytest
import torch
from ray import cloudpickle
from tensordict import TensorDict

from rlflow.protocol import BatchMeta, attach_meta, get_meta
from workers import wire


@pytest.fixture()
def installed():
    before = cloudpickle.CloudPickler.dispatch.get(torch.Tensor)
    wire.install()
    yield
    if before is None:
        cloudpickle.CloudPickler.dispatch.pop(torch.Tensor, None)
    else:
        cloudpickle.CloudPickler.dispatch[torch.Tensor] = before


def _round_trip(obj):
    return cloudpickle.loads(cloudpickle.dumps(obj, protocol=5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                                   torch.int32, torch.int8, torch.uint8, torch.bool, torch.complex64])
def test_plain_tensors_bit_identical(installed, dtype):
    t = (torch.randn(5, 7) * 100).to(dtype)
    assert not isinstance(wire.to_wire(t), wire._TorchPickled)
    out = _round_trip(t)
    assert out.dtype == dtype and out.shape == t.shape and out.stride() == t.stride()
    assert torch.equal(out.view(torch.uint8) if dtype != torch.bool else out, t.view(torch.uint8) if dtype != torch.bool else t)
    out.add_(1) if dtype != torch.bool else out.logical_not_()  # writable, owned by the receiver
    assert not torch.equal(out, t)


def test_scalar_and_empty(installed):
    for t in (torch.tensor(3.5), torch.zeros(0, 4, dtype=torch.long)):
        out = _round_trip(t)
        assert out.shape == t.shape and torch.equal(out, t)


def test_other_tensors_take_torchs_path(installed):
    base = torch.randn(4, 6)
    cases = [base.t(), base[:, ::2], torch.randn(3, requires_grad=True), torch.randn(3, dtype=torch.complex64).conj(),
             torch.nn.Parameter(torch.randn(2))]
    for t in cases:
        if type(t) is torch.Tensor:
            assert isinstance(wire.to_wire(t), wire._TorchPickled)
        out = _round_trip(t)
        assert type(out) is type(t) and out.stride() == t.stride() and out.requires_grad == t.requires_grad
        assert torch.equal(out.detach().resolve_conj(), t.detach().resolve_conj())
    tagged = torch.ones(2)
    tagged.note = "kept"
    assert _round_trip(tagged).note == "kept"


def test_tensordict_with_meta(installed):
    td = TensorDict({"a": torch.arange(12).view(4, 3), "b": torch.randn(4, 2).to(torch.bfloat16)}, batch_size=[4])
    attach_meta(td, BatchMeta(dp_size=2, batch_num_tokens=7, global_batch_size=4, loss_scale_factor=8.0))
    out = _round_trip([td[:2], td[2:]])
    assert torch.equal(torch.cat(out)["a"], td["a"]) and torch.equal(torch.cat(out)["b"], td["b"])
    assert get_meta(out[0]) == get_meta(td)


def test_state_dict_plain_pickle_unaffected(installed):
    # only Ray's cloudpickle is affected: torch.save / std pickle keep torch's format
    sd = {"w": torch.randn(3, 3)}
    assert torch.equal(pickle.loads(pickle.dumps(sd))["w"], sd["w"])


def test_arrives_in_torch_allocated_memory(installed):
    # 64-byte aligned like torch's own storages, so kernels round the same way as before
    for n in (7, 3072, 100_000):
        assert all(_round_trip(torch.ones(n)).data_ptr() % 64 == 0 for _ in range(10))
