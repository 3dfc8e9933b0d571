"""Partial rollout with streamed groups (rollout.partial, workers/rollout/stream.py,
controllers/rollout_source.py StreamingQueue).

- In process, on the HF engine: a response sampled across a weight load carries, per token, the
  version that sampled it and that version's own log-prob of it.
- The batch rule on the driver: every token within trainer.max_staleness updates, first finished
  first otherwise.
- Real fits (Ray workers, tiny model): every prompt handed to the rollout group is trained exactly
  once, across a checkpoint resume too (the rule: groups still generating at the checkpoint are
  generated again from their prompts).
"""

from __future__ import annotations

import os

import pytest
import torch

# ------------------------------------------------------------------------------------------------
# in process: the stream and the engine
# ------------------------------------------------------------------------------------------------


def _hf_engine(model_dir: str, temperature: float = 1.0):
    from transformers import AutoTokenizer

    from workers.rollout.hf import HFRollout

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return HFRollout(model_dir, max_prompt_length=16, max_response_length=8, temperature=temperature,
                     pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, device="cpu")


def _log_probs_under(model, prompt: list[int], tokens: list[int], temperature: float) -> list[float]:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1: -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1).tolist()


def test_a_response_across_a_weight_load_carries_each_tokens_version_and_log_prob(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from workers.rollout.stream import GroupStream

    temperature = 0.8
    engine = _hf_engine(tiny_model_dir, temperature)
    eos = engine.eos_token_id
    logits_bias = torch.zeros(engine.model.config.vocab_size)
    logits_bias[eos] = -1e4  # no EOS: every response runs across the load
    engine.model.lm_head.bias = torch.nn.Parameter(logits_bias, requires_grad=False)
    stream = GroupStream(engine, n=2, max_rows=4, chunk_tokens=3, max_response_length=8, eos_token_id=eos,
                         do_sample=True, return_log_probs=True, seed=5)
    prompts = {0: [5, 6, 7, 8], 1: [9, 10, 11], 2: [12, 13]}  # 3 groups of 2 responses, room for 2 groups
    stream.submit(list(prompts), list(prompts.values()))
    versions_model = {0: AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()}
    versions_model[0].lm_head.bias = torch.nn.Parameter(logits_bias.clone(), requires_grad=False)
    stream.step(0)
    assert stream.unfinished() == {0: 0, 1: 0, 2: None}, "group 2 waits for room"
    # version 1: other weights, loaded between two chunks
    generator = torch.Generator().manual_seed(1)
    new_state = {k: v + 0.5 * torch.randn(v.shape, generator=generator) if v.is_floating_point() and "bias" not in k
                 else v.clone() for k, v in engine.model.state_dict().items()}
    engine.load_weights(new_state)
    versions_model[1] = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    versions_model[1].load_state_dict(new_state, strict=False)
    versions_model[1].lm_head.bias = torch.nn.Parameter(logits_bias.clone(), requires_grad=False)
    finished = []
    while stream.has_work():
        stream.step(1)
        finished += stream.take_finished()
    assert sorted(group.group for group in finished) == [0, 1, 2]
    spanning = 0
    for group in finished:
        for tokens, log_probs, versions in zip(group.responses, group.log_probs, group.versions, strict=True):
            assert len(tokens) == len(log_probs) == len(versions) == 8
            if group.group == 2:
                assert versions == [1] * 8, "started after the load"
            else:
                assert versions == [0] * 3 + [1] * 5, "one chunk under version 0, the rest under version 1"
                spanning += 1
            prompt = prompts[group.group]
            for version in set(versions):
                expected = _log_probs_under(versions_model[version], prompt, tokens, temperature)
                got = [lp for lp, v in zip(log_probs, versions) if v == version]
                want = [lp for lp, v in zip(expected, versions) if v == version]
                torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=2e-4, rtol=0)
    assert spanning == 4
    # the other version's log-probs differ: the comparison above tells the versions apart
    tokens = finished[0].responses[0]
    assert max(abs(a - b) for a, b in zip(_log_probs_under(versions_model[0], prompts[finished[0].group], tokens, temperature),
                                          _log_probs_under(versions_model[1], prompts[finished[0].group], tokens, temperature))) > 0.1


