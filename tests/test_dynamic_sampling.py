"""DAPO parity: dynamic sampling (algorithm.filter_groups), soft overlong punishment
(reward.overlong_buffer), and the configs/dapo.yaml recipe."""

from __future__ import annotations

import os

import pytest
import torch

from async_helpers import async_config, metrics_of
from rlflow.algos.dynamic_sampling import groups_with_variance, overlong_penalty, rows_of_groups

TRAIN_BATCH = 8  # prompts (groups) per step in tiny_overrides
N = 2


# -- the pure functions -----------------------------------------------------------------------------
def test_groups_with_variance_is_exact_equality():
    values = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.25, 0.25 + 1e-7])
    assert groups_with_variance(values, 2).tolist() == [False, True, False, True]
    assert groups_with_variance(values, 4).tolist() == [True, True]
    with pytest.raises(ValueError, match="groups of 3"):
        groups_with_variance(values, 3)


def test_rows_of_groups():
    assert rows_of_groups(torch.tensor([2, 0]), 3).tolist() == [6, 7, 8, 0, 1, 2]
    assert rows_of_groups(torch.tensor([], dtype=torch.long), 3).tolist() == []


def test_overlong_penalty_by_hand():
    # max 8, buffer 4: no penalty up to 4 tokens, then -(L - 4) / 4 * factor
    lengths = torch.tensor([0, 3, 4, 5, 6, 8])
    got = overlong_penalty(lengths, max_response_length=8, buffer_len=4, penalty_factor=0.5)
    assert got.tolist() == [0.0, 0.0, 0.0, -0.125, -0.25, -0.5]
    with pytest.raises(ValueError, match="buffer_len=9"):
        overlong_penalty(lengths, 8, 9, 1.0)


def test_concat_rollouts_pads_prompts_left_and_keeps_forwards(tiny_model_dir):
    """Batches of different prompt widths concatenate into one whose forward gives each row the
    same log-probs as its own batch did (the extra left pads are masked out)."""
    from transformers import AutoModelForCausalLM

    from rlflow.protocol import assemble_rollout, concat_rollouts, left_pad
    from workers.forward import response_log_probs

    narrow_ids, narrow_mask = left_pad([[5, 6], [7]], pad_token_id=0)
    wide_ids, wide_mask = left_pad([[5, 6, 7, 8], [9, 10, 11]], pad_token_id=0)
    narrow = assemble_rollout(narrow_ids, narrow_mask, [[12, 13], [14]], 1, 3, 0, 99)
    wide = assemble_rollout(wide_ids, wide_mask, [[15], [16, 17, 18]], 1, 3, 0, 99)
    both = concat_rollouts([narrow, wide], pad_token_id=0)
    assert both["prompts"].shape == (4, 4) and both["responses"].shape == (4, 3)
    assert both["prompts"][0].tolist() == [0, 0, 5, 6] and both["attention_mask"][0].tolist()[:4] == [0, 0, 1, 1]
    from rlflow.protocol import position_ids_from_mask

    assert torch.equal(both["position_ids"], position_ids_from_mask(both["attention_mask"]))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        whole, _ = response_log_probs(model, both, 1.0)
        parts = torch.cat([response_log_probs(model, b, 1.0)[0] for b in (narrow, wide)])
    mask = both["response_mask"].bool()
    assert torch.allclose(whole[mask], parts[mask], atol=1e-5)


# -- dynamic sampling in a run ----------------------------------------------------------------------
# the reward in the driver: the reward pool's 2 processes per fit are not what these tests are about
DRIVER_REWARD = {"reward.num_workers": 0}


def _filtered_config(model_dir, base, **extra):
    values = {"algorithm.filter_groups.enable": True, "algorithm.filter_groups.metric": "score",
              "algorithm.filter_groups.max_num_gen_batches": 6, "trainer.max_staleness": 0,
              "trainer.record_rollouts": os.path.join(base, "rec"), **DRIVER_REWARD, **extra}
    return async_config(model_dir, base, **values)


def _groups_vary(batch) -> bool:
    return bool(groups_with_variance(batch["token_level_scores"].sum(-1), N).all())


def test_dynamic_sampling_fills_exactly_train_batch_size_groups(ray_session, tiny_model_dir, tmp_path):
    """Every step trains on exactly train_batch_size groups, each with differing scores, from more
    than one generation batch where needed; each prompt at most once; the critic's BatchMeta is that
    of the filtered batch (computed after the refill)."""
    from controllers.rollout_source import read_recorded
    from trainers import CriticMetaTrainer

    base = str(tmp_path / "run")
    config = _filtered_config(tiny_model_dir, base, **{"algorithm.adv_estimator": "gae", "actor.ppo_epochs": 1, "trainer.total_steps": 3,
                                                       "critic.ppo_epochs": 1})
    trainer = CriticMetaTrainer(config)
    history = trainer.fit()
    prompts, num_gen = [], []
    for step, metrics in enumerate(history):
        batch = read_recorded(os.path.join(base, "rec"), step).batch
        assert batch.batch_size[0] == TRAIN_BATCH * N
        assert _groups_vary(batch), f"step {step + 1} trained on a group whose responses all scored alike"
        assert batch["group_index"].tolist() == [step * TRAIN_BATCH + g for g in range(TRAIN_BATCH) for _ in range(N)]
        prompts += [tuple(row[row != 0].tolist()) for row in batch["prompts"][::N]]
        num_gen.append(metrics["rollout/num_gen_batches"])
        assert 0 < metrics["rollout/kept_groups_frac"] <= 1
        meta = trainer.seen_meta[step]
        # two mini-batches of 8 a step (one epoch, dp=1: one shard each)
        assert sum(m.global_batch_size for m in meta) == int((batch["response_mask"].sum(-1) > 0).sum())
        assert sum(m.batch_num_tokens for m in meta) == int(batch["response_mask"].sum())
    assert max(num_gen) >= 2, "no step needed a refill: the test reward does not exercise dynamic sampling"
    assert len(prompts) == len(set(prompts)), "a prompt was trained on twice"


