"""The HF engine: rollout log-probs under the distribution actually sampled from.

In process (no Ray): the engine's `rollout_log_probs` of the tokens it generated equal the actor's
log-probs of the same tokens (workers/forward.response_log_probs, the path the update uses) at the
sampling temperature, in float32 within 1e-5; with top-k they are those of the truncated,
renormalised distribution; greedy gives log_softmax of the raw logits.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from rlflow.protocol import left_pad, position_ids_from_mask
from workers.forward import response_log_probs
from workers.rollout.engine import RolloutEngine, get_engine
from workers.rollout.hf import HFRollout

TOL = 1e-5


def _prompts(vocab: int, pad: int) -> TensorDict:
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, vocab, (length,), generator=gen).tolist() for length in (5, 2, 7, 3)]
    ids, mask = left_pad(rows, pad)
    return TensorDict({"input_ids": ids, "attention_mask": mask, "position_ids": position_ids_from_mask(mask)},
                      batch_size=[len(rows)])


def _engine(model_dir: str, **sampling) -> HFRollout:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    return HFRollout(model_dir, max_prompt_length=8, max_response_length=6, seed=3,
                     pad_token_id=config.pad_token_id if config.pad_token_id is not None else config.eos_token_id,
                     eos_token_id=config.eos_token_id, **sampling)


def _masked_max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b).abs() * mask).max())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_log_probs_equal_the_actors(tiny_model_dir, temperature):
    engine = _engine(tiny_model_dir, temperature=temperature)
    out = engine.generate(_prompts(engine.model.config.vocab_size, engine.pad_token_id), n=3, do_sample=True,
                          seed=11, return_log_probs=True)
    mask = out["response_mask"]
    assert mask.sum() > 10 and out["rollout_log_probs"].shape == mask.shape
    assert torch.all(out["rollout_log_probs"][mask == 0] == 0) and torch.all(out["rollout_log_probs"][mask != 0] < 0)
    with torch.no_grad():
        actor, _ = response_log_probs(engine.model, out, temperature)
    assert _masked_max_diff(out["rollout_log_probs"], actor, mask) < TOL
    # the same call without log-probs samples the same tokens and has no such key
    plain = engine.generate(_prompts(engine.model.config.vocab_size, engine.pad_token_id), n=3, do_sample=True, seed=11)
    assert "rollout_log_probs" not in plain.keys() and torch.equal(plain["responses"], out["responses"])


def test_sampled_tokens_follow_the_models_distribution(tiny_model_dir, temperature=0.7):
    """Every sampled token's randomised PIT under the model is uniform (tests/sampling_check.py);
    a sampler that reuses one noise vector for a whole response fails the same check."""
    from sampling_check import assert_samples_follow, fixed_noise_rollout, sampling_errors

    engine = _engine(tiny_model_dir, temperature=temperature)
    prompts = _prompts(engine.model.config.vocab_size, engine.pad_token_id)
    out = engine.generate(prompts, n=128, do_sample=True, seed=5)
    assert_samples_follow(engine.model, out, temperature, f"HF generate at T={temperature}")
    biased = fixed_noise_rollout(engine.model, prompts, 128, 6, temperature, engine.pad_token_id, engine.eos_token_id)
    ks_fraction, z, _ = sampling_errors(engine.model, biased, temperature)
    print(f"one noise vector per response: KS distance {ks_fraction:.2f} of critical, neighbour correlation z {z:+.2f}")
    assert abs(z) > 4  # it fails the check the engine passes


def test_top_k_log_probs_are_the_truncated_distributions(tiny_model_dir):
    top_k, temperature = 5, 0.8
    engine = _engine(tiny_model_dir, temperature=temperature, top_k=top_k)
    out = engine.generate(_prompts(engine.model.config.vocab_size, engine.pad_token_id), n=2, do_sample=True,
                          seed=5, return_log_probs=True)
    mask = out["response_mask"]
    prompt_width = out["prompts"].shape[1]
    with torch.no_grad():
        logits = engine.model(input_ids=out["input_ids"], attention_mask=out["attention_mask"],
                              position_ids=out["position_ids"]).logits.float()
    logits = logits[:, prompt_width - 1 : prompt_width - 1 + mask.shape[1]] / temperature
    kth = logits.topk(top_k, dim=-1).values[..., -1:]
    truncated = torch.log_softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)
    expected = truncated.gather(-1, out["responses"].unsqueeze(-1)).squeeze(-1)
    assert _masked_max_diff(out["rollout_log_probs"], expected, mask) < TOL
    with torch.no_grad():
        untruncated, _ = response_log_probs(engine.model, out, temperature)
    assert _masked_max_diff(out["rollout_log_probs"], untruncated, mask) > 1e-3  # renormalised: larger


def test_greedy_log_probs_are_the_raw_logits(tiny_model_dir):
    engine = _engine(tiny_model_dir, temperature=0.5)
    out = engine.generate(_prompts(engine.model.config.vocab_size, engine.pad_token_id), n=2, do_sample=False,
                          return_log_probs=True)
    with torch.no_grad():
        actor, _ = response_log_probs(engine.model, out, 1.0)
    assert _masked_max_diff(out["rollout_log_probs"], actor, out["response_mask"]) < TOL
    assert torch.equal(out["rollout_log_probs"][0::2], out["rollout_log_probs"][1::2])  # n copies of one answer


def test_a_call_may_sample_at_another_temperature(tiny_model_dir):
    """Validation samples at rollout.val_temperature: the call's temperature is the distribution
    sampled from and scored."""
    engine = _engine(tiny_model_dir, temperature=1.0)
    prompts = _prompts(engine.model.config.vocab_size, engine.pad_token_id)
    out = engine.generate(prompts, n=2, do_sample=True, seed=5, return_log_probs=True, temperature=0.5)
    with torch.no_grad():
        at_half, _ = response_log_probs(engine.model, out, 0.5)
        at_one, _ = response_log_probs(engine.model, out, 1.0)
    mask = out["response_mask"]
    assert _masked_max_diff(out["rollout_log_probs"], at_half, mask) < TOL
    assert _masked_max_diff(out["rollout_log_probs"], at_one, mask) > 100 * TOL


def test_a_call_may_sample_at_another_top_p(tiny_model_dir):
    """Validation samples at rollout.val_top_p: a call's top_p truncates the distribution sampled
    from and scored. A tiny top_p keeps only the most likely token: greedy's tokens, log-prob 0."""
    engine = _engine(tiny_model_dir, temperature=1.0)
    prompts = _prompts(engine.model.config.vocab_size, engine.pad_token_id)
    out = engine.generate(prompts, n=2, do_sample=True, seed=5, return_log_probs=True, top_p=1e-6)
    greedy = engine.generate(prompts, n=2, do_sample=False)
    assert torch.equal(out["responses"], greedy["responses"])
    mask = out["response_mask"]
    assert float((out["rollout_log_probs"] * mask).abs().max()) < TOL
    wide = engine.generate(prompts, n=2, do_sample=True, seed=5, return_log_probs=True)  # the engine's top_p, 1.0
    assert not torch.equal(wide["responses"], greedy["responses"])


