"""Per-token log-probabilities and entropy of the sampling distribution softmax(logits / T).

The plain autograd route (cast the logits to float32, log_softmax, gather; softmax and logsumexp
for the entropy) writes several [tokens, vocab] float32 tensors and keeps them for the backward.
`token_log_probs` computes the same values a few rows at a time, so that each pass over the
vocabulary stays in the cache, keeps only the logits (in their own dtype) and two floats per row
for the backward, and returns the logits' gradient in their own dtype. Its values and gradients
are the plain route's up to float rounding; each row's result depends on that row alone, so how a
batch is split into micro-batches changes it by float rounding at most (docs/EXACTNESS.md).

With `rows`, several tokens may share a row of logits (the shared-prompt forward: a prompt's last
column predicts the first token of each of its responses), so that no [tokens, vocab] copy of the
logits is gathered for them.
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
    def forward(ctx, logits: torch.Tensor, tokens: torch.Tensor, temperature: float, with_entropy: bool,
                token_rows: torch.Tensor | None):
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
        if token_rows is None:
            chosen = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
            log_probs = _scaled(chosen, temperature) - log_normalizer
        else:
            chosen = logits[token_rows, tokens]
            log_probs = _scaled(chosen, temperature) - log_normalizer[token_rows]
        ctx.save_for_backward(logits, tokens, log_normalizer, entropy, token_rows)
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)
        # entropy unfilled without with_entropy; the caller drops it
        return log_probs, entropy if token_rows is None else entropy[token_rows]

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        logits, tokens, log_normalizer, entropy, token_rows = ctx.saved_tensors
        temperature = ctx.temperature
        if token_rows is not None:  # per row of logits: the sums over its tokens, and its tokens in row order
            grad_log_probs, grad_entropy, tokens_of = _per_logits_row(
                logits.shape[0], token_rows, tokens, grad_log_probs, grad_entropy)
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
                if token_rows is None:
                    grad.scatter_add_(-1, tokens[rows, None], grad_log_probs[rows, None])
                else:
                    chunk_rows, chunk_tokens, chunk_grads = tokens_of(start, start + grad.shape[0])
                    grad.index_put_((chunk_rows - start, chunk_tokens), chunk_grads, accumulate=True)
            if temperature != 1.0:
                grad.div_(temperature)
            grad_logits[rows] = grad
        return grad_logits, None, None, None, None


def _per_logits_row(num_rows: int, token_rows: torch.Tensor, tokens: torch.Tensor, grad_log_probs, grad_entropy):
    """The backward's inputs per row of logits when tokens share rows: each row's summed gradients
    (zero for a row no token reads), and a function giving the (row, token, gradient) of the tokens
    whose rows fall in [start, end)."""
    def summed(grad):
        if grad is None:
            return None
        return grad.new_zeros(num_rows).index_add_(0, token_rows, grad)

    order = torch.argsort(token_rows, stable=True)
    sorted_rows = token_rows[order]
    sorted_tokens = tokens[order]
    sorted_grads = None if grad_log_probs is None else grad_log_probs[order]

    def tokens_of(start: int, end: int):
        first, last = torch.searchsorted(sorted_rows, torch.tensor([start, end], device=sorted_rows.device)).tolist()
        return sorted_rows[first:last], sorted_tokens[first:last], sorted_grads[first:last]

    return summed(grad_log_probs), summed(grad_entropy), tokens_of


def token_log_probs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(token), entropy of p or None), each [...] in float32 (float64 for float64 logits), for
    p = softmax(logits / temperature) over the last axis of logits [..., vocab] and tokens [...]
    (long). With rows ([...] long, the shape of tokens), logits is [N, vocab] and each token's
    distribution is that of its row of logits, rows[...] (any row read by any number of tokens).
    Both are differentiable."""
    leading = tokens.shape
    flat_logits = logits.reshape(-1, logits.shape[-1])
    token_rows = None if rows is None else rows.reshape(-1)
    log_probs, entropy = _TokenLogProbs.apply(flat_logits, tokens.reshape(-1), float(temperature), with_entropy,
                                              token_rows)
    return log_probs.view(leading), entropy.view(leading) if with_entropy else None
