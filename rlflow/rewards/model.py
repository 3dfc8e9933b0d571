"""A learned reward model: a ``*ForSequenceClassification`` HF folder with one label.

The reward-model role (``reward_model.enable``, worker ``workers.reward_model.RewardModelWorker``)
scores each decoded response in the text format the reward model was trained on: its OWN
tokenizer and chat template (``format_for_reward_model``), never the policy's. The score is the
model's single logit at the last token of that text. ``RewardModelClient`` is the driver's side:
the Scorer (controllers/rollout_source.py) sends it (prompt, response) pairs and adds
``reward_model.weight`` times the scores to ``reward.rule_weight`` times the reward function's.

Nothing here imports torch, transformers or ray: the folder check runs on the driver before
Ray starts, and the formatting is a pure function of the tokenizer it is given.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence

__all__ = ["check_reward_model_folder", "format_for_reward_model", "split_contiguous", "RewardModelClient"]


def _config_key(path) -> str:
    return f"reward_model.path={os.fspath(path)!r}"


def check_reward_model_folder(path) -> None:
    """Fail on the driver, before Ray starts, when ``path`` cannot be a reward model: not a folder,
    no config.json, not a *ForSequenceClassification architecture, or more than one label."""
    key = _config_key(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{key} is not a folder (a local HF *ForSequenceClassification model folder)")
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"{key} has no config.json: not a HF model folder")
    with open(config_file) as f:
        config = json.load(f)
    architectures = config.get("architectures") or []
    if not any(str(arch).endswith("ForSequenceClassification") for arch in architectures):
        raise ValueError(
            f"{key} holds a {architectures or 'model without architectures'} model, not a sequence classifier: "
            "point it at a *ForSequenceClassification checkpoint with num_labels=1 (a causal LM with a "
            "value head must be converted to one first)"
        )
    num_labels = len(config["id2label"]) if config.get("id2label") else config.get("num_labels")
    if num_labels is not None and num_labels != 1:
        raise ValueError(f"{key} has num_labels={num_labels}; a reward model scores with exactly one label")


def _prompt_messages(raw_prompt) -> list[dict]:
    if isinstance(raw_prompt, str):
        return [{"role": "user", "content": raw_prompt}]
    if isinstance(raw_prompt, Sequence) and all(isinstance(m, Mapping) for m in raw_prompt):
        return [dict(m) for m in raw_prompt]
    raise TypeError(f"a raw prompt must be a string or a list of chat messages, got {type(raw_prompt).__name__}")


def _prompt_text(raw_prompt) -> str:
    if isinstance(raw_prompt, str):
        return raw_prompt
    # no chat template to place the roles: the messages' contents, in order
    return "\n".join(str(m["content"]) for m in _prompt_messages(raw_prompt))


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def format_for_reward_model(tokenizer, raw_prompt, response: str) -> str:
    """The text the reward model scores for (prompt, response).

    With a chat template, the reward model's own: the prompt's messages (a plain string prompt is
    one user message) followed by the response as the assistant's message. Without one, the prompt
    text followed directly by the response (the convention of a plain-text reward model).
    """
    if has_chat_template(tokenizer):
        messages = _prompt_messages(raw_prompt) + [{"role": "assistant", "content": response}]
        return tokenizer.apply_chat_template(messages, tokenize=False)
    return _prompt_text(raw_prompt) + response


def encode_for_reward_model(tokenizer, text: str, max_length: int) -> list[int]:
    """The token ids of a formatted text, at most ``max_length`` of them.

    A longer text keeps its END: the score is read at the last token, so the response and the end
    of the conversation must survive; the start of a long prompt is what is lost. A templated text
    holds its special tokens already, so the tokenizer adds none (as the datasets encode templated
    prompts); a plain text gets the tokenizer's usual ones (e.g. BOS, lost too when truncated).
    """
    ids = tokenizer(text, add_special_tokens=not has_chat_template(tokenizer))["input_ids"]
    if not ids:
        raise ValueError(f"the reward model's tokenizer encodes {text!r} to no tokens: nothing to score")
    return list(ids[-max_length:])


def split_contiguous(num_rows: int, num_parts: int) -> list[range]:
    """``num_rows`` rows as ``num_parts`` contiguous ranges in order, sizes differing by at most one
    (the first ones larger); trailing ranges are empty when there are fewer rows than parts."""
    base, extra = divmod(num_rows, num_parts)
    bounds = [0]
    for part in range(num_parts):
        bounds.append(bounds[-1] + base + (1 if part < extra else 0))
    return [range(start, stop) for start, stop in zip(bounds, bounds[1:])]


class RewardModelClient:
    """The driver's handle on the reward-model worker group: scores (prompt, response) pairs,
    split contiguously over its ranks, and returns the scores in the order of the pairs."""

    method = "score_texts"

    def __init__(self, group):
        self.group = group

    def score_async(self, raw_prompts: Sequence, responses: Sequence[str]) -> list:
        """Dispatches the scoring and returns at once: a handle for ``collect``."""
        raw_prompts, responses = list(raw_prompts), list(responses)
        if len(raw_prompts) != len(responses):
            raise ValueError(f"reward model: {len(raw_prompts)} prompts for {len(responses)} responses")
        parts = [part for part in split_contiguous(len(responses), self.group.world_size) if len(part)]
        # empty parts are the trailing ones: only the first len(parts) ranks are called
        per_rank = [([raw_prompts[i] for i in part], [responses[i] for i in part]) for part in parts]
        return self.group.call_per_rank_async(self.method, per_rank)

    def collect(self, handle: list) -> list[float]:
        """Waits for ``score_async``'s calls; one float per response, in order."""
        return [float(score) for scores in self.group.gather(handle, self.method) for score in scores]
