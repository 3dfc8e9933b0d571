"""Rollout with a transformers model and a decode loop of its own: the engine that always works,
and the one the tests run.

Generation reads each prompt once and gives its cache to the prompt's n responses (generate reads
it n times), and samples a token per row by inverting the row's CDF at one uniform draw
(torch.multinomial draws an exponential for every entry of the vocabulary). Partial rollout's
chunks (`continue_ids`) run the same loop: each response keeps its KV cache from one chunk to the
next while the weights stay the same, so a chunk reads only the tokens new to the engine (a
response's prefix again only after a weight load), and the loop stops between two tokens when the
worker needs the engine (`pause`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlflow.protocol import left_pad, position_ids_from_mask
from workers.rollout.engine import RolloutEngine, register_engine


def sample_next(logits: torch.Tensor, *, do_sample: bool, temperature: float, top_p: float, top_k: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """[B] tokens drawn from [B, V] logits and each one's log-prob under the distribution it was
    drawn from: generate's order (temperature, then top-k, then top-p); greedy: the raw logits'."""
    logits = logits.float()
    if do_sample:
        if temperature != 1.0:
            logits = logits / temperature
        if top_k > 0:
            kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if top_p < 1.0:  # drop the least likely tokens whose mass is at most 1 - top_p; keep the most likely
            ascending, order = torch.sort(logits, dim=-1)
            drop = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
            drop[:, -1] = False
            logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    log_probs = torch.log_softmax(logits, dim=-1)
    tokens = draw(log_probs) if do_sample else logits.argmax(-1)
    return tokens, log_probs.gather(-1, tokens[:, None]).squeeze(-1)


def draw(log_probs: torch.Tensor) -> torch.Tensor:
    """[B] tokens, one per row of [B, V] log-probs: the row's CDF inverted at one uniform draw of
    torch's global generator. The CDF sums in float64, so a token's chance is its probability to
    about 1e-16; a token of probability 0 (cut by top-k or top-p) is never drawn."""
    cdf = torch.cumsum(log_probs.exp(), dim=-1, dtype=torch.float64)
    total = cdf[:, -1:]
    uniform = torch.rand(total.shape, dtype=torch.float64, device=total.device) * total
    # were u * total to reach total, searchsorted would point past the last token of nonzero probability
    uniform = torch.minimum(uniform, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, uniform, right=True).squeeze(-1)


@torch.no_grad()
def generate_tokens(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, copies: int, max_new_tokens: int,
                    eos_token_id: int, do_sample: bool, temperature: float, top_p: float, top_k: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """([B*copies, T] tokens, [B*copies, T] their log-probs) after left-padded prompts [B, P], in
    repeat_interleave order, T <= max_new_tokens (fewer once every row has an EOS; the tokens after a
    row's EOS are for the caller to cut). Each prompt is read once; its cache serves its copies."""
    from workers.forward import _takes_logits_to_keep

    device = model.device
    mask = attention_mask.to(device)
    extra = {"logits_to_keep": 1} if _takes_logits_to_keep(type(model)) else {}
    out = model(input_ids=input_ids.to(device), attention_mask=mask, position_ids=position_ids_from_mask(mask),
                use_cache=True, **extra)
    past, logits = out.past_key_values, out.logits[:, -1]
    if copies > 1:
        past.batch_repeat_interleave(copies)
        logits, mask = logits.repeat_interleave(copies, dim=0), mask.repeat_interleave(copies, dim=0)
    sample = dict(do_sample=do_sample, temperature=temperature, top_p=top_p, top_k=top_k)
    tokens, log_probs, _, _, _ = decode(model, logits, past, mask, max_new_tokens, eos_token_id, sample)
    return torch.stack(tokens, dim=1).cpu(), torch.stack(log_probs, dim=1).cpu()


def decode(model, logits: torch.Tensor, past, mask: torch.Tensor, max_new_tokens: int, eos_token_id: int,
           sample: dict, pause: Callable[[], bool] | None = None):
    """The decode loop: a token per row from `logits` ([B, V], the last column's output), then a
    forward of the new tokens against the cache `past` (valid where `mask`, [B, T], is), until
    max_new_tokens, every row's EOS, or `pause()`. Returns the tokens and their log-probs (lists of
    [B] per step), which rows drew an EOS, and the cache with its mask (it holds every token but
    the last drawn)."""
    tokens, log_probs = [], []
    ended = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    ones = torch.ones(logits.shape[0], 1, dtype=mask.dtype, device=mask.device)
    while True:
        token, log_prob = sample_next(logits, **sample)
        tokens.append(token)
        log_probs.append(log_prob)
        ended |= token == eos_token_id
        if len(tokens) == max_new_tokens or bool(ended.all()) or (pause is not None and pause()):
            return tokens, log_probs, ended, past, mask
        positions = mask.sum(-1, keepdim=True)
        mask = torch.cat([mask, ones], dim=1)
        out = model(input_ids=token[:, None], attention_mask=mask, position_ids=positions, past_key_values=past,
                    use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1]


GROUPED_SDPA = "rlflow_grouped_sdpa"


def grouped_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' sdpa attention, but grouped-query models keep their K/V heads (enable_gqa)
    under a mask too: transformers copies each K/V head to every query head of its group first
    whenever a mask is given (left-padded prompts), a copy per layer and step that torch's CPU
    kernel does not need. The same outputs, bitwise, on the shapes the decode loop runs."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (getattr(module, "num_key_value_groups", 1) == 1 or kwargs.get("position_bias") is not None
            or kwargs.get("cache") is not None or kwargs.get("output_attentions")):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = query.shape[2] > 1 and attention_mask is None and is_causal
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling, is_causal=is_causal,
                                                           enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def use_grouped_sdpa(model) -> None:
    """A CPU model on sdpa attention runs grouped_sdpa (with sdpa's masks)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if model.device.type != "cpu" or model.config._attn_implementation != "sdpa":
        return
    AttentionInterface.register(GROUPED_SDPA, grouped_sdpa)
    AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)
    model.set_attn_implementation(GROUPED_SDPA)


def _stack_left_padded(per_row: list[list[tuple[torch.Tensor, torch.Tensor]] | None], num_layers: int):
    """Rows' caches ([heads, T_row, dim] per layer; None: nothing cached) as one left-padded
    DynamicCache and its [B, T] mask."""
    from transformers.cache_utils import DynamicCache

    lengths = [0 if kv is None else kv[0][0].shape[1] for kv in per_row]
    width = max(lengths)
    mask = torch.zeros(len(per_row), width, dtype=torch.long)
    cache = DynamicCache()
    if width == 0:
        return cache, mask
    sample = next(kv for kv in per_row if kv is not None)[0][0]
    for layer in range(num_layers):
        keys, values = (sample.new_zeros(len(per_row), sample.shape[0], width, sample.shape[2]) for _ in range(2))
        for row, kv in enumerate(per_row):
            if kv is not None:
                keys[row, :, width - lengths[row]:], values[row, :, width - lengths[row]:] = kv[layer]
        cache.update(keys, values, layer)
    for row, length in enumerate(lengths):
        mask[row, width - length:] = 1
    return cache, mask


@register_engine("hf")
class HFRollout(RolloutEngine):
    """A transformers causal LM and this module's decode loop, micro-batched over prompts."""

    reusable_process = True  # a model and its tensors: dropped, they are gone

    def __init__(
        self,
        model_path: str,
        *,
        max_prompt_length: int,
        max_response_length: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        dtype: str = "float32",
        seed: int = 0,
        pad_token_id: int,
        eos_token_id: int,
        micro_batch_size: int = 256,
        device: str | None = None,
    ):
        from transformers import AutoModelForCausalLM

        super().__init__(max_response_length=max_response_length, pad_token_id=pad_token_id,
                         eos_token_id=eos_token_id, temperature=temperature, top_p=top_p, top_k=top_k)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(self.device)
        self.model.eval()
        use_grouped_sdpa(self.model)
        self.seed = seed
        self.micro_batch_size = micro_batch_size
        # partial rollout: sequence -> its KV cache ([heads, len - 1, dim] per layer), valid while
        # the weights that computed it are loaded
        self._row_caches: dict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = {}

    @classmethod
    def from_config(cls, model_path, cfg, *, device, seed, pad_token_id, eos_token_id):
        if cfg.rollout.tensor_parallel_size != 1:  # rollout.name=auto without vllm installed lands here
            raise ValueError(f"rollout.tensor_parallel_size={cfg.rollout.tensor_parallel_size}: the hf engine runs "
                             "one model per rollout rank; install vllm for tensor parallelism (or use rollout.dp_size)")
        return cls(model_path, micro_batch_size=cfg.rollout.micro_batch_size,
                   **cls.common_kwargs(cfg, seed, pad_token_id, eos_token_id))

    def generate_ids(self, input_ids, attention_mask, *, n, do_sample, seed, return_log_probs, temperature, top_p,
                     max_new_tokens):
        generator_seed = self.seed if seed is None else seed
        copies = n if do_sample else 1  # greedy: generated once, repeated
        response_ids: list[list[int]] = []
        log_probs: list[list[float]] = []
        for start in range(0, input_ids.shape[0], self.micro_batch_size):
            # reproducible sampling: the same seed gives the same responses for the same weights
            torch.manual_seed(generator_seed + start)
            tokens, token_log_probs = generate_tokens(
                self.model, input_ids[start : start + self.micro_batch_size],
                attention_mask[start : start + self.micro_batch_size], copies=copies, max_new_tokens=max_new_tokens,
                eos_token_id=self.eos_token_id, do_sample=do_sample, temperature=temperature, top_p=top_p,
                top_k=self.top_k)
            response_ids.extend(tokens.repeat_interleave(n // copies, dim=0).tolist())
            if return_log_probs:
                log_probs.extend(token_log_probs.repeat_interleave(n // copies, dim=0).tolist())
        return response_ids, (log_probs if return_log_probs else None)

    @torch.no_grad()
    def continue_ids(self, sequences: list[list[int]], *, do_sample: bool, seed: int | None, return_log_probs: bool,
                     temperature: float, top_p: float, max_new_tokens: int, pause: Callable[[], bool] | None = None
                     ) -> tuple[list[list[int]], list[list[float]] | None]:
        """Up to max_new_tokens more tokens after each sequence, fewer for all rows once `pause()`
        is true (at least one). A sequence whose cache the last call left (the same weights)
        feeds only its last token; the others' prefixes are read first, in a forward of their own."""
        model = self.model
        cached = [self._row_caches.get(tuple(seq)) for seq in sequences]
        self._prefill([row for row, kv in enumerate(cached) if kv is None], sequences, cached)
        # every row's cache now covers its sequence but the last token, which the first step feeds
        past, mask = _stack_left_padded(cached, model.config.num_hidden_layers)
        positions = mask.sum(-1, keepdim=True).to(self.device)
        mask = torch.cat([mask, torch.ones(len(sequences), 1, dtype=torch.long)], dim=1).to(self.device)
        torch.manual_seed(self.seed if seed is None else seed)
        sample = dict(do_sample=do_sample, temperature=temperature, top_p=top_p, top_k=self.top_k)
        out = model(input_ids=torch.tensor([seq[-1:] for seq in sequences], device=self.device),
                    attention_mask=mask, position_ids=positions, past_key_values=past, use_cache=True)
        tokens, log_probs, ended, past, mask = decode(model, out.logits[:, -1], out.past_key_values, mask,
                                                      max_new_tokens, self.eos_token_id, sample, pause)
        new_tokens = torch.stack(tokens, dim=1).tolist()
        # keep the caches of the rows that go on: each covers its new sequence but the last token
        self._row_caches = {}
        for row, seq in enumerate(sequences):
            if not bool(ended[row]):
                valid = mask[row].bool()
                self._row_caches[tuple(seq + new_tokens[row])] = [
                    (layer.keys[row][:, valid], layer.values[row][:, valid]) for layer in past.layers]
        return new_tokens, (torch.stack(log_probs, dim=1).tolist() if return_log_probs else None)

    def _prefill(self, rows: list[int], sequences: list[list[int]], cached: list) -> None:
        """The caches of `rows` (in `cached`), each over its sequence but the last token: one
        forward of those rows alone, so that a response joining the engine's batch costs its own
        prefix, not a prefix-wide forward of every row (a one-token prefix needs no cache)."""
        rows = [row for row in rows if len(sequences[row]) > 1]
        if not rows:
            return
        from workers.forward import _takes_logits_to_keep

        ids, mask = left_pad([sequences[row][:-1] for row in rows], self.pad_token_id)
        extra = {"logits_to_keep": 1} if _takes_logits_to_keep(type(self.model)) else {}
        out = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                         position_ids=position_ids_from_mask(mask).to(self.device), use_cache=True, **extra)
        for index, row in enumerate(rows):
            valid = mask[index].bool().to(self.device)
            cached[row] = [(layer.keys[index][:, valid], layer.values[index][:, valid])
                           for layer in out.past_key_values.layers]

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.check_awake("load_weights")
        self._row_caches = {}  # computed by the old weights: the next chunk reads every prefix again
        missing, unexpected = self.model.load_state_dict(state_dict, strict=False)
        # tied embeddings may appear under one name only
        missing = [k for k in missing if not (k == "lm_head.weight" and self.model.config.tie_word_embeddings)]
        if missing or unexpected:
            raise ValueError(f"rollout weight sync: missing {missing[:5]}, unexpected {unexpected[:5]}")

    # -- sleep: on an accelerator the model waits in host memory; on CPU there is nowhere better --
    @property
    def frees_memory_when_sleeping(self) -> bool:
        return self.device.type != "cpu"

    def _release_memory(self, keep_weights: bool) -> None:
        # keep_weights=False changes nothing: the weights are all this engine holds, moved aside either way
        if self.frees_memory_when_sleeping:
            self._row_caches = {}
            self.model.to("cpu")
            torch.accelerator.empty_cache()  # to the driver, for the trainers in other processes

    def _restore_memory(self) -> None:
        if self.frees_memory_when_sleeping:
            self.model.to(self.device)

    def shutdown(self) -> None:
        pass
