"""The judge reward (rlflow/rewards/judge.py): verdicts parsed to scores, the tiny model as a real
judge in the reward pool's processes, a hung judge call stopped at reward.timeout_s under both
error policies, the config's checks before Ray starts, and a real fit trained on the judge's scores."""

from __future__ import annotations

import math
import os

import pytest

from conftest import tiny_overrides
from rlflow.config import ConfigError, load_config, to_dataclass
from rlflow.rewards import RewardError
from rlflow.rewards.judge import DEFAULT_TEMPLATE, JudgeReward, check_judge, default_parser, fill_template, load_parser

HELPERS = os.path.join(os.path.dirname(__file__), "judge_helpers.py")


@pytest.mark.parametrize("verdict, score", [
    ("The answer is right. Rating: [[8]]", 8.0),
    ("first [[3]] then, on reflection, [[9]]", 9.0),  # the last bracketed score wins
    ("[[ 7.5 ]]", 7.5),
    ("[[6/10]]", 6.0),
    ("Score: 4", 4.0),
    ("my rating is 2.5 out of 10", 2.5),
    ("Rating: **9**", 9.0),
    ("Yes, it is correct.", 1.0),
    ("no", 0.0),
    ("  0.75 ", 0.75),
    ("-1", -1.0),
    ("I cannot decide.", None),
    ("", None),
    ("the response lists 3 apples and 4 pears", None),  # stray numbers are not a verdict
    ("yesterday it rained", None),
])
def test_judge_default_parser_reads_canned_verdicts(verdict, score):
    assert default_parser(verdict) == score


def test_judge_template_and_parser_specs(tmp_path):
    text = fill_template("Q: {prompt}\nA: {response}\nRef: {ground_truth} {json: 1}", "2+2?", "it is {prompt}", None)
    assert text == "Q: 2+2?\nA: it is {prompt}\nRef: (none) {json: 1}"  # one pass; other braces kept
    assert "[[" in DEFAULT_TEMPLATE and all(p in DEFAULT_TEMPLATE for p in ("{prompt}", "{response}", "{ground_truth}"))
    assert load_parser("") is default_parser
    assert load_parser(f"{HELPERS}:verdict_length")("abc") == 3.0
    assert load_parser("rlflow.rewards.judge:default_parser") is default_parser
    with pytest.raises(ImportError, match=r"reward.judge.parser='nope.py:f': cannot import nope.py"):
        load_parser("nope.py:f")
    with pytest.raises(AttributeError, match="defines no function 'missing'"):
        load_parser(f"{HELPERS}:missing")
    with pytest.raises(ValueError, match="must be module:function"):
        load_parser("just_a_name")


def test_judge_config_errors_name_the_key(tiny_model_dir, tmp_path):
    def error(*overrides):
        with pytest.raises(ConfigError) as info:
            cfg = load_config(None, ["reward.judge.enable=true", *overrides])
            check_judge(to_dataclass(cfg))
        assert "\n" not in str(info.value)
        return str(info.value)

    assert "reward.judge.model_path" in error()
    good = f"reward.judge.model_path={tiny_model_dir}"
    assert error(good, "reward.judge.engine=sglang").startswith("reward.judge.engine='sglang'")
    assert error(good, "reward.judge.max_new_tokens=0").startswith("reward.judge.max_new_tokens must be >= 1")
    assert error(good, "reward.judge.temperature=-1").startswith("reward.judge.temperature must be >= 0")
    assert error(good, "reward.judge.num_workers=0").startswith("reward.judge.num_workers must be >= 1")
    assert error(good, "reward.judge.template='rate {prompt}'").startswith("reward.judge.template has no {response}")
    assert error(good, "reward.judge.dtype=int8").startswith("reward.judge.dtype='int8'")
    assert error(f"reward.judge.model_path={tmp_path}/none").startswith("reward.judge.model_path=")
    assert "reward.judge.template_file=" in error(good, f"reward.judge.template_file={tmp_path}/none.txt")
    assert error(good, "reward.judge.parser=nope.py:f").startswith("reward.judge.parser='nope.py:f'")
    no_response = tmp_path / "judge.txt"
    no_response.write_text("rate {prompt}")
    assert error(good, f"reward.judge.template_file={no_response}").startswith("reward.judge.template_file has no")
    # the rule may be off with a judge on; the judge's template file and parser reach the judge
    no_response.write_text("R: {response}")
    cfg = to_dataclass(load_config(None, ["reward.judge.enable=true", good, "reward.rule_weight=0",
                                          f"reward.judge.template_file={no_response}",
                                          f"reward.judge.parser={HELPERS}:no_score"]))
    judge = check_judge(cfg)
    assert judge.template == "R: {response}" and judge.parser.endswith("judge_helpers.py:no_score")