def test_hf_chunks_keep_their_cache_until_a_weight_load_and_pause_between_tokens(tiny_model_dir):
    """The HF engine's chunks: greedy chunks of 3 give one generate call's responses; a chunk after
    the first feeds one token per response (the cache kept), after a weight load the prefixes
    again; `pause` ends a chunk after the token it is asked at, for every row alike."""
    from rlflow.protocol import left_pad

    engine = _hf_engine(tiny_model_dir)
    eos = engine.eos_token_id
    logits_bias = torch.zeros(engine.model.config.vocab_size)
    logits_bias[eos] = -1e4  # no EOS: every response runs its whole length
    engine.model.lm_head.bias = torch.nn.Parameter(logits_bias, requires_grad=False)
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [15]]
    ids, mask = left_pad(prompts, engine.pad_token_id)
    greedy = dict(do_sample=False, seed=0, return_log_probs=False, temperature=1.0, top_p=1.0)
    whole, _ = engine.generate_ids(ids, mask, n=1, max_new_tokens=8, **greedy)
    fed = []
    hook = engine.model.register_forward_pre_hook(lambda _m, _a, kwargs: fed.append(tuple(kwargs["input_ids"].shape)),
                                                  with_kwargs=True)
    try:
        sequences = [list(p) for p in prompts]
        for chunk in range(3):
            if chunk == 2:
                engine.load_weights(engine.model.state_dict())
            fed.clear()
            new_tokens, _ = engine.continue_ids(sequences, max_new_tokens=3, **greedy)
            assert [len(t) for t in new_tokens] == [3] * 4
            # uncached: one forward of the prefixes but the last token (the 1-token prompt needs
            # none), then a token per step for every row
            prefill = [] if chunk == 1 else [(sum(len(s) > 1 for s in sequences), max(len(s) for s in sequences) - 1)]
            assert fed == prefill + [(4, 1)] * 3, f"chunk {chunk}"
            sequences = [s + t for s, t in zip(sequences, new_tokens, strict=True)]
        assert [s[len(p):][:8] for s, p in zip(sequences, prompts, strict=True)] == whole
        calls = [0]

        def pause():
            calls[0] += 1
            return calls[0] >= 2

        new_tokens, log_probs = engine.continue_ids(sequences, max_new_tokens=5, pause=pause,
                                                    **{**greedy, "return_log_probs": True})
        assert [len(t) for t in new_tokens] == [2] * 4 and [len(lp) for lp in log_probs] == [2] * 4
        # a response joining cached ones: its prefix is read alone, then it decodes with them
        sequences = [s + t for s, t in zip(sequences, new_tokens, strict=True)] + [prompts[0]]
        fed.clear()
        new_tokens, _ = engine.continue_ids(sequences, max_new_tokens=3, **greedy)
        assert fed == [(1, len(prompts[0]) - 1)] + [(5, 1)] * 3
        assert new_tokens[4] == whole[0][:3]
    finally:
        hook.remove()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, -1, 0.9), (1.3, 5, 1.0), (0.8, 7, 0.6)])
def test_hf_chunk_sampling_is_generates_distribution(temperature, top_k, top_p):
    """The chunks' sampler draws from what generate's warpers leave (temperature, top-k, top-p,
    in that order) and reports each token's log-prob under it."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from workers.rollout.hf import sample_next

    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(3)) * 3
    warped = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k > 0:
        warped = TopKLogitsWarper(top_k)(None, warped)
    if top_p < 1.0:
        warped = TopPLogitsWarper(top_p)(None, warped)
    expected = torch.log_softmax(warped, dim=-1)
    torch.manual_seed(0)
    draws = [sample_next(logits, do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k) for _ in range(300)]
    for tokens, log_probs in draws:
        torch.testing.assert_close(log_probs, expected.gather(-1, tokens[:, None]).squeeze(-1))
    drawn = torch.stack([tokens for tokens, _ in draws])  # [300, 6]
    assert torch.isfinite(expected.gather(-1, drawn.T)).all(), "a token the warpers drop was drawn"
    frequency = torch.zeros_like(logits).scatter_add_(1, drawn.T, torch.ones(drawn.T.shape)) / len(draws)
    assert (frequency - expected.exp()).abs().max() < 0.12
    greedy, greedy_log_probs = sample_next(logits, do_sample=False, temperature=temperature, top_p=top_p, top_k=top_k)
    assert torch.equal(greedy, logits.argmax(-1))
    torch.testing.assert_close(greedy_log_probs, torch.log_softmax(logits, -1).max(-1).values)


def test_a_finished_response_frees_its_slot_for_the_next_group(tiny_model_dir):
    """Streaming: a group that ends early makes room at once; the long one goes on."""
    from workers.rollout.stream import GroupStream

    engine = _hf_engine(tiny_model_dir)
    eos = engine.eos_token_id

    class EndsGroupZeroAtOnce:
        """The tiny engine, except that group 0's responses (prompt [5]) end with their first token."""
        temperature, top_p, eos_token_id = 1.0, 1.0, eos

        def continue_ids(self, sequences, **kwargs):
            tokens, log_probs = engine.continue_ids(sequences, **kwargs)
            tokens = [[eos] * len(t) if seq[:1] == [5] else [t_ if t_ != eos else 7 for t_ in t]
                      for seq, t in zip(sequences, tokens)]
            return tokens, log_probs

    stream = GroupStream(EndsGroupZeroAtOnce(), n=2, max_rows=4, chunk_tokens=2, max_response_length=8,
                         eos_token_id=eos, do_sample=True, return_log_probs=True, seed=0)
    stream.submit([0, 1, 2], [[5], [6, 6], [7, 7]])
    stream.step(0)
    assert [g.group for g in stream.take_finished()] == [0]
    stream.step(0)
    assert stream.unfinished() == {1: 0, 2: 0}, "group 2 took group 0's slots"
    while stream.has_work():
        stream.step(0)
    assert sorted(g.group for g in stream.take_finished()) == [1, 2]


