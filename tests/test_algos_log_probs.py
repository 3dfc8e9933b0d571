"""rlflow.algos.token_log_probs against the plain autograd route (float32 cast, log_softmax, gather;
softmax and logsumexp for the entropy): values and gradients, chunked or not, at any temperature
and dtype, and each row's result independent of the rows beside it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlflow.algos.log_probs as log_probs_module
from rlflow.algos import entropy_from_logits, token_log_probs


def _plain(logits: torch.Tensor, tokens: torch.Tensor, temperature: float):
    scaled = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    log_softmax = torch.log_softmax(scaled, dim=-1)
    return log_softmax.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), entropy_from_logits(scaled)


def _values_and_grads(fn, logits, tokens, temperature, grad_log_probs, grad_entropy):
    logits = logits.detach().requires_grad_()
    log_probs, entropy = fn(logits, tokens, temperature)
    loss = (log_probs * grad_log_probs).sum()
    if grad_entropy is not None:
        loss = loss + (entropy * grad_entropy).sum()
    loss.backward()
    return log_probs.detach(), entropy.detach(), logits.grad


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 9), columns=st.integers(1, 5), vocab=st.integers(2, 40),
    temperature=st.sampled_from([0.3, 0.7, 1.0, 1.6]), chunk_elements=st.sampled_from([1, 37, 1 << 19]),
    entropy_in_loss=st.booleans(), seed=st.integers(0, 2**16),
)
def test_values_and_gradients_are_the_plain_route_s_in_float64(rows, columns, vocab, temperature, chunk_elements,
                                                               entropy_in_loss, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, columns, vocab, generator=gen, dtype=torch.float64) * 4
    tokens = torch.randint(0, vocab, (rows, columns), generator=gen)
    grad_log_probs = torch.randn(rows, columns, generator=gen, dtype=torch.float64)
    grad_entropy = torch.randn(rows, columns, generator=gen, dtype=torch.float64) if entropy_in_loss else None
    original = log_probs_module._CHUNK_ELEMENTS
    log_probs_module._CHUNK_ELEMENTS = chunk_elements  # 1 and 37: a row or a few per chunk, a ragged last chunk
    try:
        got = _values_and_grads(lambda x, t, temp: token_log_probs(x, t, temp, with_entropy=True),
                                logits, tokens, temperature, grad_log_probs, grad_entropy)
    finally:
        log_probs_module._CHUNK_ELEMENTS = original
    want = _values_and_grads(_plain, logits, tokens, temperature, grad_log_probs, grad_entropy)
    for name, got_value, want_value in zip(("log_probs", "entropy", "grad"), got, want):
        assert got_value.dtype == torch.float64, name
        torch.testing.assert_close(got_value, want_value, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_low_precision_logits_give_float32_values_and_a_gradient_in_their_dtype(dtype, temperature):
    """A real vocabulary (several chunks): float32 values, within float32 rounding of the float64
    truth (the truth taken from the same rounded logits), and the gradient in the logits' dtype."""
    gen = torch.Generator().manual_seed(0)
    vocab = 49152
    logits = (torch.randn(24, vocab, generator=gen) * 3).to(dtype)
    tokens = torch.randint(0, vocab, (24,), generator=gen)
    grad_log_probs = torch.randn(24, generator=gen)
    got_log_probs, got_entropy, got_grad = _values_and_grads(
        lambda x, t, temp: token_log_probs(x, t, temp, with_entropy=True), logits, tokens, temperature, grad_log_probs,
        None)
    want = _values_and_grads(_plain, logits.double(), tokens, temperature, grad_log_probs.double(), None)
    assert got_log_probs.dtype == got_entropy.dtype == torch.float32 and got_grad.dtype == dtype
    torch.testing.assert_close(got_log_probs.double(), want[0], rtol=0, atol=2e-5)
    torch.testing.assert_close(got_entropy.double(), want[1], rtol=0, atol=2e-5)
    # each entry of the gradient within its rounding to the logits' dtype (and float32's error in p)
    tolerance = (torch.finfo(dtype).eps + 1e-5) * want[2].abs() + 1e-12
    assert ((got_grad.double() - want[2]).abs() <= tolerance).all()


