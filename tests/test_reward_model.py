"""The reward-model role: a sequence classifier scores decoded responses with its own tokenizer and
chat template, and its scores equal a direct HF forward of the same text; a run's scores are
reward.rule_weight * rule + reward_model.weight * model. The tiny reward model is built locally
(tests/tiny_reward_model.py)."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_overrides
from rlflow import RLFlow, load_config
from rlflow.rewards.model import (RewardModelClient, check_reward_model_folder, format_for_reward_model,
                                  split_contiguous)

TASK = "reverse"


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory) -> str:
    from tiny_reward_model import build_tiny_reward_model

    return build_tiny_reward_model(tmp_path_factory.mktemp("tiny_reward_model"))


@pytest.fixture(scope="module")
def reference(reward_model_dir):
    """The reward model and its tokenizer, loaded in this process: the direct HF forward."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir).eval()
    return model, AutoTokenizer.from_pretrained(reward_model_dir)


def direct_score(reference, raw_prompt, response: str, max_length: int) -> float:
    """One text at a time, unpadded: the logit of its last max_length tokens."""
    model, tokenizer = reference
    ids = tokenizer(format_for_reward_model(tokenizer, raw_prompt, response), add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids[-max_length:]])).logits[0, 0].item()


def _rm_overrides(model_dir: str, reward_model_dir: str, **extra) -> list[str]:
    return tiny_overrides(model_dir, **{"reward_model.enable": True, "reward_model.path": reward_model_dir, **extra})


# -- formatting and the folder check -------------------------------------------------------------------


