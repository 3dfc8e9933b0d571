"""The batch that flows between the driver and the workers.

A batch is a `tensordict.TensorDict` (keys in docs/CONVENTIONS.md). The global normalisation
metadata of a mini-batch travels with each dp shard as one typed `BatchMeta` object stored as
non-tensor data: the driver computes it once from the whole mini-batch, the workers only read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict

META_KEY = "batch_meta"
# with a token budget, the micro-batch count the driver asks every dp rank to run (so FSDP's
# collectives line up), stored on each shard
MICRO_PLAN_KEY = "num_micro_batches"


@dataclass(frozen=True)
class BatchMeta:
    """What every micro-batch loss needs to be a slice of the whole mini-batch's loss."""

    dp_size: int  # data-parallel ranks receiving shards of this mini-batch
    batch_num_tokens: int  # valid response tokens in the whole mini-batch
    global_batch_size: int  # sequences with >= 1 valid response token in the whole mini-batch
    loss_scale_factor: float | None  # constant divisor of seq-mean-token-sum-norm

    def loss_kwargs(self) -> dict:
        """The four global keyword arguments every rlflow.algos loss takes."""
        return {
            "dp_size": self.dp_size,
            "batch_num_tokens": self.batch_num_tokens,
            "global_batch_size": self.global_batch_size,
            "loss_scale_factor": self.loss_scale_factor,
        }


def attach_meta(td: TensorDict, meta: BatchMeta) -> TensorDict:
    td.set_non_tensor(META_KEY, meta)
    return td


def get_meta(td: TensorDict) -> BatchMeta | None:
    if META_KEY not in td.keys():
        return None
    meta = td.get_non_tensor(META_KEY)
    if not isinstance(meta, BatchMeta):
        raise TypeError(f"{META_KEY!r} in the batch is a {type(meta).__name__}, expected BatchMeta")
    return meta


def compute_batch_meta(
    minibatch: TensorDict,
    dp_size: int,
    loss_scale_factor: float | None,
    mask_key: str = "response_mask",
) -> BatchMeta:
    """Driver side: the metadata of one whole mini-batch, before it is split."""
    mask = minibatch[mask_key]
    valid_per_row = (mask > 0).sum(dim=-1)
    return BatchMeta(
        dp_size=int(dp_size),
        batch_num_tokens=int(valid_per_row.sum().item()),
        global_batch_size=int((valid_per_row > 0).sum().item()),
        loss_scale_factor=None if loss_scale_factor is None else float(loss_scale_factor),
    )


def row_token_counts(td: TensorDict) -> torch.Tensor:
    """Tokens a row costs to run through a model: prompt + response when known."""
    key = "attention_mask" if "attention_mask" in td.keys() else "response_mask"
    return (td[key] > 0).sum(dim=-1)


# ---------------------------------------------------------------------------------------------
# Partitions. Each returns index tensors into the input rows; the parts are `td[idx]`.
# ---------------------------------------------------------------------------------------------


def balanced_equal_size_partition(weights: list[int], num_parts: int) -> list[list[int]]:
    """Split rows into `num_parts` parts of equal row count with balanced total weight.

    Greedy longest-first into the lightest part that still has room: every part has exactly
    len(weights) / num_parts rows, so dp ranks run the same number of micro-batches.
    """
    if len(weights) % num_parts:
        raise ValueError(f"{len(weights)} rows cannot be split into {num_parts} equal parts")
    capacity = len(weights) // num_parts
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    loads = [0] * num_parts
    for row in sorted(range(len(weights)), key=lambda r: (-weights[r], r)):
        open_parts = [p for p in range(num_parts) if len(parts[p]) < capacity]
        target = min(open_parts, key=lambda p: (loads[p], p))
        parts[target].append(row)
        loads[target] += weights[row]
    return [sorted(p) for p in parts]


