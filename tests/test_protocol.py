"""The batch protocol: BatchMeta travels intact, splits keep every row exactly once and restore order."""

from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from rlflow.protocol import (
    BatchMeta,
    attach_meta,
    balanced_equal_size_partition,
    compute_batch_meta,
    get_meta,
    num_bins_for_token_budget,
    assemble_rollout,
    trim_response,
    restore_order,
    row_token_counts,
    split_dp,
    split_micro_batches,
)


def make_batch(lengths: list[int], width: int = 12, prompt_width: int = 3) -> TensorDict:
    rows = len(lengths)
    response_mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    prompt_mask = torch.ones(rows, prompt_width, dtype=torch.long)
    return TensorDict(
        {
            "row_id": torch.arange(rows),
            "responses": torch.randint(2, 50, (rows, width)),
            "response_mask": response_mask,
            "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
        },
        batch_size=[rows],
    )


lengths_strategy = st.lists(st.integers(min_value=0, max_value=12), min_size=1, max_size=24)


def test_compute_batch_meta_counts_valid_tokens_and_sequences():
    batch = make_batch([3, 0, 5, 1])
    meta = compute_batch_meta(batch, dp_size=2, loss_scale_factor=12)
    assert meta == BatchMeta(dp_size=2, batch_num_tokens=9, global_batch_size=3, loss_scale_factor=12.0)


def test_meta_survives_indexing_split_cat_and_pickle():
    batch = attach_meta(make_batch([3, 1, 2, 4]), BatchMeta(2, 10, 4, 8.0))
    for view in (batch[1:3], batch[torch.tensor([3, 0])], torch.cat(batch.split(2)), pickle.loads(pickle.dumps(batch))):
        assert get_meta(view) == BatchMeta(2, 10, 4, 8.0)
    assert get_meta(make_batch([1])) is None


def test_meta_survives_a_ray_round_trip(ray_session):
    batch = attach_meta(make_batch([3, 1]), BatchMeta(1, 4, 2, None))
    back = ray_session.get(ray_session.put(batch))
    assert get_meta(back) == BatchMeta(1, 4, 2, None)
    assert torch.equal(back["responses"], batch["responses"])


@settings(max_examples=60, deadline=None)
@given(lengths=lengths_strategy, dp=st.integers(1, 4), balance=st.booleans())
def test_split_dp_keeps_every_row_once_and_restores_order(lengths, dp, balance):
    lengths = lengths[: len(lengths) - len(lengths) % dp] or [1] * dp
    batch = make_batch(lengths)
    shards, indices = split_dp(batch, dp, balance_by_tokens=balance)
    assert len(shards) == dp and len({s.batch_size[0] for s in shards}) == 1  # equal row counts
    assert sorted(torch.cat([s["row_id"] for s in shards]).tolist()) == list(range(len(lengths)))
    assert torch.equal(restore_order(shards, indices)["row_id"], batch["row_id"])


@settings(max_examples=80, deadline=None)
@given(lengths=lengths_strategy, budget=st.integers(1, 40), forced=st.one_of(st.none(), st.integers(1, 30)))
def test_token_budget_micro_batches_keep_every_row_and_respect_the_budget(lengths, budget, forced):
    batch = make_batch(lengths)
    micros, indices = split_micro_batches(batch, max_token_len=budget, num_micro_batches=forced)
    assert all(m.batch_size[0] >= 1 for m in micros)
    assert sorted(torch.cat([m["row_id"] for m in micros]).tolist()) == list(range(len(lengths)))
    assert torch.equal(restore_order(micros, indices)["row_id"], batch["row_id"])
    if forced is None:
        # a row over the budget sits alone; otherwise first-fit-decreasing bins respect it
        needed = num_bins_for_token_budget(row_token_counts(batch).tolist(), budget)
        assert len(micros) == min(needed, len(lengths))
    else:
        assert len(micros) == min(max(forced, num_bins_for_token_budget(row_token_counts(batch).tolist(), budget)), len(lengths))


def test_overlong_row_gets_its_own_micro_batch_and_is_never_dropped():
    batch = make_batch([12, 1, 1, 1])  # 15 tokens with the prompt, budget 6
    micros, _ = split_micro_batches(batch, max_token_len=6)
    sizes = sorted(m.batch_size[0] for m in micros)
    assert sum(sizes) == 4
    alone = [m for m in micros if 12 in m["response_mask"].sum(-1).tolist()]
    assert alone and alone[0].batch_size[0] == 1


def test_fixed_micro_batches_are_consecutive_chunks():
    micros, indices = split_micro_batches(make_batch([1] * 10), micro_batch_size=4)
    assert [m.batch_size[0] for m in micros] == [4, 4, 2]
    assert torch.equal(torch.cat(indices), torch.arange(10))


def test_balanced_partition_balances_tokens():
    parts = balanced_equal_size_partition([10, 9, 1, 1, 5, 5], 2)
    loads = [sum([10, 9, 1, 1, 5, 5][i] for i in p) for p in parts]
    assert all(len(p) == 3 for p in parts) and abs(loads[0] - loads[1]) <= 2


def test_impossible_splits_name_the_numbers():
    with pytest.raises(ValueError, match="5 rows.*dp_size=2"):
        split_dp(make_batch([1] * 5), 2)
    with pytest.raises(ValueError, match="permutation"):
        restore_order([make_batch([1, 1])], [torch.tensor([0, 0])])


def test_one_response_mask_rule_for_every_engine():
    """Up to and including the first EOS (0 here), at most max_response_length tokens; a generated
    pad token (1) before the EOS is a real token; rows come out in repeat_interleave order."""
    prompts, prompt_mask = torch.tensor([[1, 9], [8, 9]]), torch.tensor([[0, 1], [1, 1]])
    generated = [[5, 6, 0, 7, 0], [5, 5, 5, 5, 5, 5], [0, 3], [1, 4, 0]]
    log_probs = [[-0.5, -0.6, -0.1, -9.0, -9.0], [-1.0] * 6, [-0.2, -9.0], [-0.3, -0.4, -0.7]]
    batch = assemble_rollout(prompts, prompt_mask, generated, n=2, max_response_length=5, pad_token_id=1,
                             eos_token_id=0, log_probs=log_probs)
    assert batch["response_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0]]
    assert batch["responses"].tolist() == [[5, 6, 0, 1, 1], [5, 5, 5, 5, 5], [0, 1, 1, 1, 1], [1, 4, 0, 1, 1]]
    assert batch["prompts"].tolist() == [[1, 9], [1, 9], [8, 9], [8, 9]]
    assert batch["attention_mask"].tolist()[0] == [0, 1, 1, 1, 1, 0, 0]
    assert batch["position_ids"].tolist()[0] == [0, 0, 1, 2, 3, 3, 3]
    assert torch.allclose(batch["rollout_log_probs"], torch.tensor(
        [[-0.5, -0.6, -0.1, 0, 0], [-1.0] * 5, [-0.2, 0, 0, 0, 0], [-0.3, -0.4, -0.7, 0, 0]]))
    assert [trim_response(ids, 0, 5) for ids in generated] == [[5, 6, 0], [5] * 5, [0], [1, 4, 0]]
    with pytest.raises(ValueError, match="2 log-probs for 3 response tokens"):
        assemble_rollout(prompts, prompt_mask, generated, 2, 5, 1, 0, [[0.0, 0.0]] + log_probs[1:])