def test_a_row_s_values_do_not_depend_on_the_rows_beside_it():
    """The property the micro-batch invariance rests on: any split of the rows gives, row by row,
    the values of the whole; bitwise where the split falls on the whole's chunk boundaries, else
    within a float32 rounding (a reduction over a few rows may share its vocabulary among threads)."""
    gen = torch.Generator().manual_seed(1)
    vocab = 49152
    logits = torch.randn(40, vocab, generator=gen).to(torch.bfloat16)
    tokens = torch.randint(0, vocab, (40,), generator=gen)
    whole = token_log_probs(logits, tokens, 0.7, with_entropy=True)
    chunk = log_probs_module._chunk_rows(vocab)
    for split in ([chunk, 40 - chunk], [3, 37], [1] * 40, [11, 29]):
        parts = [token_log_probs(x, t, 0.7, with_entropy=True) for x, t in zip(logits.split(split), tokens.split(split))]
        for index, name in enumerate(("log_probs", "entropy")):
            joined = torch.cat([part[index] for part in parts])
            if split[0] == chunk:
                assert torch.equal(joined, whole[index]), name
            torch.testing.assert_close(joined, whole[index], rtol=1e-6, atol=0, msg=name)


def test_without_entropy_none_is_returned_and_the_gradient_is_the_log_prob_s():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 3, 11, generator=gen, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 11, (2, 3), generator=gen)
    log_probs, entropy = token_log_probs(logits, tokens)
    assert entropy is None and log_probs.shape == (2, 3)
    log_probs.sum().backward()
    expected = torch.nn.functional.one_hot(tokens, 11) - torch.softmax(logits.detach(), -1)
    torch.testing.assert_close(logits.grad, expected.double())
    # extreme logits stay finite: a near one-hot row has log-prob ~0 and entropy ~0
    huge = torch.tensor([[1e4, 0.0, -1e4]])
    log_prob, entropy = token_log_probs(huge, torch.tensor([0]), with_entropy=True)
    assert float(log_prob) == pytest.approx(0.0, abs=1e-6) and float(entropy) == pytest.approx(0.0, abs=1e-6)


@settings(max_examples=60, deadline=None)
@given(
    logits_rows=st.integers(1, 9), tokens_count=st.integers(1, 12), vocab=st.integers(2, 40),
    temperature=st.sampled_from([0.7, 1.0]), chunk_elements=st.sampled_from([1, 37, 1 << 19]),
    entropy_in_loss=st.booleans(), seed=st.integers(0, 2**16),
)
def test_tokens_sharing_rows_of_logits_get_the_values_and_gradients_of_a_gathered_copy(
        logits_rows, tokens_count, vocab, temperature, chunk_elements, entropy_in_loss, seed):
    """rows=: a row of logits read by several tokens (or by none) gives each of them what the plain
    route gives on logits[rows], and the gradient that the gather's backward sums into that row."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(logits_rows, vocab, generator=gen, dtype=torch.float64) * 4
    rows = torch.randint(0, logits_rows, (tokens_count,), generator=gen)
    tokens = torch.randint(0, vocab, (tokens_count,), generator=gen)
    tokens[-1] = tokens[0]  # the same token of the same row twice, where rows repeat
    rows[-1] = rows[0]
    grad_log_probs = torch.randn(tokens_count, generator=gen, dtype=torch.float64)
    grad_entropy = torch.randn(tokens_count, generator=gen, dtype=torch.float64) if entropy_in_loss else None
    original = log_probs_module._CHUNK_ELEMENTS
    log_probs_module._CHUNK_ELEMENTS = chunk_elements
    try:
        got = _values_and_grads(lambda x, t, temp: token_log_probs(x, t, temp, with_entropy=True, rows=rows),
                                logits, tokens, temperature, grad_log_probs, grad_entropy)
    finally:
        log_probs_module._CHUNK_ELEMENTS = original
    want = _values_and_grads(lambda x, t, temp: _plain(x[rows], t, temp), logits, tokens, temperature, grad_log_probs,
                             grad_entropy)
    for name, got_value, want_value in zip(("log_probs", "entropy", "grad"), got, want):
        torch.testing.assert_close(got_value, want_value, rtol=1e-10, atol=1e-10, msg=name)
    unread = torch.ones(logits_rows, dtype=torch.bool).index_fill_(0, rows, False)
    assert (got[2][unread] == 0).all()