def balanced_partition(weights: list[int], num_parts: int) -> list[list[int]]:
    """Split rows into exactly `num_parts` non-empty parts with balanced total weight (LPT)."""
    if not 1 <= num_parts <= len(weights):
        raise ValueError(f"cannot split {len(weights)} rows into {num_parts} non-empty parts")
    order = sorted(range(len(weights)), key=lambda r: (-weights[r], r))
    parts: list[list[int]] = [[r] for r in order[:num_parts]]
    loads = [weights[r] for r in order[:num_parts]]
    for row in order[num_parts:]:
        target = min(range(num_parts), key=lambda p: (loads[p], p))
        parts[target].append(row)
        loads[target] += weights[row]
    return [sorted(p) for p in parts]


def _first_fit_bins(weights: list[int], max_token_len: int) -> int:
    """How many bins first-fit decreasing needs (a row longer than the budget gets its own)."""
    if max_token_len <= 0:
        raise ValueError(f"max_token_len must be positive, got {max_token_len}")
    bins: list[int] = []
    for weight in sorted(weights, reverse=True):
        for i, load in enumerate(bins):
            if load + weight <= max_token_len:
                bins[i] += weight
                break
        else:
            bins.append(weight)
    return max(len(bins), 1)


def _within_budget(weights: list[int], count: int, max_token_len: int) -> bool:
    """Whether balanced_partition's `count` parts each hold at most the budget (or one row)."""
    parts = balanced_partition(weights, min(count, len(weights)))
    return all(len(part) == 1 or sum(weights[r] for r in part) <= max_token_len for part in parts)


def num_bins_for_token_budget(weights: list[int], max_token_len: int) -> int:
    """How many micro-batches a token budget needs: the fewest (from first-fit decreasing's count
    on) whose balanced partition keeps every micro-batch within the budget. A row longer than the
    budget gets a micro-batch of its own: it is never dropped."""
    count = _first_fit_bins(weights, max_token_len)
    while count < len(weights) and not _within_budget(weights, count, max_token_len):
        count += 1
    return count


def common_micro_batch_count(shard_weights: list[list[int]], max_token_len: int) -> int:
    """The micro-batch count every dp rank runs (FSDP's collectives line up) such that each
    rank's balanced partition of its shard stays within the budget."""
    count = max(num_bins_for_token_budget(weights, max_token_len) for weights in shard_weights)
    while not all(count >= len(weights) or _within_budget(weights, count, max_token_len) for weights in shard_weights):
        count += 1
    return count


def split_dp(td: TensorDict, dp_size: int, balance_by_tokens: bool = False) -> tuple[list[TensorDict], list[torch.Tensor]]:
    """Cut a mini-batch into `dp_size` shards of equal row count (balanced by tokens if asked)."""
    n_rows = td.batch_size[0]
    if n_rows % dp_size:
        raise ValueError(f"a mini-batch of {n_rows} rows cannot be split over dp_size={dp_size} ranks")
    if balance_by_tokens:
        groups = balanced_equal_size_partition(row_token_counts(td).tolist(), dp_size)
        indices = [torch.tensor(g, dtype=torch.long) for g in groups]
    else:
        indices = list(torch.arange(n_rows).chunk(dp_size))
    return [td[idx] for idx in indices], indices


def prompt_groups(td: TensorDict) -> torch.Tensor:
    """[B] index of each row's prompt among the distinct prompts of `td`, numbered in order of
    first appearance (0..B-1 when no prompt repeats)."""
    prompt_width = td["prompts"].shape[1]
    key = torch.cat([td["prompts"], td["attention_mask"][:, :prompt_width]], dim=1)
    if key.shape[0] == 0:
        return torch.zeros(0, dtype=torch.long, device=key.device)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    num_prompts = int(inverse.max()) + 1
    rows = torch.arange(key.shape[0], device=key.device)
    first_row = torch.full((num_prompts,), key.shape[0], device=key.device).scatter_reduce(0, inverse, rows, "amin")
    number = torch.empty_like(first_row)
    number[torch.argsort(first_row)] = torch.arange(num_prompts, device=key.device)
    return number[inverse]


