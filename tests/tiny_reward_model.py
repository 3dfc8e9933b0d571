"""A tiny reward model built locally: a randomly initialised Qwen2ForSequenceClassification.

It shares rlflow.tiny's byte-level tokenizer (so any text encodes, none of it to unknown tokens)
but carries a chat template of its own, different from anything the policy uses, so a test can
tell that the reward model formats (prompt, response) with its own template.
"""

from __future__ import annotations

import os
from pathlib import Path

from rlflow.tiny import _qwen2_config, build_tokenizer

__all__ = ["REWARD_CHAT_TEMPLATE", "build_tiny_reward_model"]

# role markers spelled out in plain text: the tiny tokenizer encodes them byte by byte
REWARD_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '[' + message['role'] + ']: ' + message['content'] + '\n' }}"
    "{% endfor %}"
    "{{ '[score]' }}"
)


def build_tiny_reward_model(out_dir: str | os.PathLike, seed: int = 0) -> str:
    """Tokenizer (with REWARD_CHAT_TEMPLATE) + a Qwen2ForSequenceClassification with one label,
    float32, in out_dir. Returns out_dir as a string."""
    import torch
    from transformers import Qwen2ForSequenceClassification

    out = Path(out_dir)
    tok = build_tokenizer(out)
    tok.chat_template = REWARD_CHAT_TEMPLATE
    # no language-model head to tie the embeddings to
    config = _qwen2_config(len(tok), tok.eos_token_id, tok.pad_token_id, tie_word_embeddings=False, seed=seed)
    config.num_labels = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForSequenceClassification(config).to(torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return str(out)