class ReversingEngine(RolloutEngine):
    """An engine from outside rlflow: 'generates' each prompt reversed, then EOS."""

    @classmethod
    def from_config(cls, model_path, cfg, *, device, seed, pad_token_id, eos_token_id):
        return cls(max_response_length=cfg.data.max_response_length, pad_token_id=pad_token_id,
                   eos_token_id=eos_token_id)

    def generate_ids(self, input_ids, attention_mask, *, n, do_sample, seed, return_log_probs, temperature, top_p,
                     max_new_tokens):
        rows = [[t for t, m in zip(ids, mask) if m][::-1] + [self.eos_token_id, 7, 7]
                for ids, mask in zip(input_ids.tolist(), attention_mask.tolist())]
        rows = [row for row in rows for _ in range(n)]
        return rows, ([[-1.0] * len(row) for row in rows] if return_log_probs else None)


def test_engines_come_from_the_registry_or_an_import_path():
    from rlflow import load_config

    assert get_engine("hf") is HFRollout
    cls = get_engine(f"{__name__}:ReversingEngine")
    assert cls is ReversingEngine
    cfg = load_config(None, [f"rollout.name={__name__}:ReversingEngine", "data.max_response_length=4"])
    engine = cls.from_config("unused", cfg, device=torch.device("cpu"), seed=0, pad_token_id=0, eos_token_id=2)
    ids, mask = left_pad([[5, 6, 9], [4]], 0)
    out = engine.generate(TensorDict({"input_ids": ids, "attention_mask": mask}, batch_size=[2]), n=2,
                          do_sample=True, return_log_probs=True)
    # the shared assembler applies the one mask rule: up to and including EOS, within the width
    assert out["responses"].tolist() == [[9, 6, 5, 2], [9, 6, 5, 2], [4, 2, 0, 0], [4, 2, 0, 0]]
    assert out["response_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 0, 0]]
    assert out["rollout_log_probs"].tolist()[2] == [-1.0, -1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="no such engine; registered: hf, vllm"):
        get_engine("sglang")
    with pytest.raises(TypeError, match="not a workers.rollout.engine.RolloutEngine subclass"):
        get_engine("workers.rollout.hf:torch")


def test_hf_engine_refuses_tensor_parallelism():
    """rollout.name=auto resolves to hf where vllm is not installed; validation cannot refuse a
    tensor_parallel_size > 1 there (it refuses rollout.name=hf), so the engine does, by name."""
    from rlflow import load_config

    cfg = load_config(None, ["rollout.name=auto", "rollout.tensor_parallel_size=2"])
    with pytest.raises(ValueError, match="tensor_parallel_size=2: the hf engine runs one model per rollout rank"):
        HFRollout.from_config("unused", cfg, device=torch.device("cpu"), seed=0, pad_token_id=0, eos_token_id=2)


def test_each_prompt_is_read_once_for_its_n_responses(tiny_model_dir):
    """The first forward reads the B prompts, not B*n rows; then one token per row and step. The
    log-probs of the shared cache's responses are the actor's (test_sampled_log_probs_equal_the_actors)."""
    engine = _engine(tiny_model_dir)
    prompts = _prompts(engine.model.config.vocab_size, engine.pad_token_id)
    fed = []
    hook = engine.model.register_forward_pre_hook(lambda _m, _a, kwargs: fed.append(tuple(kwargs["input_ids"].shape)),
                                                  with_kwargs=True)
    try:
        out = engine.generate(prompts, n=3, do_sample=True, seed=11)
    finally:
        hook.remove()
    assert fed[0] == tuple(prompts["input_ids"].shape)
    assert fed[1:] and set(fed[1:]) == {(3 * prompts.batch_size[0], 1)}
    assert len(fed) <= out["responses"].shape[1]  # the last token drawn is not fed


def test_draw_inverts_the_cdf_and_never_draws_a_cut_token(monkeypatch):
    """One uniform per row picks the token whose CDF interval holds it; a uniform at the top (u *
    total rounded up to total) still picks the last token of nonzero probability, not a cut one
    after it nor an index past the vocabulary."""
    from workers.rollout.hf import draw

    log_probs = torch.log(torch.tensor([[0.5, 0.0, 0.25, 0.25, 0.0], [0.0, 1.0, 0.0, 0.0, 0.0]]))
    for uniform, expected in ((0.0, [0, 1]), (0.49, [0, 1]), (0.5, [2, 1]), (0.74, [2, 1]), (0.75, [3, 1]),
                              (1 - 2 ** -53, [3, 1]), (1.0, [3, 1])):
        monkeypatch.setattr(torch, "rand", lambda *shape, uniform=uniform, **kw: torch.full(*shape, uniform, **kw))
        assert draw(log_probs).tolist() == expected, uniform
    monkeypatch.undo()
    # 20k draws from one row: frequencies within 4 sigma of the probabilities
    probs = torch.tensor([0.05, 0.0, 0.6, 0.2, 0.15])
    torch.manual_seed(0)
    drawn = draw(probs.log().expand(20000, -1))
    frequency = torch.bincount(drawn, minlength=5).double() / drawn.numel()
    sigma = (probs.double() * (1 - probs.double()) / drawn.numel()).sqrt()
    assert frequency[1] == 0 and bool(((frequency - probs.double()).abs() <= 4 * sigma + 1e-12).all()), frequency


def test_grouped_query_attention_keeps_its_kv_heads_and_its_outputs(tiny_model_dir):
    """On CPU the engine's model (2 K/V heads for 4 query heads) runs grouped_sdpa: under the mask of
    left-padded prompts and in the decode loop the same responses and log-probs as transformers' sdpa,
    bitwise, without copying K and V to every query head."""
    from transformers.integrations import sdpa_attention

    from workers.rollout.hf import GROUPED_SDPA

    engine = _engine(tiny_model_dir)
    assert engine.model.config.num_key_value_heads < engine.model.config.num_attention_heads
    assert engine.model.config._attn_implementation == GROUPED_SDPA
    prompts = _prompts(engine.model.config.vocab_size, engine.pad_token_id)
    copies = []
    original_repeat_kv = sdpa_attention.repeat_kv
    sdpa_attention.repeat_kv = lambda hidden, n_rep: copies.append(n_rep) or original_repeat_kv(hidden, n_rep)
    try:
        grouped = engine.generate(prompts, n=3, do_sample=True, seed=11, return_log_probs=True)
        assert not copies
        engine.model.set_attn_implementation("sdpa")
        plain = engine.generate(prompts, n=3, do_sample=True, seed=11, return_log_probs=True)
        assert copies  # transformers' sdpa copies under a mask
    finally:
        sdpa_attention.repeat_kv = original_repeat_kv
    assert torch.equal(grouped["responses"], plain["responses"])
    assert torch.equal(grouped["rollout_log_probs"], plain["rollout_log_probs"])
