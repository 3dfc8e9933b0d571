"""How the advantage estimators treat mask holes (an agent's observation tokens): a hole is not a
step of the policy. For every registered estimator, a batch with holes gives, on its model tokens,
exactly the advantages and returns of the same batch with the holes cut out, and 0 on the holes."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlflow.algos import ADV_ESTIMATORS, get_adv_estimator_fn

D = torch.float64


def _compact(tensor: torch.Tensor, mask: torch.Tensor, width: int) -> torch.Tensor:
    """Each row's valid entries, left-aligned, zero-padded to width."""
    out = torch.zeros(tensor.shape[0], width, dtype=tensor.dtype)
    for row in range(tensor.shape[0]):
        valid = tensor[row][mask[row].bool()]
        out[row, : len(valid)] = valid
    return out


@st.composite
def holey_batches(draw):
    """Rows of model turns separated by observation holes, rewards on each turn's last token,
    garbage (large values) on the holes that must not leak."""
    num_rows = draw(st.sampled_from([4, 6]))
    width = 12
    mask = torch.zeros(num_rows, width, dtype=D)
    rewards = torch.zeros(num_rows, width, dtype=D)
    for row in range(num_rows):
        position = 0
        for _turn in range(draw(st.integers(1, 3))):
            turn = draw(st.integers(1, 3))
            hole = draw(st.integers(0, 3))
            if position + turn > width:
                break
            mask[row, position : position + turn] = 1
            rewards[row, position + turn - 1] = draw(st.sampled_from([0.0, 1.0, -0.5]))
            rewards[row, position + turn : min(position + turn + hole, width)] = 99.0  # on the hole: ignored
            position += turn + hole
    values = torch.rand(num_rows, width, dtype=D, generator=torch.Generator().manual_seed(draw(st.integers(0, 99))))
    values = torch.where(mask.bool(), values, torch.full_like(values, -42.0))
    return mask, rewards, values


@settings(max_examples=40, deadline=None)
@given(holey_batches())
def test_every_estimator_skips_holes(batch):
    mask, rewards, values = batch
    width = mask.shape[1]
    index = torch.arange(mask.shape[0]) // 2  # groups of two
    baselines = torch.linspace(-0.3, 0.3, mask.shape[0], dtype=D)
    compact_mask = _compact(mask, mask, width)
    for name in ADV_ESTIMATORS:
        fn = get_adv_estimator_fn(name)
        common = dict(gamma=0.9, lam=0.8, index=index, norm_adv_by_std_in_grpo=True, reward_baselines=baselines)
        holey = fn(token_level_rewards=rewards, response_mask=mask, values=values, **common)
        compact = fn(token_level_rewards=_compact(rewards, mask, width), response_mask=compact_mask,
                     values=_compact(values, mask, width), **common)
        for got, want in zip(holey, compact):
            assert torch.all(got[~mask.bool()] == 0), f"{name}: a hole got an advantage or return"
            assert torch.allclose(_compact(got, mask, width), want, atol=1e-12), name
