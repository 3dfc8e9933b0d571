"""The reward model: a frozen sequence classifier that scores (prompt, response) texts."""

from __future__ import annotations

import logging

import torch

from rlflow.rewards.model import encode_for_reward_model, format_for_reward_model
from workers.precision import DTYPES
from workers.base import WorkerBase

logger = logging.getLogger(__name__)


def pad_right(rows: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows padded on the right: (input_ids, attention_mask). Right padding keeps each real
    token at the position it has in the unpadded text (no position ids to shift) and, under the
    causal mask, out of reach of the padding."""
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        attention_mask[i, :len(row)] = 1
    return input_ids, attention_mask


class RewardModelWorker(WorkerBase):
    """One rank of the reward model (reward_model.dp_size ranks, each scoring its share of rows).

    The score is the classifier's logit at the last token of the text. transformers' sequence
    classifiers (GenericForSequenceClassification and the older per-model ones) read it at the
    rightmost token that is not ``config.pad_token_id``, whatever the padding side; so the rows are
    padded on the right with exactly that id, and a padded row is read where its unpadded text is.
    (When the pad id is borrowed from eos and a text ends with eos, transformers reads that text at
    its last token that is not eos; padded or not, the score is the direct forward's.)
    """

    role = "reward_model"

    def init_distributed(self, master_addr: str, master_port: int) -> None:
        """Scoring is row-local: the ranks never communicate, so they form no process group."""

    def init_model(self, path: str) -> int:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        section = self.cfg.reward_model
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForSequenceClassification.from_pretrained(path, dtype=DTYPES[section.dtype])
        if model.config.num_labels != 1:
            raise ValueError(f"reward_model.path={path!r} has num_labels={model.config.num_labels}; "
                             "a reward model scores with exactly one label")
        self.pad_token_id = self._resolve_pad_token(tokenizer, model, path)
        model.requires_grad_(False)
        self.model = model.to(self.device).eval()
        self.tokenizer = tokenizer
        return sum(p.numel() for p in model.parameters())

    @staticmethod
    def _resolve_pad_token(tokenizer, model, path: str) -> int:
        """The pad id the tokenizer pads with and the model's last-token rule skips: the tokenizer's,
        or its eos when it has none (as for most causal-LM based reward models)."""
        if tokenizer.pad_token_id is None:
            if tokenizer.eos_token_id is None:
                raise ValueError(f"reward_model.path={path!r}: the tokenizer has neither a pad nor an eos token; "
                                 "set pad_token in its tokenizer_config.json")
            tokenizer.pad_token = tokenizer.eos_token
        text_config = model.config.get_text_config()
        if text_config.pad_token_id not in (None, tokenizer.pad_token_id):
            logger.warning("reward_model.path=%r: config.pad_token_id=%s differs from the tokenizer's pad token %s; "
                           "padding and the last-token read use the tokenizer's", path, text_config.pad_token_id,
                           tokenizer.pad_token_id)
        text_config.pad_token_id = tokenizer.pad_token_id
        model.config.pad_token_id = tokenizer.pad_token_id
        return int(tokenizer.pad_token_id)

    def score_texts(self, raw_prompts: list, responses: list[str]) -> list[float]:
        """The reward model's score of each (prompt, response), in order; texts longer than
        reward_model.max_length tokens keep their end (rlflow.rewards.model.encode_for_reward_model)."""
        section = self.cfg.reward_model
        rows = [encode_for_reward_model(self.tokenizer, format_for_reward_model(self.tokenizer, prompt, response),
                                        section.max_length)
                for prompt, response in zip(raw_prompts, responses, strict=True)]
        scores: list[float] = []
        with torch.no_grad():
            for start in range(0, len(rows), section.micro_batch_size):
                input_ids, attention_mask = pad_right(rows[start:start + section.micro_batch_size], self.pad_token_id)
                logits = self.model(input_ids=input_ids.to(self.device),
                                    attention_mask=attention_mask.to(self.device)).logits
                scores.extend(logits[:, 0].float().cpu().tolist())
        return scores
