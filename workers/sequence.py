"""Packed micro-batches (padding removed) and Ulysses sequence parallelism.

Packing (`<role>.use_remove_padding`): the valid tokens of a micro-batch's rows are concatenated
into one row; position ids restart per sequence (each row keeps its own), and attention runs per
sequence through `cu_seq_lens` (the boundaries of the sequences in the packed row), so it never
crosses a sequence boundary. The attention is `varlen_attention`, registered with transformers'
attention interface under ATTENTION_NAME: the model code is transformers' own. It runs flash-attn's
varlen kernel where flash-attn is installed (CUDA, half precision), else torch's causal sdpa over
the sequences right-padded to the longest inside the attention (`_sdpa_per_sequence`), never with a
mask of the row's length squared.

Sequence parallelism (`<role>.sp_size` > 1): the packed row is cut into sp equal slices (padded to
a multiple of sp); each rank of an sp group runs embeddings, MLPs and norms on its slice, and
attention exchanges heads for tokens with an all-to-all (every rank then holds the whole sequence
for its share of the heads), attends, and exchanges back. After the forward each rank holds the
outputs (log-prob, entropy, value) of the response tokens its slice predicts; one all-reduce over
the sp group puts every output at its [B, R] place on every rank of the group (`gather_outputs`).
So every rank of the group computes the same loss over the whole micro-batch, normalised by the
driver's BatchMeta as at sp=1; the all-reduce's backward sums the sp copies of each output's
gradient, which the data-parallel mean over dp x sp ranks then divides by sp again: the gradient
is the whole mini-batch's, whatever dp and sp are.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tensordict import TensorDict

ATTENTION_NAME = "rlflow_varlen"


# ----------------------------------------------------------------------------- the sp group


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's sequence-parallel group: `size` consecutive ranks of the role's process group."""

    group: object  # a torch.distributed ProcessGroup, None at size 1
    rank: int
    size: int


NO_SEQUENCE_PARALLEL = SequenceParallel(None, 0, 1)


def sequence_parallel_groups(rank: int, world_size: int, sp_size: int) -> SequenceParallel:
    """Every rank calls this after init_process_group (new_group is a collective over the world):
    ranks [g*sp, (g+1)*sp) form sp group g, the dp rank is g."""
    if sp_size == 1:
        return NO_SEQUENCE_PARALLEL
    if world_size % sp_size:
        raise ValueError(f"{world_size} ranks cannot form sequence-parallel groups of {sp_size}")
    mine = None
    for first in range(0, world_size, sp_size):
        group = dist.new_group(list(range(first, first + sp_size)))
        if first <= rank < first + sp_size:
            mine = group
    return SequenceParallel(mine, rank % sp_size, sp_size)


