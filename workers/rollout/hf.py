"""Rollout with transformers' generate: the engine that always works, and the one the tests run."""

from __future__ import annotations

import torch

from workers.rollout.engine import RolloutEngine, register_engine


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

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.check_awake("load_weights")
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
            self.model.to("cpu")
            torch.accelerator.empty_cache()  # to the driver, for the trainers in other processes

    def _restore_memory(self) -> None:
        if self.frees_memory_when_sleeping:
            self.model.to(self.device)

    def shutdown(self) -> None:
        pass
