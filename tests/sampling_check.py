"""Is a rollout engine's sampling the distribution of the weights it holds? A randomised probability
integral transform (PIT) of every sampled response token under a reference model's distribution
at the sampling temperature is uniform on [0, 1] exactly when each token was drawn from that
distribution given its prefix, independently of the draws before it; a Kolmogorov-Smirnov
distance from the uniform tests that. It checks what log-prob agreement cannot: a sampler whose
noise is biased or correlated across positions (vLLM #59786) reports the right log-probs of the
wrong tokens."""

from __future__ import annotations

import torch
from tensordict import TensorDict

# the KS distance's 0.1% critical value is 1.95 / sqrt(n); the draws are seeded, so a test is
# deterministic and this is not a flaky bound
KS_CRITICAL = 1.95


@torch.no_grad()
def response_logits(model, out: TensorDict):
    """(row, its response tokens, the logits that predict them) for each row of a rollout batch,
    the row run unpadded, so nothing depends on padding conventions."""
    width = out["prompts"].shape[1]
    for row in range(out.batch_size[0]):
        prompt = out["prompts"][row][out["attention_mask"][row, :width].bool()]
        length = int(out["response_mask"][row].sum())
        response = out["responses"][row, :length]
        ids = torch.cat([prompt, response])[None]
        yield row, response, model(input_ids=ids).logits[0, len(prompt) - 1 : -1]


@torch.no_grad()
def pit_values(model, out: TensorDict, temperature: float, seed: int = 0, rows: bool = False):
    """One value per response token (response_mask); with rows=True a list of each row's values."""
    generator = torch.Generator().manual_seed(seed)
    values = []
    for _, response, logits in response_logits(model, out):
        probs = (logits.double() / temperature).softmax(-1)
        below = (probs.cumsum(-1) - probs).gather(-1, response[:, None])[:, 0]  # mass of the tokens before
        chosen = probs.gather(-1, response[:, None])[:, 0]
        values.append(below + torch.rand(len(response), generator=generator, dtype=torch.float64) * chosen)
    return values if rows else torch.cat(values)


def ks_distance_from_uniform(values: torch.Tensor) -> float:
    u = values.sort().values
    n = len(u)
    ranks = torch.arange(1, n + 1, dtype=u.dtype)
    return float(torch.maximum(ranks / n - u, u - (ranks - 1) / n).max())


def neighbour_correlation(per_row: list[torch.Tensor]) -> tuple[float, int]:
    """The correlation of each token's PIT value with the next token's in its row, and the number
    of pairs: about N(0, 1/pairs) when the draws are independent."""
    pairs = [(row[:-1], row[1:]) for row in per_row if len(row) > 1]
    first = torch.cat([a for a, _ in pairs]) - 0.5
    second = torch.cat([b for _, b in pairs]) - 0.5
    return float((first * second).mean() / 12**-1), len(first)  # a uniform's variance is 1/12


def sampling_errors(model, out: TensorDict, temperature: float) -> tuple[float, float, int]:
    """(KS distance, its 0.1% critical value, tokens) and the neighbour correlation's z score."""
    per_row = pit_values(model, out, temperature, rows=True)
    values = torch.cat(per_row)
    correlation, pairs = neighbour_correlation(per_row)
    return ks_distance_from_uniform(values) / (KS_CRITICAL / len(values) ** 0.5), correlation * pairs**0.5, len(values)


def assert_samples_follow(model, out: TensorDict, temperature: float, what: str) -> None:
    """Asserts the PIT values of `out`'s tokens under `model` are uniform (KS distance under its
    0.1% critical value) and neighbours uncorrelated (|z| < 4)."""
    ks_fraction, z, tokens = sampling_errors(model, out, temperature)
    print(f"\n{what}: {tokens} tokens, KS distance {ks_fraction:.2f} of its 0.1% critical value, "
          f"neighbour correlation z {z:+.2f}")
    assert ks_fraction < 1 and abs(z) < 4, f"{what}: the sampled tokens do not follow the model's distribution"


@torch.no_grad()
def fixed_noise_rollout(model, batch: TensorDict, n: int, length: int, temperature: float, pad_token_id: int,
                        eos_token_id: int, seed: int = 0) -> TensorDict:
    """The bug class the check is for, as a control: a Gumbel-max sampler that draws one noise
    vector per response and reuses it at every position. Each first token is a correct draw; the
    later ones are not (the noise that chose the prefix is not independent of it)."""
    from rlflow.protocol import assemble_rollout

    generator = torch.Generator().manual_seed(seed)
    prompts = batch["input_ids"].repeat_interleave(n, 0)
    masks = batch["attention_mask"].repeat_interleave(n, 0)
    responses = []
    for ids, mask in zip(prompts, masks):
        prefix = ids[mask.bool()].tolist()
        noise = None
        response: list[int] = []
        while len(response) < length and (not response or response[-1] != eos_token_id):
            logits = model(input_ids=torch.tensor([prefix + response])).logits[0, -1].double() / temperature
            if noise is None:
                noise = -torch.log(-torch.log(torch.rand(logits.shape, generator=generator, dtype=torch.float64)))
            response.append(int((logits + noise).argmax()))
        responses.append(response)
    return assemble_rollout(batch["input_ids"], batch["attention_mask"], responses, n, length, pad_token_id,
                            eos_token_id)