class _AllToAll(torch.autograd.Function):
    """A flat tensor exchanged in pieces of given sizes; the backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, flat: torch.Tensor, receive_sizes: list[int], send_sizes: list[int], group) -> torch.Tensor:
        ctx.sizes, ctx.group = (receive_sizes, send_sizes), group
        out = flat.new_empty(sum(receive_sizes))
        dist.all_to_all_single(out, flat.contiguous(), receive_sizes, send_sizes, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        receive_sizes, send_sizes = ctx.sizes
        out = grad.new_empty(sum(send_sizes))
        dist.all_to_all_single(out, grad.contiguous(), send_sizes, receive_sizes, group=ctx.group)
        return out, None, None, None


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) whose backward all-reduces the gradient too: every rank's loss reads the
    sum, so each input's gradient is the sum of what every rank's loss asks of it."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def head_split(num_heads: int, sp_size: int) -> list[int]:
    """Heads per sp rank: as equal as possible, the first ranks take one more."""
    return [num_heads // sp_size + (rank < num_heads % sp_size) for rank in range(sp_size)]


def _heads_to_sequence(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """[1, H, L/sp, D] (all heads, this rank's tokens) -> [1, H_rank, L, D] (this rank's heads, all
    tokens, in rank order)."""
    _, heads, local_len, dim = x.shape
    split = head_split(heads, sp.size)
    pieces = x[0].split(split, dim=0)  # rank j gets my tokens of its heads
    send = torch.cat([piece.reshape(-1) for piece in pieces])
    mine = split[sp.rank]
    received = _AllToAll.apply(send, [mine * local_len * dim] * sp.size, [p.numel() for p in pieces], sp.group)
    # from every rank i: its tokens of my heads, [mine, local_len, dim]
    return received.view(sp.size, mine, local_len, dim).permute(1, 0, 2, 3).reshape(1, mine, sp.size * local_len, dim)


def _sequence_to_heads(x: torch.Tensor, heads: int, sp: SequenceParallel) -> torch.Tensor:
    """The inverse of _heads_to_sequence: [1, H_rank, L, D] -> [1, H, L/sp, D]."""
    _, mine, length, dim = x.shape
    local_len = length // sp.size
    split = head_split(heads, sp.size)
    send = x[0].view(mine, sp.size, local_len, dim).permute(1, 0, 2, 3).reshape(-1)  # rank i gets its tokens
    received = _AllToAll.apply(send, [n * local_len * dim for n in split], [mine * local_len * dim] * sp.size, sp.group)
    pieces = received.split([n * local_len * dim for n in split])
    return torch.cat([piece.view(n, local_len, dim) for piece, n in zip(pieces, split)]).unsqueeze(0)


def _repeat_heads(x: torch.Tensor, times: int) -> torch.Tensor:
    return x if times == 1 else x.repeat_interleave(times, dim=1)


# ------------------------------------------------------------------------ the attention function


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal attention within each packed sequence ([1, heads, L, D] inputs; `cu_seq_lens_q` the
    sequences' boundaries in the whole packed row). Under sequence parallelism (`sequence_parallel`,
    a SequenceParallel of size > 1) the inputs hold this rank's slice of the row, and heads are
    exchanged for tokens around the attention. Returns [1, L, heads, D] as transformers expects."""
    boundaries = kwargs.get("cu_seq_lens_q")
    if boundaries is None or attention_mask is not None:
        raise ValueError(f"attention {ATTENTION_NAME!r} runs packed micro-batches only (cu_seq_lens, no mask)")
    sp = kwargs.get("sequence_parallel") or NO_SEQUENCE_PARALLEL
    heads, kv_heads = query.shape[1], key.shape[1]
    if sp.size > 1:
        if kv_heads % sp.size:  # the key/value heads cannot be split like the query heads: repeat them
            key, value = _repeat_heads(key, heads // kv_heads), _repeat_heads(value, heads // kv_heads)
        query, key, value = (_heads_to_sequence(t, sp) for t in (query, key, value))
    flash = _flash_varlen()
    if flash is not None and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16):
        max_length = int(kwargs.get("max_length_q") or (boundaries[1:] - boundaries[:-1]).max())
        # flash-attn's varlen kernel: [tokens, heads, dim], grouped-query heads as they are
        out = flash(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), boundaries,
                    boundaries, max_length, max_length, softmax_scale=scaling, causal=True)
        out = out.transpose(0, 1).unsqueeze(0)
    else:
        out = _sdpa_per_sequence(query, key, value, boundaries, scaling)
    if sp.size > 1:
        out = _sequence_to_heads(out, heads, sp)
    return out.transpose(1, 2).contiguous(), None