def test_an_ended_response_frees_its_slot_before_its_group_ends_and_is_not_generated_on(tiny_model_dir):
    """One response of group 0 ends at its first token: the next chunk does not sample it again
    (nothing after its EOS) and its slot, with the one left free, takes group 2 while group 0's
    other response goes on."""
    from workers.rollout.stream import GroupStream

    engine = _hf_engine(tiny_model_dir)
    eos = engine.eos_token_id
    chunk_rows = []

    class FirstRowOfGroupZeroEnds:
        """The tiny engine, except that the prompt [5, 0] ends at once and no other response ends."""
        temperature, top_p, eos_token_id = 1.0, 1.0, eos

        def continue_ids(self, sequences, **kwargs):
            chunk_rows.append([list(seq) for seq in sequences])
            tokens, log_probs = engine.continue_ids(sequences, **kwargs)
            tokens = [[eos] * len(t) if seq[:2] == [5, 0] else [t_ if t_ != eos else 7 for t_ in t]
                      for seq, t in zip(sequences, tokens)]
            return tokens, log_probs

    stream = GroupStream(FirstRowOfGroupZeroEnds(), n=2, max_rows=5, chunk_tokens=2, max_response_length=6,
                         eos_token_id=eos, do_sample=True, return_log_probs=True, seed=0)
    stream.submit([0, 1, 2], [[5], [6, 6], [7, 7]])
    stream._admit(0)
    stream.active[0].prompt = [5, 0]  # group 0's first response: the one that ends
    stream.step(0)
    assert stream.unfinished() == {0: 0, 1: 0, 2: None}, "4 live rows + group 2's 2 > 5"
    stream.step(0)
    assert stream.unfinished() == {0: 0, 1: 0, 2: 0}, "the ended response's slot took group 2"
    assert all(seq[:2] != [5, 0] for seq in chunk_rows[1]), "an ended response was generated on"
    while stream.has_work():
        stream.step(0)
    finished = {group.group: group for group in stream.take_finished()}
    assert sorted(finished) == [0, 1, 2]
    assert finished[0].responses[0] == [eos] and len(finished[0].log_probs[0]) == len(finished[0].versions[0]) == 1
    assert all(len(response) == 6 for group in (1, 2) for response in finished[group].responses)


def test_a_call_takes_the_engine_before_the_streams_next_chunk():
    """A weight load waits for the chunk in progress, not for the stream to run out of work."""
    import threading
    import time

    from workers.rollout.stream import EngineLock

    lock, chunks, stop = EngineLock(), [0], threading.Event()

    def stream():
        while not stop.is_set():
            with lock.chunk():
                time.sleep(0.005)
                chunks[0] += 1

    thread = threading.Thread(target=stream)
    thread.start()
    try:
        for _ in range(5):
            time.sleep(0.02)
            before = chunks[0]
            with lock.call():
                assert chunks[0] - before <= 2, "the call waited more than the chunk in progress"
    finally:
        stop.set()
        thread.join()


