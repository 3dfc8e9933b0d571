"""Rollout with transformers' generate: the engine that always works, and the one the tests run.

Partial rollout's chunks (`continue_ids`) run a decode loop of their own instead of `generate`:
each response keeps its KV cache from one chunk to the next while the weights stay the same, so
a chunk reads only the tokens new to the engine (a response's prefix again only after a weight
load), and the loop stops between two tokens when the worker needs the engine (`pause`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlflow.protocol import left_pad
from workers.rollout.engine import RolloutEngine, register_engine


def sample_next(logits: torch.Tensor, *, do_sample: bool, temperature: float, top_p: float, top_k: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """[B] tokens drawn from [B, V] logits and each one's log-prob under the distribution it was
    drawn from: generate's order (temperature, then top-k, then top-p); greedy: the raw logits'."""
    logits = logits.float()
    if do_sample:
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
    tokens = torch.multinomial(log_probs.exp(), 1).squeeze(-1) if do_sample else logits.argmax(-1)
    return tokens, log_probs.gather(-1, tokens[:, None]).squeeze(-1)


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
    """transformers' generate, micro-batched over prompts."""

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

    def _sampling_kwargs(self, do_sample: bool, temperature: float, top_p: float) -> dict:
        if not do_sample:
            return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        return {"do_sample": True, "temperature": temperature, "top_p": top_p,
                "top_k": self.top_k if self.top_k > 0 else 0}

    def generate_ids(self, input_ids, attention_mask, *, n, do_sample, seed, return_log_probs, temperature, top_p,
                     max_new_tokens):
        prompt_width = input_ids.shape[1]
        generator_seed = self.seed if seed is None else seed
        response_ids: list[list[int]] = []
        log_probs: list[list[float]] = []
        for start in range(0, input_ids.shape[0], self.micro_batch_size):
            ids = input_ids[start : start + self.micro_batch_size].to(self.device)
            mask = attention_mask[start : start + self.micro_batch_size].to(self.device)
            # reproducible sampling: the same seed gives the same responses for the same weights
            torch.manual_seed(generator_seed + start)
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                num_return_sequences=n if do_sample else 1,
                pad_token_id=self.pad_token_id,
                eos_token_id=self.eos_token_id,
                output_scores=return_log_probs,
                return_dict_in_generate=True,
                **self._sampling_kwargs(do_sample, temperature, top_p),
            )
            generated = out.sequences[:, prompt_width:]
            token_log_probs = None
            if return_log_probs:
                # out.scores holds each step's PROCESSED logits (temperature, top-k, top-p applied):
                # the log-prob of the token under the distribution it was sampled from
                token_log_probs = torch.stack([
                    torch.log_softmax(scores.float(), dim=-1).gather(-1, generated[:, t : t + 1]).squeeze(-1)
                    for t, scores in enumerate(out.scores)], dim=1).cpu()
            generated = generated.cpu()
            if not do_sample and n > 1:  # greedy: generated once, repeated
                generated = generated.repeat_interleave(n, dim=0)
                token_log_probs = None if token_log_probs is None else token_log_probs.repeat_interleave(n, dim=0)
            response_ids.extend(generated.tolist())
            if token_log_probs is not None:
                log_probs.extend(token_log_probs.tolist())
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
        positions = mask.sum(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones(len(sequences), 1, dtype=torch.long)], dim=1)
        torch.manual_seed(self.seed if seed is None else seed)
        sample = dict(do_sample=do_sample, temperature=temperature, top_p=top_p, top_k=self.top_k)
        out = model(input_ids=torch.tensor([seq[-1:] for seq in sequences], device=self.device),
                    attention_mask=mask.to(self.device), position_ids=positions.to(self.device), past_key_values=past,
                    use_cache=True)
        tokens, log_probs = [], []
        ended = torch.zeros(len(sequences), dtype=torch.bool)
        while True:
            token, log_prob = sample_next(out.logits[:, -1], **sample)
            tokens.append(token.cpu())
            log_probs.append(log_prob.cpu())
            ended |= tokens[-1] == self.eos_token_id
            if len(tokens) == max_new_tokens or bool(ended.all()) or (pause is not None and pause()):
                break
            positions = mask.sum(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones(len(sequences), 1, dtype=torch.long)], dim=1)
            out = model(input_ids=token[:, None], attention_mask=mask.to(self.device),
                        position_ids=positions.to(self.device), past_key_values=out.past_key_values, use_cache=True)
        new_tokens = torch.stack(tokens, dim=1).tolist()
        # keep the caches of the rows that go on: each covers its new sequence but the last token
        self._row_caches = {}
        layers = out.past_key_values.layers
        for row, seq in enumerate(sequences):
            if not bool(ended[row]):
                valid = mask[row].bool().to(self.device)
                self._row_caches[tuple(seq + new_tokens[row])] = [
                    (layer.keys[row][:, valid], layer.values[row][:, valid]) for layer in layers]
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
                         position_ids=(mask.cumsum(-1) - 1).clamp(min=0).to(self.device), use_cache=True, **extra)
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
