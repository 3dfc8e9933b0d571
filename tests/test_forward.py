"""workers/forward.py: the response log-probs every role computes, against a plain full forward.

The forward trims the columns that are padding in every row and asks a causal LM for the logits
of the response-predicting columns only (`logits_to_keep`); both must leave each response token's
log-prob and entropy what a forward over the whole padded sequence gives.
"""

from __future__ import annotations

import pytest
import torch

from rlflow.algos import entropy_from_logits
from rlflow.protocol import assemble_rollout, left_pad
from workers.forward import response_log_probs

PROMPTS = [[5, 6, 7], [8], [9, 10, 11, 12, 13], [14, 15]]
RESPONSES = [[20, 21, 22, 0], [23], [24, 25], [26, 27, 28, 29, 30, 31]]
MAX_RESPONSE = 8  # wider than every response: the right padding is trimmed too


def _batch():
    ids, mask = left_pad(PROMPTS, pad_token_id=1)
    # two pad columns on the left of every row: trimmed
    ids = torch.cat([torch.ones(ids.shape[0], 2, dtype=ids.dtype), ids], dim=1)
    mask = torch.cat([torch.zeros(mask.shape[0], 2, dtype=mask.dtype), mask], dim=1)
    return assemble_rollout(ids, mask, RESPONSES, 1, MAX_RESPONSE, pad_token_id=1, eos_token_id=0)


def _reference(model, batch, temperature):
    """Each response token's log-prob and entropy from one forward over every column."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"], use_cache=False).logits.float() / temperature
    prompt_width, width = batch["prompts"].shape[1], batch["responses"].shape[1]
    logits = logits[:, prompt_width - 1 : prompt_width - 1 + width]
    log_probs = torch.log_softmax(logits, -1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    return log_probs, entropy_from_logits(logits)


def _head_columns(model):
    """Records the number of columns the vocabulary projection is applied to, per call."""
    seen = []
    model.get_output_embeddings().register_forward_hook(lambda module, args, out: seen.append(args[0].shape[1]))
    return seen


@pytest.mark.parametrize("wrap", ["plain", "lora"])
def test_response_log_probs_equal_a_full_forward_and_project_only_response_columns(tiny_model_dir, wrap):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    torch.manual_seed(0)
    with torch.no_grad():  # not the identity: a perturbed model, so no prediction is trivially equal
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    if wrap == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 init_lora_weights=False))
    batch = _batch()
    mask = batch["response_mask"].bool()
    seen = _head_columns(model.get_base_model() if wrap == "lora" else model)
    want_log_probs, want_entropy = _reference(model, batch, 0.7)
    seen.clear()
    with torch.no_grad():
        log_probs, entropy = response_log_probs(model, batch, 0.7, with_entropy=True)
    longest_response = max(len(r) for r in RESPONSES)
    assert seen == [longest_response + 1], f"the head saw {seen} columns; the responses need {longest_response} (+1)"
    assert log_probs.shape == entropy.shape == batch["responses"].shape
    assert torch.allclose(log_probs[mask], want_log_probs[mask], atol=1e-5, rtol=0)
    assert torch.allclose(entropy[mask], want_entropy[mask], atol=1e-5, rtol=0)
    # the trimmed columns (padding in every row) come back as zeros
    assert (log_probs[:, longest_response:] == 0).all() and (entropy[:, longest_response:] == 0).all()