# ------------------------------------------------------------------------------------------------
# the driver's batch rule
# ------------------------------------------------------------------------------------------------


class _Group:
    def __init__(self, uid, start_version, finish_index):
        self.uid, self.start_version, self.finish_index = uid, start_version, finish_index


def _queue(max_staleness: int, batch_size: int, batch_order: str = "finished"):
    from controllers.rollout_source import StreamingQueue
    from rlflow import load_config

    cfg = load_config(None, [f"trainer.max_staleness={max_staleness}", f"data.train_batch_size={batch_size}",
                             "rollout.partial.enable=true", f"rollout.partial.batch_order={batch_order}",
                             "actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8"])
    return StreamingQueue(cfg, loader=None, rollout_group=None, scorer=None, weight_version=lambda: 0,
                          pad_token_id=0, eos_token_id=1, total_steps=100)


def test_the_batch_takes_groups_about_to_be_too_stale_then_the_first_finished():
    queue = _queue(max_staleness=1, batch_size=2)
    # step 3: groups 0, 1 started at version 2 (due at step 3: 2 + 1); 2, 3 at version 3
    queue.ready = {0: _Group(0, 2, 9), 2: _Group(2, 3, 1), 3: _Group(3, 3, 2)}
    queue.start_versions = {1: 2}  # group 1 still generating
    assert queue._choose(3) is None, "group 1 must be in step 3's batch: wait for it"
    queue.start_versions = {}
    queue.ready[1] = _Group(1, 2, 10)
    assert [g.uid for g in queue._choose(3)] == [0, 1]
    # nothing due: the first finished, whatever their age
    queue.ready = {0: _Group(0, 3, 9), 2: _Group(2, 3, 1), 3: _Group(3, 3, 2)}
    assert [g.uid for g in queue._choose(3)] == [2, 3]
    # one due, one place left: the earliest finished of the rest
    queue.ready = {0: _Group(0, 2, 9), 2: _Group(2, 3, 4), 3: _Group(3, 3, 2)}
    assert [g.uid for g in queue._choose(3)] == [0, 3]


def test_the_batch_keeps_later_steps_within_the_bound():
    """k = 2: four groups started at version 1 cannot all wait for step 3; two must go at step 2."""
    queue = _queue(max_staleness=2, batch_size=2)
    queue.ready = {uid: _Group(uid, 1, 10 + uid) for uid in range(4)} | {9: _Group(9, 2, 0), 8: _Group(8, 2, 1)}
    picked = [g.uid for g in queue._choose(2)]
    assert picked == [0, 1], "N_1 = 4 groups at version <= 1: 4 - 1 * 2 = 2 of them now"


def test_submitted_order_takes_the_first_submitted_groups_waiting_for_a_slow_one():
    """batch_order=submitted: the batch is the untrained groups first handed out, whatever finished
    first (the finished order leans each batch to short answers: docs/results/async.md)."""
    queue = _queue(max_staleness=1, batch_size=2, batch_order="submitted")
    queue.ready = {1: _Group(1, 1, 0), 2: _Group(2, 1, 1), 3: _Group(3, 1, 2)}
    queue.in_flight = {0: None, 4: None}
    assert queue._choose(1) is None, "group 0 was submitted first and is still generating: wait for it"
    queue.in_flight = {4: None}
    queue.ready[0] = _Group(0, 1, 3)
    assert [g.uid for g in queue._choose(1)] == [0, 1]
    finished_first = _queue(max_staleness=1, batch_size=2)
    finished_first.ready = dict(queue.ready)
    assert [g.uid for g in finished_first._choose(1)] == [1, 2], "the default: the first finished"