def test_judge_tiny_model_through_the_pool_parses_times_out_and_follows_on_error(ray_session, tiny_model_dir):
    """The tiny model judges in a pool process (loaded once); its verdicts equal the same judge's in
    this process, parsed or an error; scripted verdicts parse; a hung call is stopped at
    reward.timeout_s and its process replaced; on_error=zero counts the errors, raise names them."""
    from judge_helpers import ScriptedJudge
    from rlflow.rewards.pool import RewardPool

    kwargs = dict(model_path=tiny_model_dir, engine="hf", max_prompt_length=256, max_new_tokens=6)
    local = JudgeReward(**kwargs).load_in_process()
    # two processes: the second judges on while the first hangs (and is replaced)
    pool = RewardPool(num_workers=2, timeout_s=1.0, on_error="zero", fn=ScriptedJudge(**kwargs), label="judge")
    try:
        real = ["4", "five", "2 + 2 = 4"]
        responses = real + ["CANNED:Rating: [[7]]", "CANNED:yes", "CANNED:I cannot tell", "HANG", "4"]
        n = len(responses)
        scores, _, num_errors = pool.score_batch(responses, ["synthetic/x"] * n, ["4"] * n,
                                                 [{"prompt": "What is 2+2?", "extra_info": None}] * n)
        expected, errors = [], 0
        for response in real + ["4"]:
            value = default_parser(local.verdict(fill_template(local.template, "What is 2+2?", response, "4")))
            expected.append(0.0 if value is None else value)
            errors += value is None
        assert scores[:3] == expected[:3] and scores[7] == expected[3]
        assert scores[3:7] == [7.0, 1.0, 0.0, 0.0]
        assert num_errors == errors + 2  # the unparsable verdict and the hang
        assert pool.num_replaced == 1  # the hung process was killed and replaced

        # the Scorer: rule_weight * rule + judge_weight * judge on each response's last token, the
        # judge's errors counted with the rule's and flagged per sample (reward/judge_error_frac)
        _check_the_scorer(pool, tiny_model_dir)

        pool.on_error = "raise"
        with pytest.raises(RewardError, match=r"judge failed on sample 1 .*JudgeVerdictError: the judge's "
                                              r"verdict gave no score \(parser returned None\): 'unclear'"):
            pool.score_batch(["CANNED:[[2]]", "CANNED:unclear"], ["s"] * 2, ["4"] * 2, [{"prompt": "q"}] * 2)
        with pytest.raises(RewardError, match=r"judge did not return within reward.timeout_s=1 s"):
            pool.score_batch(["HANG"], ["s"], ["4"], [{"prompt": "q"}])
    finally:
        pool.close()
    assert math.isfinite(sum(scores))


def _check_the_scorer(pool, tiny_model_dir):
    from types import SimpleNamespace

    import torch
    from tensordict import TensorDict

    from controllers.rollout_source import Scorer, attach_scores
    from controllers.setup import load_tokenizer
    from rlflow.rewards import RewardManager

    tokenizer = load_tokenizer(tiny_model_dir)
    texts = ["CANNED:Rating: [[7]]", "CANNED:yes", "CANNED:unclear"]
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    width = max(map(len, ids)) + 2
    responses = torch.tensor([row + [tokenizer.pad_token_id] * (width - len(row)) for row in ids])
    mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in ids])
    rows = {"data_source": ["s"] * 3, "ground_truth": ["4"] * 3, "extra_info": [None] * 3,
            "source_prompt": [{"prompt": "What is 2+2?"}] * 3}
    rule = RewardManager(lambda ds, text, truth, extra=None: float(len(text)), on_error="zero")
    scorer = Scorer(tokenizer, rule, rule_weight=0.5, judge=pool, judge_weight=0.25)
    token_scores, extras = scorer(TensorDict({"responses": responses, "response_mask": mask}, batch_size=[3]), rows)
    last = [len(row) - 1 for row in ids]
    assert [token_scores[i, last[i]].item() for i in range(3)] == [0.5 * len(t) + 0.25 * j for t, j in
                                                                   zip(texts, [7.0, 1.0, 0.0])]
    assert token_scores.sum().item() == pytest.approx(sum(0.5 * len(t) for t in texts) + 0.25 * 8.0)
    assert extras["judge_score"] == [7.0, 1.0, 0.0] and extras["judge_error"] == [0.0, 0.0, 1.0]
    assert extras["rule_score"] == [float(len(t)) for t in texts] and extras["num_reward_errors"] == 1
    batch = TensorDict({"response_mask": mask}, batch_size=[3])
    attach_scores(SimpleNamespace(reward=SimpleNamespace(overlong_buffer=SimpleNamespace(enable=False))), batch,
                  token_scores, extras)
    assert batch["judge_errors"].tolist() == [0.0, 0.0, 1.0] and batch["judge_scores"].tolist() == [7.0, 1.0, 0.0]


