"""Rollout with transformers' generate: the fallback engine, and the one the tests run."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rlflow.protocol import response_mask_from_ids, right_pad, rollout_batch


def assemble_rollout(
    prompts: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: list[list[int]],
    n: int,
    max_response_length: int,
    pad_token_id: int,
    eos_token_id: int,
    log_probs: list[list[float]] | None = None,
) -> TensorDict:
    """The rollout batch of B*n rows (repeat_interleave order) from generated token lists, with
    `rollout_log_probs` when the engine gave the log-prob of each generated token."""
    prompts = prompts.repeat_interleave(n, dim=0)
    prompt_mask = prompt_mask.repeat_interleave(n, dim=0)
    responses, _ = right_pad(response_ids, pad_token_id, max_response_length)
    response_mask = response_mask_from_ids(responses, eos_token_id)
    # only tokens actually generated count (a row shorter than the width is padded)
    lengths = torch.tensor([min(len(r), max_response_length) for r in response_ids])
    response_mask &= (torch.arange(max_response_length)[None, :] < lengths[:, None]).long()
    return rollout_batch(prompts, prompt_mask, responses, response_mask, log_probs)


class HFRollout:
    """Same interface as workers.rollout.vllm.VLLMRollout."""

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
        **_engine_only,
    ):
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(self.device)
        self.model.eval()
        self.max_response_length = max_response_length
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.seed = seed
        self.pad_token_id, self.eos_token_id = pad_token_id, eos_token_id
        self.micro_batch_size = micro_batch_size

    def _sampling_kwargs(self, do_sample: bool) -> dict:
        if not do_sample:
            return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        return {
            "do_sample": True,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k if self.top_k > 0 else 0,
        }

    @torch.no_grad()
    def generate(self, batch: TensorDict, *, n: int, do_sample: bool, seed: int | None = None,
                 return_log_probs: bool = False) -> TensorDict:
        input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
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
                max_new_tokens=self.max_response_length,
                num_return_sequences=n if do_sample else 1,
                pad_token_id=self.pad_token_id,
                eos_token_id=self.eos_token_id,
                output_scores=return_log_probs,
                return_dict_in_generate=True,
                **self._sampling_kwargs(do_sample),
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
            if not do_sample and n > 1:
                generated = generated.repeat_interleave(n, dim=0)
                token_log_probs = None if token_log_probs is None else token_log_probs.repeat_interleave(n, dim=0)
            for index, row in enumerate(generated.tolist()):
                if self.eos_token_id in row:
                    row = row[: row.index(self.eos_token_id) + 1]
                response_ids.append(row)
                if token_log_probs is not None:
                    log_probs.append(token_log_probs[index, : len(row)].tolist())
        return assemble_rollout(
            input_ids, attention_mask, response_ids, n, self.max_response_length, self.pad_token_id,
            self.eos_token_id, log_probs if return_log_probs else None,
        )

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        missing, unexpected = self.model.load_state_dict(state_dict, strict=False)
        # tied embeddings may appear under one name only
        missing = [k for k in missing if not (k == "lm_head.weight" and self.model.config.tie_word_embeddings)]
        if missing or unexpected:
            raise ValueError(f"rollout weight sync: missing {missing[:5]}, unexpected {unexpected[:5]}")

    def shutdown(self) -> None:
        pass