def test_runs_with_neighbouring_seeds_draw_different_chunk_seeds():
    """The chunk seeds of trainer.seed 0 and 1, as the driver opens the stream and the stream
    steps: disjoint (a stride equal to the driver's spacing made seed 1's chunk c seed 0's c + 1)."""
    from workers.rollout.stream import GroupStream

    class Opens:
        dp_size = 1

        def call_all(self, method, version, max_rows, seed):
            self.seed = seed

    class RecordsSeeds:
        temperature, top_p = 1.0, 1.0

        def __init__(self):
            self.seeds = []

        def continue_ids(self, sequences, *, seed, max_new_tokens, **_):
            self.seeds.append(seed)
            return [[5] * max_new_tokens for _ in sequences], [[-1.0] * max_new_tokens for _ in sequences]

    drawn = []
    for trainer_seed in (0, 1):
        queue = _queue(max_staleness=1, batch_size=2)
        queue.cfg.trainer.seed = trainer_seed
        queue.rollout = Opens()
        queue._open()
        engine = RecordsSeeds()
        stream = GroupStream(engine, n=1, max_rows=1, chunk_tokens=1, max_response_length=100, eos_token_id=1,
                             do_sample=True, return_log_probs=True, seed=queue.rollout.seed)
        stream.submit([0], [[3]])
        for _ in range(100):
            stream.step(version=0)
        assert len(engine.seeds) == 100
        drawn.append(set(engine.seeds))
    assert not drawn[0] & drawn[1]


def test_partial_needs_staleness_and_names_the_keys():
    from conftest import tiny_overrides
    from rlflow import load_config
    from rlflow.config import ConfigError

    for extra, pattern in ((["trainer.max_staleness=0"], r"needs trainer\.max_staleness >= 1"),
                           (["trainer.max_staleness=1", "rollout.partial.chunk_tokens=0"], r"chunk_tokens must be >= 1"),
                           (["trainer.max_staleness=1", "rollout.partial.batch_order=shortest"],
                            r"rollout\.partial\.batch_order='shortest' is not one of finished, submitted"),
                           (["trainer.max_staleness=1", "rollout.sleep=true"], r"rollout\.sleep must be false"),
                           (["trainer.max_staleness=1", "algorithm.adv_estimator=remax"], r"greedy baseline")):
        with pytest.raises(ConfigError, match=pattern):
            load_config(None, tiny_overrides("unused", **{"rollout.partial.enable": True}) + extra)


def test_a_checkpoint_resumes_only_with_its_own_rollout_mode():
    from conftest import tiny_overrides
    from controllers.rollout_source import check_resumable
    from rlflow import load_config

    partial = load_config(None, tiny_overrides("unused", **{"rollout.partial.enable": True, "trainer.max_staleness": 1}))
    whole = load_config(None, tiny_overrides("unused", **{"trainer.max_staleness": 1}))
    streamed = {"streaming": True, "ready": [{"start_version": 3}], "regenerate": []}
    check_resumable(streamed, 4, partial)
    check_resumable([], 4, partial)  # nothing in flight: either mode
    with pytest.raises(ValueError, match=r"saved with rollout\.partial\.enable=true: resume it with rollout\.partial\.enable=true"):
        check_resumable(streamed, 4, whole)
    with pytest.raises(ValueError, match=r"resume it with rollout\.partial\.enable=false"):
        check_resumable([{"step": 4, "weight_version": 4}], 4, partial)
    with pytest.raises(ValueError, match=r"resume with trainer\.max_staleness >= 2"):
        check_resumable(streamed, 5, partial)


# ------------------------------------------------------------------------------------------------
# real fits
# ------------------------------------------------------------------------------------------------
STEPS = 3


def _partial_config(model_dir: str, out: str, record: str, **extra):
    from conftest import tiny_overrides
    from rlflow import load_config

    values = {"trainer.total_steps": STEPS, "trainer.default_local_dir": out, "trainer.record_rollouts": record,
              "algorithm.adv_estimator": "grpo", "trainer.max_staleness": 1, "rollout.partial.enable": True,
              "rollout.partial.chunk_tokens": 2, "trainer.save_freq": 1, "trainer.max_to_keep": STEPS,
              "algorithm.rollout_correction.mode": "token_tis", **extra}
    return load_config(None, tiny_overrides(model_dir, **values))


def _trained_groups(record: str, steps) -> list[int]:
    from controllers.rollout_source import read_recorded

    return [int(g) for step in steps for g in read_recorded(record, step).batch["group_index"][::2].tolist()]


@pytest.fixture(scope="module")
def partial_fit(ray_session, tiny_model_dir, tmp_path_factory):
    from rlflow import RLFlow

    base = tmp_path_factory.mktemp("partial")
    history = RLFlow(_partial_config(tiny_model_dir, str(base / "run"), str(base / "record"))).fit()
    return base, history


