"""Model forward passes over a (micro-)batch: response log-probs, entropy and values.

Columns that are padding in every row of the micro-batch are cut off before the forward (the
prompt's left padding, the responses' right padding), so a token-budget micro-batch of short
rows costs little; results are padded back to the full response width with zeros. A model whose
forward takes `logits_to_keep` (a causal LM) computes its head only on the columns that predict
response tokens: the prompt's outputs are never used.

With `share_prompt` (<role>.model.share_prompt_forward), rows of a micro-batch with the same
prompt (a prompt's rollout.n responses) run as one sequence: the prompt once, then each row's
response, with an attention mask that lets every response see the prompt and itself only and
position ids that continue the prompt's for each of them. Every response token sees exactly the
keys and positions of the plain forward, so the outputs are the plain forward's up to float
rounding (the matmuls have other shapes), and the prompt's cost is paid once per group instead of
once per row. On sdpa attention the model runs `shared_prompt_sdpa`, which attends each row's
response to its prompt and itself without the pairs the mask would drop; on eager attention a
micro-batch whose packed sequences would cost more multiply-adds than the plain forward (long
responses: its attention grows with the square of the packed length) takes the plain forward. So
does a micro-batch without a repeated prompt, bitwise as before.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass
from typing import NamedTuple

import torch
from tensordict import TensorDict

from rlflow.algos import token_log_probs
from rlflow.protocol import prompt_groups
from workers.sequence import PADDED, SequenceLayout, pack_micro_batch, packed_forward

logger = logging.getLogger(__name__)


def _trim_window(td: TensorDict) -> tuple[int, int, int]:
    """(first kept column, prompt width, kept response width) for this micro-batch."""
    prompt_width = td["prompts"].shape[1]
    attention = td["attention_mask"]
    prompt_cols = attention[:, :prompt_width].any(dim=0).nonzero()
    left = int(prompt_cols[0]) if prompt_cols.numel() else prompt_width - 1
    left = min(left, prompt_width - 1)  # keep the last prompt column: it predicts response token 0
    response_cols = td["response_mask"].any(dim=0).nonzero()
    kept = int(response_cols[-1]) + 1 if response_cols.numel() else 1
    return left, prompt_width, kept


@functools.cache
def _takes_logits_to_keep(model_class: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def _hf_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside the DDP and peft wrappers (FSDP2 keeps the model itself)."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    get_base_model = getattr(model, "get_base_model", None)  # peft
    return get_base_model() if callable(get_base_model) else model


def share_prompt_setting(model: torch.nn.Module, requested: bool, key: str) -> bool:
    """Whether a role's forwards share prompts: `key` is set and the model supports it (a model that
    does not is warned about once, naming the key, and runs the plain forward). A model on sdpa
    attention that shares prompts runs shared_prompt_sdpa."""
    if requested and not supports_shared_prompt(model):
        config = _hf_model(model).config
        logger.warning("%s: the model (attention %s, sliding window %s) cannot take the shared-prompt mask; its "
                       "forwards run every row's prompt. Set %s=false to silence this.",
                       key, getattr(config, "_attn_implementation", None), getattr(config, "sliding_window", None), key)
        return False
    if requested:
        use_shared_prompt_sdpa(model)
    return requested


def supports_shared_prompt(model: torch.nn.Module) -> bool:
    """Whether the model takes the custom 4D attention mask the shared-prompt forward needs: sdpa
    or eager attention over full causal attention (a sliding window would be ignored by it)."""
    config = _hf_model(model).config
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    return (
        hasattr(config, "hidden_size") and hasattr(config, "num_attention_heads")  # for _forward_cost
        and getattr(config, "_attn_implementation", None) in ("sdpa", "eager", SHARED_PROMPT_SDPA)
        and getattr(config, "sliding_window", None) is None
        and all(kind == "full_attention" for kind in layer_types)
    )


SHARED_PROMPT_SDPA = "rlflow_shared_prompt_sdpa"


@dataclass
class _RowsOfPackedSequences:
    """The packed sequences' attention taken as each row's own: the prompt's columns attend within
    the prompt, each row's response columns to its prompt and its own response. The same keys for
    every query as the packed mask gives, without the pairs it masks out (the other responses)."""

    prompt_cols: int
    prompt_mask: torch.Tensor  # [G, 1, P, P] bool
    key_index: torch.Tensor  # [B, P + S] the packed column (flat over [G, L]) of each of a row's keys
    query_index: torch.Tensor  # [B, S] the packed column of each of its response's queries
    row_mask: torch.Tensor  # [B, 1, S, P + S] bool
    real_queries: torch.Tensor  # [Q] the queries of [B * S] that are a response's columns ...
    written: torch.Tensor  # [Q] ... and their packed columns, each once


def shared_prompt_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                       rlflow_rows: _RowsOfPackedSequences | None = None, **kwargs):
    """transformers' sdpa attention; for the shared-prompt forward (rlflow_rows), the prompt's
    queries and each row's response queries in two calls against only the keys they may see, so
    that the attention costs G*P^2 + B*S*(P+S) pairs rather than the packed length squared per group."""
    if rlflow_rows is None:
        return _sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
                     **kwargs)
    layout = rlflow_rows
    groups, heads, length, dim = query.shape
    prompt = slice(0, layout.prompt_cols)
    prompt_out, _ = _sdpa(module, query[:, :, prompt], key[:, :, prompt], value[:, :, prompt], layout.prompt_mask,
                          dropout=dropout, scaling=scaling, is_causal=False)

    def rows_of(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # [G, h, L, d] -> [B, h, cols, d]
        flat = x.transpose(1, 2).reshape(groups * length, x.shape[1], dim)
        return flat[index].transpose(1, 2)

    rows_out, _ = _sdpa(module, rows_of(query, layout.query_index), rows_of(key, layout.key_index),
                        rows_of(value, layout.key_index), layout.row_mask, dropout=dropout, scaling=scaling,
                        is_causal=False)
    responses = rows_out.reshape(-1, heads, dim)[layout.real_queries]
    out = torch.cat([prompt_out, prompt_out.new_zeros(groups, length - layout.prompt_cols, heads, dim)], dim=1)
    out = out.view(groups * length, heads, dim).index_put((layout.written,), responses)
    return out.view(groups, length, heads, dim), None


def _sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention; on CPU, bfloat16 and float16 inputs attend in float32 (torch's
    CPU flash attention, forward and backward, is slower in bfloat16 than in float32 at a
    forward's sizes) and the output returns to their dtype."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dtype = query.dtype
    if query.device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask, **kwargs)
    return out.to(dtype), weights


def use_shared_prompt_sdpa(model: torch.nn.Module) -> None:
    """A model on sdpa attention runs shared_prompt_sdpa (with sdpa's masks): sdpa itself wherever
    the shared-prompt forward does not run."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    config = _hf_model(model).config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return
    AttentionInterface.register(SHARED_PROMPT_SDPA, shared_prompt_sdpa)
    AttentionMaskInterface.register(SHARED_PROMPT_SDPA, sdpa_mask)
    _hf_model(model).set_attn_implementation(SHARED_PROMPT_SDPA)


def _keep_a_key(mask: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """mask [..., Q, K] where a query with no key at all (padding) attends to its own column, True
    in own [Q, K]: finite, and never read."""
    return mask | (own & ~mask.any(dim=-1, keepdim=True))


def _rows_of_packed_sequences(packing: "_Packing", key_valid: torch.Tensor, group: torch.Tensor
                              ) -> _RowsOfPackedSequences:
    num_groups, prompt_cols, segment_len, offsets, length = packing
    device = key_valid.device
    prompt_causal = torch.ones(prompt_cols, prompt_cols, dtype=torch.bool, device=device).tril()
    prompt_mask = _keep_a_key(prompt_causal[None] & key_valid[:, None, :prompt_cols],
                              torch.eye(prompt_cols, dtype=torch.bool, device=device))
    width = max(int(segment_len.max()), 1)
    columns = torch.arange(width, device=device)
    in_segment = columns[None, :] < segment_len[:, None]  # [B, S]
    # a column past the row's segment reads the prompt's first column: its query is never written
    query_index = group[:, None] * length + torch.where(in_segment, offsets[:, None] + columns[None, :], 0)
    prompt_index = group[:, None] * length + torch.arange(prompt_cols, device=device)[None, :]
    key_index = torch.cat([prompt_index, query_index], dim=1)
    in_row = torch.cat([torch.ones_like(prompt_index, dtype=torch.bool), in_segment], dim=1)
    key_ok = key_valid.reshape(-1)[key_index] & in_row
    causal = columns[:, None] >= columns[None, :]  # [S, S]
    row_mask = torch.cat([key_ok[:, None, :prompt_cols].expand(-1, width, -1),
                          causal[None] & key_ok[:, None, prompt_cols:]], dim=2)
    own = torch.cat([torch.zeros(width, prompt_cols, dtype=torch.bool, device=device),
                     torch.eye(width, dtype=torch.bool, device=device)], dim=1)
    row_mask = _keep_a_key(row_mask, own)
    real_queries = in_segment.reshape(-1).nonzero().squeeze(1)
    return _RowsOfPackedSequences(prompt_cols, prompt_mask[:, None], key_index, query_index, row_mask[:, None],
                                  real_queries, query_index.reshape(-1)[real_queries])


def _forward_cost(config, sequences: int, width: int) -> float:
    """Multiply-adds of a forward over `sequences` x `width` tokens, per layer: the projections and
    the MLP per token, and q.k plus p.v per query-key pair (attention under a mask computes every pair)."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    per_token = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * intermediate
    return sequences * width * per_token + sequences * width * width * 2 * heads * head_dim


class _Packing(NamedTuple):
    """Where each row's response goes in its group's packed sequence (the prompt's columns first)."""

    num_groups: int
    prompt_cols: int
    segment_len: torch.Tensor  # [B] the row's response columns up to its last real token
    offsets: torch.Tensor  # [B] the column its segment starts at
    length: int  # the packed sequences' width


def _packing(td: TensorDict, group: torch.Tensor, prompt_cols: int, prompt_width: int, kept: int) -> _Packing:
    device = group.device
    num_groups = int(group.max()) + 1
    columns = torch.arange(kept, device=device)
    response_attention = td["attention_mask"][:, prompt_width : prompt_width + kept].bool()
    segment_len = torch.where(response_attention, columns + 1, torch.zeros_like(columns)).amax(dim=1)
    # a segment starts after the prompt and the segments of its group's earlier rows
    order = torch.argsort(group, stable=True)
    starts_sorted = torch.cumsum(segment_len[order], 0) - segment_len[order]
    group_start = torch.zeros(num_groups, dtype=torch.long, device=device).scatter_reduce(
        0, group[order], starts_sorted, "amin", include_self=False)
    offsets = torch.empty_like(segment_len)
    offsets[order] = prompt_cols + starts_sorted - group_start[group[order]]
    length = max(int((offsets + segment_len).max()), prompt_cols)
    return _Packing(num_groups, prompt_cols, segment_len, offsets, length)


def _shared_prompt_forward(
    model: torch.nn.Module, td: TensorDict, group: torch.Tensor, packing: _Packing, left: int, prompt_width: int,
    kept: int, extra: dict,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain forward's per-row output for the columns that predict response tokens 0..kept-1,
    computed with each group's prompt once (see the module docstring): the packed columns' outputs
    [N, ...] and, [B, kept], the one of each row's column (a prompt's last column serves its group's rows)."""
    ids, attention, positions = td["input_ids"], td["attention_mask"], td["position_ids"]
    device = ids.device
    rows = ids.shape[0]
    num_groups, prompt_cols, segment_len, offsets, length = packing
    response_attention = attention[:, prompt_width : prompt_width + kept].bool()
    columns = torch.arange(kept, device=device)

    first_row = torch.full((num_groups,), rows, dtype=torch.long, device=device).scatter_reduce(
        0, group, torch.arange(rows, device=device), "amin")
    packed_ids = ids.new_zeros(num_groups, length)
    packed_positions = positions.new_zeros(num_groups, length)
    key_valid = torch.zeros(num_groups, length, dtype=torch.bool, device=device)
    segment = torch.full((num_groups, length), -2, dtype=torch.long, device=device)  # -2: filler
    packed_ids[:, :prompt_cols] = ids[first_row, left:prompt_width]
    packed_positions[:, :prompt_cols] = positions[first_row, left:prompt_width]
    key_valid[:, :prompt_cols] = attention[first_row, left:prompt_width].bool()
    segment[:, :prompt_cols] = -1  # -1: the prompt, seen by every segment
    row, column = (columns[None, :] < segment_len[:, None]).nonzero(as_tuple=True)
    target_group, target_column = group[row], offsets[row] + column
    packed_ids[target_group, target_column] = ids[row, prompt_width + column]
    packed_positions[target_group, target_column] = positions[row, prompt_width + column]
    key_valid[target_group, target_column] = response_attention[row, column]
    segment[target_group, target_column] = row

    attention_name = _hf_model(model).config._attn_implementation
    if attention_name == SHARED_PROMPT_SDPA:
        # the rows' own masks only: the model gets a 4D mask (passed through as it is, unread by
        # shared_prompt_sdpa) that is one element broadcast, not the packed length squared
        mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device).expand(num_groups, 1, length, length)
        extra = {**extra, "rlflow_rows": _rows_of_packed_sequences(packing, key_valid, group)}
    else:
        index = torch.arange(length, device=device)
        causal = index[None, :] <= index[:, None]
        same_segment = (segment[:, None, :] == -1) | (segment[:, None, :] == segment[:, :, None])
        mask = _keep_a_key(causal[None] & same_segment & key_valid[:, None, :],
                           torch.eye(length, dtype=torch.bool, device=device))[:, None]
        if attention_name == "eager":  # eager adds the mask to the scores
            mask = torch.zeros(mask.shape, device=device).masked_fill(~mask, torch.finfo(torch.float32).min)

    first_kept = 0
    if "logits_to_keep" in extra:  # the head runs from the prompt's last column on
        first_kept = prompt_cols - 1
        extra = {**extra, "logits_to_keep": length - first_kept}
    output = model(input_ids=packed_ids, attention_mask=mask, position_ids=packed_positions, use_cache=False, **extra)
    # response token j is predicted by the column of token j-1, token 0 by the prompt's last column;
    # the columns past a row's segment are padding, read from the prompt's last column
    source = offsets[:, None] + columns[None, :] - 1
    from_prompt = (columns[None, :] == 0) | (columns[None, :] > segment_len[:, None])
    source = torch.where(from_prompt, torch.full_like(source, prompt_cols - 1), source)
    outputs = output.logits
    return outputs.reshape(-1, *outputs.shape[2:]), group[:, None] * outputs.shape[1] + source - first_kept


def _forward_window(model: torch.nn.Module, td: TensorDict, share_prompt: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """(outputs, index, kept): the model's output for the columns that predict response tokens
    0 .. kept-1, [B, kept, ...] with index None, or with the shared-prompt forward [N, ...] and
    index [B, kept] (row b's column j is outputs[index[b, j]]), so that no [B, kept, vocab] copy
    of the logits is made."""
    left, prompt_width, kept = _trim_window(td)
    end = prompt_width + kept
    # position t predicts token t+1: response token j is predicted at column prompt_width-1+j,
    # so the response's predictions are the window's last kept+1 columns but the final one
    extra = {}
    start = prompt_width - 1 - left
    if _takes_logits_to_keep(type(_hf_model(model))):
        extra["logits_to_keep"] = kept + 1
        start = 0
    if share_prompt:
        group = prompt_groups(td)
        if int(group.max()) + 1 < group.numel():
            packing = _packing(td, group, prompt_width - left, prompt_width, kept)
            # eager attention over the packed sequence computes every pair of its columns: behind a
            # short prompt, long responses make that cost more than the prompt saves, and then the
            # plain forward runs (shared_prompt_sdpa computes only the pairs a row's own forward would)
            config = _hf_model(model).config
            plain_cost = _forward_cost(config, group.numel(), end - left)
            if (config._attn_implementation == SHARED_PROMPT_SDPA
                    or _forward_cost(config, packing.num_groups, packing.length) < plain_cost):
                return *_shared_prompt_forward(model, td, group, packing, left, prompt_width, kept, extra), kept
    output = model(
        input_ids=td["input_ids"][:, left:end],
        attention_mask=td["attention_mask"][:, left:end],
        position_ids=td["position_ids"][:, left:end],
        use_cache=False,
        **extra,
    )
    return output.logits[:, start : start + kept], None, kept


def _pad_to(values: torch.Tensor, width: int) -> torch.Tensor:
    """[B, kept, ...] -> [B, width, ...], zeros after the kept columns."""
    if values.shape[1] == width:
        return values
    trailing = (0, 0) * (values.dim() - 2)
    return torch.nn.functional.pad(values, (*trailing, 0, width - values.shape[1]))


def _packed_forward(model: torch.nn.Module, td: TensorDict, layout: SequenceLayout):
    """(the packed row, the model's output at its response-predicting columns) of a micro-batch."""
    packed = pack_micro_batch(td, layout.sp)
    return packed, packed_forward(model, packed, layout.sp, _takes_logits_to_keep(type(_hf_model(model))))


def response_log_probs(
    model: torch.nn.Module, td: TensorDict, temperature: float, with_entropy: bool = False, share_prompt: bool = False,
    layout: SequenceLayout = PADDED,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(response token) under logits / temperature (the sampling distribution), [B, R]."""
    out = response_forward(model, td, temperature, with_entropy, share_prompt, layout)
    return out.log_probs, out.entropy


@dataclass
class ResponseForward:
    """One forward's per-response-token outputs, [B, R] (or [B, R, k]), zeros after each response."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None = None
    topk_log_probs: torch.Tensor | None = None  # the k largest log-probs at each position (top_k > 0)
    topk_ids: torch.Tensor | None = None  # their token ids, long
    candidate_log_probs: torch.Tensor | None = None  # the log-probs of `candidate_ids`' tokens


def response_forward(
    model: torch.nn.Module, td: TensorDict, temperature: float, with_entropy: bool = False, share_prompt: bool = False,
    layout: SequenceLayout = PADDED, top_k: int = 0, candidate_ids: torch.Tensor | None = None,
) -> ResponseForward:
    """response_log_probs, and from the same logits: with top_k > 0 the k most likely tokens of
    each position and their log-probs (a teacher's), with candidate_ids ([B, R, k] long) the
    log-probs of those tokens (the actor's of the teacher's top k)."""
    shape = tuple(td["responses"].shape)
    if layout.packs:
        packed, logits = _packed_forward(model, td, layout)
        rows = None
        tokens = td["responses"][packed.rows, packed.columns]
        candidates = None if candidate_ids is None else candidate_ids[packed.rows, packed.columns]

        def place(values):  # [K, ...] of this rank -> [B, R, ...]
            return layout.gather(values, packed, shape + tuple(values.shape[1:]))
    else:
        logits, rows, kept = _forward_window(model, td, share_prompt)
        tokens = td["responses"][:, :kept]
        candidates = None if candidate_ids is None else candidate_ids[:, :kept]

        def place(values):  # [B, kept, ...] -> [B, R, ...]
            return _pad_to(values, shape[1])
    log_probs, entropy = token_log_probs(logits, tokens, temperature, with_entropy, rows=rows)
    out = ResponseForward(place(log_probs), None if entropy is None else place(entropy))
    if top_k > 0 or candidates is not None:
        scaled = (logits if rows is None else logits[rows]).float()
        if temperature != 1.0:
            scaled = scaled / temperature
        log_softmax = torch.log_softmax(scaled, dim=-1)
        if top_k > 0:
            values, ids = log_softmax.topk(top_k, dim=-1)
            out.topk_log_probs, out.topk_ids = place(values), place(ids)
        if candidates is not None:
            out.candidate_log_probs = place(log_softmax.gather(-1, candidates))
    return out


def response_values(model: torch.nn.Module, td: TensorDict, share_prompt: bool = False,
                    layout: SequenceLayout = PADDED) -> torch.Tensor:
    """V(state before each response token), [B, R], from a model with a scalar head."""
    if layout.packs:
        packed, scores = _packed_forward(model, td, layout)
        return layout.gather(scores.squeeze(-1).float(), packed, tuple(td["responses"].shape))
    scores, rows, kept = _forward_window(model, td, share_prompt)
    if rows is not None:
        scores = scores[rows]
    return _pad_to(scores.squeeze(-1).float(), td["responses"].shape[1])