def grouped_by_prompt(td: TensorDict) -> torch.Tensor:
    """Row order that puts the rows of each prompt next to each other, groups in order of first
    appearance, rows in their order within a group (the identity when no prompt repeats)."""
    return torch.argsort(prompt_groups(td), stable=True)


def plan_micro_batches(
    td: TensorDict,
    micro_batch_size: int | None = None,
    max_token_len: int | None = None,
    num_micro_batches: int | None = None,
    group_prompts: bool = False,
) -> list[torch.Tensor]:
    """Row indices of each micro-batch of a shard.

    Fixed size: consecutive chunks of `micro_batch_size`; with `group_prompts`, chunks of the rows
    in grouped_by_prompt order, so that a shared-prompt forward finds a prompt's rows together
    (which rows share a micro-batch changes no loss: each term divides by the mini-batch's
    counts). Token budget (dynamic batch size): the number of bins the budget needs, or
    `num_micro_batches` when the driver asks for more so that all dp ranks run the same count;
    rows are balanced by token count across those bins (`group_prompts` does not apply).
    """
    n_rows = td.batch_size[0]
    if max_token_len is None and num_micro_batches is None:
        if not micro_batch_size or micro_batch_size <= 0:
            raise ValueError("give micro_batch_size, or max_token_len for dynamic batch size")
        order = grouped_by_prompt(td) if group_prompts else torch.arange(n_rows)
        return list(order.split(micro_batch_size))
    weights = row_token_counts(td).tolist()
    count = num_bins_for_token_budget(weights, max_token_len) if max_token_len else 1
    if num_micro_batches is not None:
        count = max(count, num_micro_batches)
    count = min(count, n_rows)
    return [torch.tensor(g, dtype=torch.long) for g in balanced_partition(weights, count)]


def split_micro_batches(td: TensorDict, **plan_kwargs) -> tuple[list[TensorDict], list[torch.Tensor]]:
    indices = plan_micro_batches(td, **plan_kwargs)
    return [td[idx] for idx in indices], indices


def restore_order(parts: list[TensorDict], indices: list[torch.Tensor]) -> TensorDict:
    """Inverse of a split: put every row back at its original position."""
    merged = torch.cat(parts, dim=0)
    order = torch.cat(indices)
    if order.numel() != merged.batch_size[0] or torch.unique(order).numel() != order.numel():
        raise ValueError("indices do not form a permutation of the rows")
    return merged[torch.argsort(order)]


# ---------------------------------------------------------------------------------------------
# Padding helpers
# ---------------------------------------------------------------------------------------------


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    return torch.clamp(torch.cumsum(attention_mask.long(), dim=-1) - 1, min=0)


def pad_rows(td: TensorDict, multiple: int) -> TensorDict:
    """td with copies of its first row appended until its row count is a multiple of `multiple`
    (every dp rank gets rows); the caller drops what the extra rows produce."""
    pad = (-td.batch_size[0]) % multiple
    return td if pad == 0 else torch.cat([td, td[:1].expand(pad).clone()], dim=0)


def last_valid_index(response_mask: torch.Tensor) -> torch.Tensor:
    """[B, R] mask -> [B] index of each row's last 1 (-1 for a row without one). With mask holes
    (an agent's observations) this is not mask.sum() - 1."""
    positions = torch.arange(response_mask.shape[1], device=response_mask.device)
    return torch.where(response_mask.bool(), positions, torch.full_like(positions, -1)).amax(dim=1)