def test_partial_fit_trains_every_prompt_once_within_the_staleness_bound(partial_fit):
    from controllers.rollout_source import read_recorded

    base, history = partial_fit
    steps = [h for h in history if h["step"] >= 1]
    assert len(steps) == STEPS
    for h in steps:
        assert 0 <= h["rollout/staleness"] <= 1
        assert 0.0 <= h["rollout/partial_frac"] <= 1.0 and "rollout/token_staleness_mean" in h
        assert torch.isfinite(torch.tensor(h["actor/pg_loss"]))
    groups = _trained_groups(str(base / "record"), range(STEPS))
    assert sorted(groups) == list(range(STEPS * 8)), "every prompt handed out, trained once"
    for step in range(STEPS):
        batch = read_recorded(str(base / "record"), step).batch
        versions = batch["rollout_versions"][batch["response_mask"].bool()]
        assert versions.min() >= step - 1 and versions.max() <= step, "each token within max_staleness=1"
        assert (batch["rollout_log_probs"][batch["response_mask"].bool()] < 0).all()


def test_partial_resume_trains_every_prompt_once(partial_fit, tiny_model_dir, tmp_path):
    """Resumed from the step-1 checkpoint: the groups still generating then are generated again
    from their prompts; the run's prompts are each trained exactly once, none lost."""
    from rlflow import RLFlow

    base, _ = partial_fit
    step1 = os.path.join(str(base / "run"), "rlflow", "default", "checkpoints", "step_1")
    record = str(tmp_path / "record")
    history = RLFlow(_partial_config(tiny_model_dir, str(tmp_path / "run"), record,
                                     **{"trainer.resume_mode": step1})).fit()
    assert [h["step"] for h in history if h["step"] >= 2] == [2, 3]
    before = _trained_groups(str(base / "record"), [0])
    after = _trained_groups(record, [1, 2])
    assert sorted(before + after) == list(range(STEPS * 8))


def test_a_response_crosses_a_sync_through_the_workers(ray_session, tiny_model_dir, tmp_path):
    """Through Ray: the second step's groups wait after their first chunk until the first step's
    sync has landed (tests/stream_workers.py), then finish under the new weights: their tokens
    carry both versions, in order (the log-prob of each version is checked in process above)."""
    import stream_workers
    from controllers.ppo import PPOTrainer
    from controllers.rollout_source import read_recorded

    record = str(tmp_path / "record")
    cfg = _partial_config(tiny_model_dir, str(tmp_path / "run"), record,
                          **{"trainer.total_steps": 2, "trainer.save_freq": -1, "data.max_response_length": 6})
    history = PPOTrainer(cfg, worker_classes={"rollout": stream_workers.WaitsForSync}).fit()
    batch = read_recorded(record, 1).batch
    mask = batch["response_mask"].bool()
    spanning = [row for row in range(batch.batch_size[0]) if batch["rollout_versions"][row][mask[row]].unique().numel() == 2]
    assert spanning, "a response sampled by the weights of step 0 and of step 1"
    assert history[-1]["rollout/partial_frac"] == len(spanning) / batch.batch_size[0]
    for row in spanning:
        versions = batch["rollout_versions"][row][mask[row]]
        assert versions.tolist() == sorted(versions.tolist()) and set(versions.tolist()) == {0, 1}


def test_dynamic_sampling_filters_the_stream(ray_session, tiny_model_dir, tmp_path):
    """algorithm.filter_groups on the stream: a group whose responses all score the same is dropped
    as it arrives and another prompt takes its place, so every trained group varies."""
    from text_rewards import REWARD_FILE

    from controllers.rollout_source import read_recorded
    from rlflow import RLFlow

    record = str(tmp_path / "record")
    cfg = _partial_config(tiny_model_dir, str(tmp_path / "run"), record, **{
        "trainer.total_steps": 2, "trainer.save_freq": -1, "reward.custom_function.path": REWARD_FILE,
        "reward.custom_function.name": "exactness_score", "algorithm.filter_groups.enable": True,
        "algorithm.filter_groups.metric": "score", "algorithm.filter_groups.max_num_gen_batches": 10})
    history = RLFlow(cfg).fit()
    for step in range(2):
        batch = read_recorded(record, step).batch
        scores = batch["token_level_scores"].sum(-1).view(-1, 2)
        assert (scores[:, 0] != scores[:, 1]).all(), "only groups whose scores vary are trained"
        assert batch["group_index"][::2].unique().numel() == 8
    assert all(0 < h["rollout/kept_groups_frac"] <= 1 for h in history if h["step"] >= 1)