def _sdpa_per_sequence(query, key, value, boundaries: torch.Tensor, scaling) -> torch.Tensor:
    """Causal sdpa within each packed sequence: one batched call over the sequences right-padded to
    the longest (a query sees only its own sequence's earlier tokens, never the padding after them)
    while that padding stays under the packed tokens themselves; else one call per sequence, whose
    cost is the unpadded sequences' and needs no mask of the whole row's length squared."""
    key = _repeat_heads(key, query.shape[1] // key.shape[1])
    value = _repeat_heads(value, query.shape[1] // value.shape[1])
    lengths = boundaries[1:] - boundaries[:-1]
    num_sequences, longest, total = lengths.numel(), int(lengths.max()), int(boundaries[-1])
    if num_sequences > 1 and num_sequences * longest <= 2 * total:
        return _sdpa_right_padded(query, key, value, boundaries, lengths, longest, scaling)
    # split, not slices: the backward of a slice fills a zero gradient of the whole row per sequence
    sizes = lengths.tolist()
    outputs = [torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling)
               for q, k, v in zip(query.split(sizes, dim=2), key.split(sizes, dim=2), value.split(sizes, dim=2))
               if q.shape[2]]
    return torch.cat(outputs, dim=2)


def _sdpa_right_padded(query, key, value, boundaries: torch.Tensor, lengths: torch.Tensor, longest: int,
                       scaling) -> torch.Tensor:
    """[1, H, L, D] packed -> each sequence in a row of [S, H, longest, D] -> one causal sdpa -> back."""
    lengths = lengths.long()
    sequence = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
    offset = torch.arange(sequence.numel(), device=lengths.device) - boundaries[:-1].long()[sequence]
    slot = sequence * longest + offset  # each packed token's place in the padded layout
    heads, dim = query.shape[1], query.shape[3]

    def padded(x: torch.Tensor) -> torch.Tensor:
        rows = x.new_zeros(lengths.numel() * longest, heads, dim).index_copy(0, slot, x[0].transpose(0, 1))
        return rows.view(lengths.numel(), longest, heads, dim).transpose(1, 2)

    out = torch.nn.functional.scaled_dot_product_attention(padded(query), padded(key), padded(value),
                                                           is_causal=True, scale=scaling)
    out = out.transpose(1, 2).reshape(-1, heads, dim).index_select(0, slot)
    return out.transpose(0, 1).unsqueeze(0)


@functools.cache
def _flash_varlen():
    """flash-attn's flash_attn_varlen_func where the package is installed (CUDA), else None."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def _no_mask(*args, **kwargs):
    """The packed forward needs no mask: varlen_attention reads the sequence boundaries."""
    return None


def register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, varlen_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)


def use_packed_attention(model: torch.nn.Module) -> None:
    """Switch a transformers model (and its sub-configs) to the packed attention."""
    register_attention()
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = ATTENTION_NAME


# ------------------------------------------------------------------------------ the packed row


@dataclass
class PackedRow:
    """One micro-batch as a packed row, and where its outputs go back in [B, R]."""

    input_ids: torch.Tensor  # [1, L/sp] this rank's slice of the packed row
    position_ids: torch.Tensor  # [1, L/sp]
    boundaries: torch.Tensor  # [S + 1] int32: each sequence's start in the whole row, then the row's length
    max_length: int
    keep: torch.Tensor  # [K] columns of this rank's slice that predict a response token
    rows: torch.Tensor  # [K] the predicted token's row ...
    columns: torch.Tensor  # [K] ... and response column
    packed_length: int  # L, padding for sp included
    padding: int  # tokens of that padding


def pack_micro_batch(td: TensorDict, sp: SequenceParallel = NO_SEQUENCE_PARALLEL) -> PackedRow:
    """The valid tokens (attention_mask) of every row, concatenated row after row. Response token
    j of a row is predicted by the row's token before it, the packed row's previous column."""
    prompt_width = td["prompts"].shape[1]
    response_valid = td["attention_mask"][:, prompt_width:].bool()
    columns_used = response_valid.any(dim=0).nonzero()
    kept = int(columns_used[-1]) + 1 if columns_used.numel() else 0
    valid = td["attention_mask"][:, : prompt_width + kept].bool()
    lengths = valid.sum(dim=1)
    ids = td["input_ids"][:, : prompt_width + kept][valid]
    positions = td["position_ids"][:, : prompt_width + kept][valid]
    flat_index = (torch.cumsum(valid.reshape(-1).long(), 0) - 1).view(valid.shape)
    rows, columns = valid[:, prompt_width:].nonzero(as_tuple=True)
    predictor = flat_index[rows, prompt_width + columns] - 1  # a row's first token is a prompt token
    total = int(ids.numel())
    padding = (-total) % sp.size
    bounds = [0] + torch.cumsum(lengths[lengths > 0], 0).tolist()
    if padding:  # a sequence of its own, attended to by nothing else and predicting nothing
        ids = torch.cat([ids, ids.new_zeros(padding)])
        positions = torch.cat([positions, positions.new_zeros(padding)])
        bounds.append(total + padding)
    length = total + padding
    local = length // sp.size
    start = sp.rank * local
    here = (predictor >= start) & (predictor < start + local)
    boundaries = torch.tensor(bounds, dtype=torch.int32, device=ids.device)
    return PackedRow(
        input_ids=ids[start : start + local].unsqueeze(0),
        position_ids=positions[start : start + local].unsqueeze(0),
        boundaries=boundaries,
        max_length=int((boundaries[1:] - boundaries[:-1]).max()) if len(bounds) > 1 else 0,
        keep=predictor[here] - start,
        rows=rows[here],
        columns=columns[here],
        packed_length=length,
        padding=padding,
    )


def packed_forward(model: torch.nn.Module, packed: PackedRow, sp: SequenceParallel, takes_logits_to_keep: bool):
    """The model's output at the columns that predict response tokens, [K, ...]."""
    extra = {"logits_to_keep": packed.keep} if takes_logits_to_keep else {}
    output = model(
        input_ids=packed.input_ids,
        position_ids=packed.position_ids,
        use_cache=False,
        cu_seq_lens_q=packed.boundaries,
        cu_seq_lens_k=packed.boundaries,
        max_length_q=packed.max_length,
        max_length_k=packed.max_length,
        sequence_parallel=sp,
        **extra,
    )
    logits = output.logits[0]
    return logits if takes_logits_to_keep else logits[packed.keep]


def gather_outputs(values: torch.Tensor, packed: PackedRow, shape: tuple[int, int], sp: SequenceParallel) -> torch.Tensor:
    """[K] per-token outputs of this rank -> [B, R] on every rank of the sp group (0 elsewhere)."""
    out = values.new_zeros(shape)
    out = out.index_put((packed.rows, packed.columns), values)
    if sp.size > 1:
        out = _SumOverGroup.apply(out, sp.group)
    return out


@dataclass(frozen=True)
class SequenceLayout:
    """How a role's forwards lay out a micro-batch: padded [B, T] (the default), or packed, split
    over an sp group when `sp.size` > 1 (sp > 1 always packs)."""

    packs: bool = False
    sp: SequenceParallel = NO_SEQUENCE_PARALLEL

    def gather(self, values: torch.Tensor, packed: PackedRow, shape: tuple[int, int]) -> torch.Tensor:
        return gather_outputs(values, packed, shape, self.sp)


PADDED = SequenceLayout()
