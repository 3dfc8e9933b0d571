"""Model forward passes over a (micro-)batch: response log-probs, entropy and values.

Columns that are padding in every row of the micro-batch are cut off before the forward (the
prompt's left padding, the responses' right padding), so a token-budget micro-batch of short
rows costs little; results are padded back to the full response width with zeros. A model whose
forward takes `logits_to_keep` (a causal LM) computes its head only on the columns that predict
response tokens: the prompt's outputs are never used.
"""

from __future__ import annotations

import functools
import inspect

import torch
from tensordict import TensorDict

from rlflow.algos import entropy_from_logits


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


def _forward_window(model: torch.nn.Module, td: TensorDict) -> tuple[torch.Tensor, int]:
    """The model's per-column output for the columns that predict response tokens 0 .. kept-1."""
    left, prompt_width, kept = _trim_window(td)
    end = prompt_width + kept
    # position t predicts token t+1: response token j is predicted at column prompt_width-1+j,
    # so the response's predictions are the window's last kept+1 columns but the final one
    extra = {}
    start = prompt_width - 1 - left
    if _takes_logits_to_keep(type(_hf_model(model))):
        extra["logits_to_keep"] = kept + 1
        start = 0
    output = model(
        input_ids=td["input_ids"][:, left:end],
        attention_mask=td["attention_mask"][:, left:end],
        position_ids=td["position_ids"][:, left:end],
        use_cache=False,
        **extra,
    )
    return output.logits[:, start : start + kept], kept


def _pad_to(values: torch.Tensor, width: int) -> torch.Tensor:
    if values.shape[1] == width:
        return values
    return torch.nn.functional.pad(values, (0, width - values.shape[1]))


def response_log_probs(
    model: torch.nn.Module, td: TensorDict, temperature: float, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(response token) under logits / temperature (the sampling distribution), [B, R]."""
    logits, kept = _forward_window(model, td)
    logits = logits.float() / temperature
    tokens = td["responses"][:, :kept]
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    width = td["responses"].shape[1]
    entropy = _pad_to(entropy_from_logits(logits), width) if with_entropy else None
    return _pad_to(log_probs, width), entropy


def response_values(model: torch.nn.Module, td: TensorDict) -> torch.Tensor:
    """V(state before each response token), [B, R], from a model with a scalar head."""
    scores, kept = _forward_window(model, td)
    return _pad_to(scores.squeeze(-1).float(), td["responses"].shape[1])