def test_format_uses_the_reward_models_own_chat_template(reference, tiny_model_dir):
    from transformers import AutoTokenizer

    _, rm_tokenizer = reference
    assert format_for_reward_model(rm_tokenizer, "123=", "321") == "[user]: 123=\n[assistant]: 321\n[score]"
    messages = [{"role": "system", "content": "reverse"}, {"role": "user", "content": "123="}]
    assert (format_for_reward_model(rm_tokenizer, messages, "321")
            == "[system]: reverse\n[user]: 123=\n[assistant]: 321\n[score]")
    # without a template of its own: the prompt text, then the response
    plain = AutoTokenizer.from_pretrained(tiny_model_dir)
    plain.chat_template = None  # (the tiny tokenizer ships one: rlflow.tiny.CHAT_TEMPLATE)
    assert format_for_reward_model(plain, "123=", "321") == "123=321"
    assert format_for_reward_model(plain, messages, "321") == "reverse\n123=321"
    # the template's text is byte-level BPE: it round-trips, nothing becomes unknown
    text = format_for_reward_model(rm_tokenizer, messages, "321")
    assert rm_tokenizer.decode(rm_tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_the_folder_check_names_the_key(reward_model_dir, tiny_model_dir, tmp_path):
    check_reward_model_folder(reward_model_dir)
    with pytest.raises(FileNotFoundError, match=r"reward_model.path='.*missing' is not a folder"):
        check_reward_model_folder(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match=r"reward_model.path=.* has no config.json"):
        check_reward_model_folder(str(tmp_path))
    with pytest.raises(ValueError, match=r"reward_model.path=.*Qwen2ForCausalLM.*not a sequence classifier"):
        check_reward_model_folder(tiny_model_dir)


def test_rows_split_contiguously_over_ranks():
    assert split_contiguous(7, 2) == [range(0, 4), range(4, 7)]
    assert split_contiguous(1, 3) == [range(0, 1), range(1, 1), range(1, 1)]
    assert split_contiguous(0, 2) == [range(0, 0), range(0, 0)]


def test_a_causal_lm_reward_model_fails_before_ray_starts(tiny_model_dir, tmp_path, monkeypatch):
    import controllers.cluster

    def ensure_ray(*args, **kwargs):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(controllers.cluster, "ensure_ray", ensure_ray)
    causal_lm = tiny_model_dir
    cfg = load_config(None, _rm_overrides(tiny_model_dir, causal_lm, **{"trainer.default_local_dir": str(tmp_path)}))
    with pytest.raises(ValueError, match=r"reward_model.path=.*not a sequence classifier"):
        RLFlow(cfg).fit()


# -- the worker group against a direct forward ---------------------------------------------------------


@pytest.fixture
def reward_model_group(ray_session, reward_model_dir, tiny_model_dir):
    from controllers.worker_group import RayWorkerGroup, ResourcePool
    from workers.reward_model import RewardModelWorker

    # micro-batches of 3 mix lengths (padding matters); 48 tokens cut the long texts
    cfg = load_config(None, _rm_overrides(tiny_model_dir, reward_model_dir, **{
        "reward_model.dp_size": 2, "reward_model.micro_batch_size": 3, "reward_model.max_length": 48}))
    pool = ResourcePool(2, 1, name="reward_model_test")
    group = RayWorkerGroup(RewardModelWorker, "reward_model", 2, cfg, pool, num_cpus=1)
    group.call_all("init_model", reward_model_dir)
    yield group, cfg.reward_model.max_length
    group.kill()
    pool.remove()


@pytest.mark.timeout(300)
def test_scores_equal_a_direct_hf_forward_of_each_text(reward_model_group, reference):
    group, max_length = reward_model_group
    client = RewardModelClient(group)
    prompts = ["1=", "12345=", [{"role": "system", "content": "reverse"}, {"role": "user", "content": "987="}],
               "5=", "1234567890123=", "42=", "7="]
    responses = ["1", "54321", "789", "", "3210987654321 and more to read", "24", "7" * 20]
    _, tokenizer = reference
    lengths = [len(tokenizer(format_for_reward_model(tokenizer, p, r), add_special_tokens=False)["input_ids"])
               for p, r in zip(prompts, responses)]
    assert len(set(lengths)) == len(lengths) and any(n > max_length for n in lengths) and min(lengths) < max_length
    expected = [direct_score(reference, p, r, max_length) for p, r in zip(prompts, responses)]
    scores = client.collect(client.score_async(prompts, responses))  # 4 rows on rank 0, 3 on rank 1
    assert scores == pytest.approx(expected, abs=1e-5, rel=0)
    assert len({round(s, 4) for s in scores}) == len(scores), "the texts' scores differ: the check is not vacuous"
    # fewer rows than ranks: only rank 0 is called; no rows, no call
    one = client.score_async(prompts[1:2], responses[1:2])
    assert len(one) == 1 and client.collect(one) == pytest.approx(expected[1:2], abs=1e-5, rel=0)
    assert len(client.score_async([], [])) == 0 and client.collect([]) == []


# -- a run -------------------------------------------------------------------------------------------


def dense_rule(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """The synthetic task's rule plus a length term: the untrained tiny policy earns no rule reward,
    and a rule that is 0 everywhere would leave reward.rule_weight unchecked."""
    from rlflow.rewards import compute_score

    return 0.25 + 0.1 * len(solution_str) + compute_score(data_source, solution_str, ground_truth)["score"]


@pytest.mark.timeout(600)
def test_a_run_trains_on_the_weighted_rule_and_model_scores(ray_session, tiny_model_dir, reward_model_dir,
                                                              reference, tmp_path):
    """The recording holds each step's batch; its prompts decode back to the rows given in memory
    (the tiny tokenizer round-trips text, and the policy has no chat template: the raw prompt is the
    row's prompt), which give each response's ground truth."""
    from controllers.setup import load_tokenizer
    from controllers.rollout_source import read_recorded, recorded_steps
    from rlflow.data.synthetic import make_synthetic_rows

    rows = make_synthetic_rows(TASK, 32, 0, split="train")
    record = str(tmp_path / "rollouts")
    cfg = load_config(None, _rm_overrides(tiny_model_dir, reward_model_dir, **{
        "reward.rule_weight": 0.5, "reward_model.weight": 2.0, "reward_model.dp_size": 2,
        "reward_model.micro_batch_size": 3, "reward.num_workers": 0, "algorithm.adv_estimator": "grpo",
        "trainer.record_rollouts": record, "trainer.default_local_dir": str(tmp_path)}))
    history = RLFlow(cfg, train_dataset=rows, reward_fn=dense_rule).fit()
    assert len([h for h in history if "actor/pg_loss" in h]) == 2
    assert sorted(recorded_steps(record)) == [0, 1]

    policy_tokenizer = load_tokenizer(tiny_model_dir)
    row_of_prompt = {row["prompt"]: row for row in rows}

    def decode(ids, mask):  # as the Scorer decodes
        return policy_tokenizer.decode(ids[mask.bool()].tolist(), skip_special_tokens=True)

    for step in (0, 1):
        batch = read_recorded(record, step).batch
        width = batch["prompts"].shape[1]
        for i in range(batch.batch_size[0]):
            row = row_of_prompt[decode(batch["prompts"][i], batch["attention_mask"][i, :width])]
            response = decode(batch["responses"][i], batch["response_mask"][i])
            rule = dense_rule(row["data_source"], response, row["reward_model"]["ground_truth"])
            model = direct_score(reference, row["prompt"], response, cfg.reward_model.max_length)
            score = batch["token_level_scores"][i].sum().item()
            assert score == pytest.approx(0.5 * rule + 2.0 * model, abs=1e-5, rel=0), (step, i)
            assert batch["rule_scores"][i].item() == pytest.approx(rule, abs=1e-6)
            assert batch["rm_scores"][i].item() == pytest.approx(model, abs=1e-5)
        metrics = history[step + 1] if history[0].get("step") == 0 else history[step]
        assert metrics["reward/rule_score_mean"] == pytest.approx(batch["rule_scores"].mean().item(), abs=1e-6)
        assert metrics["reward/rm_score_mean"] == pytest.approx(batch["rm_scores"].mean().item(), abs=1e-6)