def concat_rollouts(batches: list[TensorDict], pad_token_id: int) -> TensorDict:
    """Rollout batches of different prompt widths (each left-padded to its longest prompt) as one
    batch: prompts re-padded on the left to the widest, responses unchanged (their width is
    max_response_length in every batch). Per-row keys other than the token layout are concatenated."""
    width = max(b["prompts"].shape[1] for b in batches)
    padded = []
    for batch in batches:
        extra = width - batch["prompts"].shape[1]
        if extra:
            batch = batch.clone()
            rows = batch.batch_size[0]
            pad = batch["prompts"].new_full((rows, extra), int(pad_token_id))
            zeros = batch["attention_mask"].new_zeros((rows, extra))
            batch["prompts"] = torch.cat([pad, batch["prompts"]], dim=1)
            batch["input_ids"] = torch.cat([pad, batch["input_ids"]], dim=1)
            batch["attention_mask"] = torch.cat([zeros, batch["attention_mask"]], dim=1)
            # what position_ids_from_mask gives a left pad
            batch["position_ids"] = torch.cat([zeros.to(batch["position_ids"].dtype), batch["position_ids"]], dim=1)
        padded.append(batch)
    return torch.cat(padded, dim=0)


def left_pad(sequences: list[list[int]], pad_token_id: int, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    width = length if length is not None else max((len(s) for s in sequences), default=0)
    ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        if seq:
            ids[row, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
            mask[row, width - len(seq):] = 1
    return ids, mask


def right_pad(sequences: list[list[int]], pad_token_id: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((len(sequences), length), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, seq in enumerate(sequences):
        seq = seq[:length]
        if seq:
            ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask[row, : len(seq)] = 1
    return ids, mask


def trim_response(token_ids: list[int], eos_token_id: int, max_response_length: int) -> list[int]:
    """The response-mask rule, one for every engine: a response is the generated tokens up to and
    including the first EOS, at most max_response_length of them; everything after is padding."""
    if eos_token_id in token_ids:
        token_ids = token_ids[: token_ids.index(eos_token_id) + 1]
    return list(token_ids[:max_response_length])


def assemble_rollout(prompts: torch.Tensor, prompt_mask: torch.Tensor, response_ids: list[list[int]], n: int,
                     max_response_length: int, pad_token_id: int, eos_token_id: int,
                     log_probs: list[list[float]] | None = None) -> TensorDict:
    """The rollout batch (keys in docs/CONVENTIONS.md) of B*n rows, repeat_interleave order (row r
    answers prompt r // n), from left-padded prompts [B, P] and each row's generated token ids.

    `response_mask` is 1 on the tokens `trim_response` keeps. With `log_probs` (the engine's
    log-prob of each generated token) the batch carries `rollout_log_probs`, 0 outside the mask.
    """
    if len(response_ids) != prompts.shape[0] * n:
        raise ValueError(f"{len(response_ids)} responses for {prompts.shape[0]} prompts x n={n}")
    kept = [trim_response(ids, eos_token_id, max_response_length) for ids in response_ids]
    responses, response_mask = right_pad(kept, pad_token_id, max_response_length)
    prompts = prompts.repeat_interleave(n, dim=0)
    attention_mask = torch.cat([prompt_mask.repeat_interleave(n, dim=0).long(), response_mask], dim=1)
    out = {
        "prompts": prompts,
        "responses": responses,
        "response_mask": response_mask,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids_from_mask(attention_mask),
    }
    if log_probs is not None:
        if len(log_probs) != len(kept):
            raise ValueError(f"{len(log_probs)} log-prob rows for {len(kept)} responses")
        padded = torch.zeros(responses.shape, dtype=torch.float32)
        for row, (values, ids) in enumerate(zip(log_probs, kept)):
            if len(values) < len(ids):
                raise ValueError(f"row {row}: {len(values)} log-probs for {len(ids)} response tokens")
            if ids:
                padded[row, : len(ids)] = torch.tensor(values[: len(ids)], dtype=torch.float32)
        out["rollout_log_probs"] = padded
    return TensorDict(out, batch_size=[prompts.shape[0]])
