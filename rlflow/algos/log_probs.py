"""Per-token log-probabilities and entropy of the sampling distribution softmax(logits / T).

The plain autograd route (cast the logits to float32, log_softmax, gather; softmax and logsumexp
for the entropy) writes several [tokens, vocab] float32 tensors and keeps them for the backward.
`token_log_probs` computes the same values a few rows at a time, so that each pass over the
vocabulary stays in the cache, keeps only the logits (in their own dtype) and two floats per row
for the backward, and returns the logits' gradient in their own dtype. Its values and gradients
are the plain route's up to float rounding; each row's result depends on that row alone, so how a
batch is split into micro-batches changes it by float rounding at most (docs/EXACTNESS.md).
"""

from __future__ import annotations

import torch

# rows per chunk: about 2 MB of float32 per pass, a size that stays in a core's cache
_CHUNK_ELEMENTS = 1 << 19


def _chunk_rows(vocab: int) -> int:
    return max(1, _CHUNK_ELEMENTS // vocab)


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """A copy of logits / temperature in float32 or wider (a copy always: callers write into it)."""
    scaled = logits.to(torch.promote_types(logits.dtype, torch.float32), copy=True)
    return scaled if temperature == 1.0 else scaled.div_(temperature)


class _TokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, tokens: torch.Tensor, temperature: float, with_entropy: bool):
        rows, vocab = logits.shape
        wide = torch.promote_types(logits.dtype, torch.float32)
        log_normalizer = logits.new_empty(rows, dtype=wide)
        entropy = logits.new_empty(rows, dtype=wide)
        step = _chunk_rows(vocab)
        for start in range(0, rows, step):
            shifted = _scaled(logits[start : start + step], temperature)
            row_max = shifted.amax(dim=-1, keepdim=True)
            shifted.sub_(row_max)
            exp_shifted = shifted.exp()
            partition = exp_shifted.sum(dim=-1)
            log_partition = partition.log()
            log_normalizer[start : start + step] = row_max.squeeze(-1) + log_partition
            if with_entropy:  # H = log Z - E_p[z], both taken about the row's max
                expected = (exp_shifted * shifted).sum(dim=-1) / partition
                entropy[start : start + step] = log_partition - expected
        chosen = _scaled(logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), temperature)
        log_probs = chosen - log_normalizer
        ctx.save_for_backward(logits, tokens, log_normalizer, entropy)
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)
        return log_probs, entropy  # entropy unfilled without with_entropy; the caller drops it

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        logits, tokens, log_normalizer, entropy = ctx.saved_tensors
        temperature = ctx.temperature
        grad_logits = torch.empty_like(logits)
        step = _chunk_rows(logits.shape[1])
        for start in range(0, logits.shape[0], step):
            rows = slice(start, start + step)
            log_p = _scaled(logits[rows], temperature).sub_(log_normalizer[rows, None])
            # d log p_t / dz = onehot(t) - p;  dH / dz = -p * (log p + H)
            if grad_entropy is None:
                grad = log_p.exp_().mul_(-grad_log_probs[rows, None])
            else:
                scale = log_p.add(entropy[rows, None]).mul_(-grad_entropy[rows, None])
                if grad_log_probs is not None:
                    scale.sub_(grad_log_probs[rows, None])
                grad = log_p.exp_().mul_(scale)
            if grad_log_probs is not None:
                grad.scatter_add_(-1, tokens[rows, None], grad_log_probs[rows, None])
            if temperature != 1.0:
                grad.div_(temperature)
            grad_logits[rows] = grad
        return grad_logits, None, None, None


def token_log_probs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(token), entropy of p or None), each [...] in float32 (float64 for float64 logits), for
    p = softmax(logits / temperature) over the last axis of logits [..., vocab] and tokens [...]
    (long). Both are differentiable."""
    leading = tokens.shape
    flat_logits = logits.reshape(-1, logits.shape[-1])
    log_probs, entropy = _TokenLogProbs.apply(flat_logits, tokens.reshape(-1), float(temperature), with_entropy)
    return log_probs.view(leading), entropy.view(leading) if with_entropy else None