@pytest.mark.timeout(300)
def test_judge_fit_trains_on_the_weighted_rule_and_judge_scores(ray_session, tiny_model_dir, tmp_path):
    """One GRPO step with the tiny model judging (default template, a parser file that always
    scores): each recorded score is rule_weight * rule + judge.weight * the judge's parsed verdict,
    recomputed here with the same judge."""
    from controllers.rollout_source import read_recorded
    from controllers.setup import load_tokenizer
    from rlflow import RLFlow
    from rlflow.data.synthetic import make_synthetic_rows

    record = str(tmp_path / "rollouts")
    cfg = load_config(None, tiny_overrides(tiny_model_dir, **{
        "trainer.total_steps": 1, "data.train_batch_size": 4, "algorithm.adv_estimator": "grpo",
        "reward.rule_weight": 0.5,
        "reward.judge.enable": True, "reward.judge.model_path": tiny_model_dir, "reward.judge.engine": "hf",
        "reward.judge.max_new_tokens": 3, "reward.judge.weight": 0.25,
        "reward.judge.parser": f"{HELPERS}:verdict_length",
        "trainer.record_rollouts": record, "trainer.default_local_dir": str(tmp_path)}))
    rows = make_synthetic_rows(cfg.data.synthetic_task, 16, 0, split="train")
    history = RLFlow(cfg, train_dataset=rows).fit()
    step = [h for h in history if "actor/pg_loss" in h]
    assert len(step) == 1 and step[0]["reward/judge_score_mean"] > 0 and "reward/num_errors" not in step[0]
    assert step[0]["reward/judge_error_frac"] == 0

    judge = check_judge(to_dataclass(cfg)).load_in_process()
    tokenizer = load_tokenizer(tiny_model_dir)
    row_of_prompt = {row["prompt"]: row for row in rows}

    def decode(ids, mask):  # as the Scorer decodes
        return tokenizer.decode(ids[mask.bool()].tolist(), skip_special_tokens=True)

    batch = read_recorded(record, 0).batch
    width = batch["prompts"].shape[1]
    for i in range(batch.batch_size[0]):
        row = row_of_prompt[decode(batch["prompts"][i], batch["attention_mask"][i, :width])]
        response = decode(batch["responses"][i], batch["response_mask"][i])
        text = fill_template(judge.template, row["prompt"], response, row["reward_model"]["ground_truth"])
        judged = judge.score(judge.verdict(text))
        assert batch["judge_scores"][i].item() == pytest.approx(judged)
        rule = batch["rule_scores"][i].item()
        assert batch["token_level_scores"][i].sum().item() == pytest.approx(0.5 * rule + 0.25 * judged, abs=1e-5)


def test_judge_recipe_loads_with_the_alias_or_rlflow_judge_path(monkeypatch, tiny_model_dir):
    """configs/smollm2_135m_word_problems_grpo_judge.yaml: the judge is $RLFLOW_JUDGE_PATH, else the
    smollm2-135m alias (resolved only when a run starts); its template reaches the judge."""
    from pathlib import Path

    recipe = Path(__file__).resolve().parents[1] / "configs" / "smollm2_135m_word_problems_grpo_judge.yaml"
    monkeypatch.delenv("RLFLOW_JUDGE_PATH", raising=False)
    cfg = load_config(recipe)
    assert cfg.reward.judge.enable and cfg.reward.judge.model_path == "smollm2-135m"
    monkeypatch.setenv("RLFLOW_JUDGE_PATH", tiny_model_dir)
    judge = check_judge(to_dataclass(load_config(recipe)))
    assert judge.model_path == tiny_model_dir and judge.template.startswith("Question: {prompt}\n")
    assert default_parser("Yes.") == 1.0 and default_parser("No, the student") == 0.0  # what it asks for