def test_dynamic_sampling_resumes_bitwise(ray_session, tiny_model_dir, tmp_path):
    """GRPO, filter_groups, max_staleness=1: a checkpoint after step 2, the actor fails in step 3, a
    new fit resumes; it equals the uninterrupted run bitwise (metrics, weights, every batch)."""
    from controllers.rollout_source import read_recorded
    from controllers.worker_group import WorkerError
    from fault_workers import faulty_workers
    from trainers import CapturingTrainer

    extra = {"trainer.save_freq": 2, "trainer.resume_mode": "auto", "trainer.max_staleness": 1, "trainer.total_steps": 3,
             "algorithm.adv_estimator": "grpo"}
    straight = CapturingTrainer(_filtered_config(tiny_model_dir, str(tmp_path / "straight"), **extra))
    want = straight.fit()
    assert max(h["rollout/num_gen_batches"] for h in want) >= 2

    base = str(tmp_path / "crashed")
    crashed = CapturingTrainer(_filtered_config(tiny_model_dir, base, **extra),
                               worker_classes=faulty_workers("actor:0:update:3:raise"))
    with pytest.raises(WorkerError, match="step 3"):
        crashed.fit()
    resumed = CapturingTrainer(_filtered_config(tiny_model_dir, base, **extra))
    got = resumed.fit()
    assert metrics_of(got) == metrics_of(want)
    for role, weights in straight.final_weights.items():
        assert all(torch.equal(t, resumed.final_weights[role][k]) for k, t in weights.items()), role
    for step in range(len(want) - 1):
        x = read_recorded(os.path.join(base, "rec"), step)
        y = read_recorded(str(tmp_path / "straight" / "rec"), step)
        assert x.batch.keys() == y.batch.keys() and all(torch.equal(x.batch[k], y.batch[k]) for k in y.batch.keys())


def test_the_cap_raises_naming_the_key_or_fills(ray_session, tiny_model_dir, tmp_path):
    """A reward that is the same for every response leaves no group: on_cap=raise stops the run
    naming the key; on_cap=fill trains on dropped groups, counted in rollout/filled_groups."""
    from rlflow import RLFlow

    constant = {"reward.custom_function.path": "null", "algorithm.filter_groups.max_num_gen_batches": 2,
                "trainer.total_steps": 1, "trainer.record_rollouts": "null", "algorithm.adv_estimator": "grpo"}
    config = _filtered_config(tiny_model_dir, str(tmp_path / "raise"), **constant)
    with pytest.raises(RuntimeError, match=r"kept 0 of the 8 groups .*max_num_gen_batches=2"):
        RLFlow(config, reward_fn=lambda *args, **kwargs: 0.5).fit()
    config = _filtered_config(tiny_model_dir, str(tmp_path / "fill"), **constant,
                              **{"algorithm.filter_groups.on_cap": "fill"})
    history = RLFlow(config, reward_fn=lambda *args, **kwargs: 0.5).fit()
    assert history[-1]["rollout/filled_groups"] == TRAIN_BATCH
    assert history[-1]["rollout/num_gen_batches"] == 2 and history[-1]["rollout/kept_groups_frac"] == 0


def test_overlong_penalty_lands_on_the_last_token(ray_session, tiny_model_dir, tmp_path):
    """reward.overlong_buffer: each recorded score is the reward plus the hand-computed penalty of
    its length, on the last response token; the metrics report it."""
    from controllers.rollout_source import read_recorded
    from rlflow import RLFlow

    base = str(tmp_path / "run")
    config = async_config(tiny_model_dir, base, **{
        "reward.custom_function.path": "null", "trainer.total_steps": 1, "trainer.max_staleness": 0,
        "algorithm.adv_estimator": "grpo", "reward.overlong_buffer.enable": True, "reward.overlong_buffer.len": 3,
        "reward.overlong_buffer.penalty_factor": 2.0, "trainer.record_rollouts": os.path.join(base, "rec"),
        **DRIVER_REWARD})
    history = RLFlow(config, reward_fn=lambda *args, **kwargs: 1.0).fit()
    batch = read_recorded(os.path.join(base, "rec"), 0).batch
    lengths = batch["response_mask"].sum(-1)
    want = [1.0 - 2.0 * max(0, length - 3) / 3 for length in lengths.tolist()]  # max_response_length 6
    scores = batch["token_level_scores"]
    assert torch.allclose(scores.sum(-1), torch.tensor(want), atol=1e-6)
    last = (lengths - 1).clamp(min=0)
    assert torch.equal(scores.sum(-1), scores[torch.arange(len(last)), last])
    assert history[-1]["reward/overlong_penalty_mean"] == pytest.approx(sum(w - 1.0 for w in want) / len(want), abs=1e-6)
    assert history[-1]["reward/overlong_frac"] == pytest.approx(sum(w < 1.0 for w in want) / len(want))
