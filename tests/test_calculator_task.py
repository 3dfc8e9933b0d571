"""The synthetic tool-use task "calc": tool-call parsers and the calculator (rlflow.agents.tools),
the environment (rlflow.agents.calculator), the task's rows (rlflow.data.synthetic) and the layout
of its multi-turn SFT examples (rlflow.tiny). Fast; no Ray, no full SFT."""

import json
import os

import pytest

from rlflow import tiny
from rlflow.agents import StepResult, load_env_class
from rlflow.agents.calculator import CalculatorEnv
from rlflow.agents.tools import (
    CalculatorError,
    HermesToolParser,
    RegexToolParser,
    ToolCall,
    calculator,
)
from rlflow.data.synthetic import TASKS, get_task, make_synthetic_rows

# ---------------------------------------------------------------------------------------------
# parsers


def test_regex_parser():
    p = RegexToolParser(r"^\s*@(?P<arguments>[^\n]*)", name="calculator")
    assert p.parse("@12+30") == ToolCall("calculator", "12+30")
    assert p("  @1+2\nmore") == ToolCall("calculator", "1+2")
    assert p.parse("@") == ToolCall("calculator", "")
    assert p.parse("42") is None
    assert p.parse("x@1+2") is None
    assert p.parse("") is None and p.parse(None) is None


def test_regex_parser_custom_group_and_errors():
    p = RegexToolParser(r"CALL\((?P<expr>.*?)\)", name="calc", group="expr")
    assert p.parse("let me see CALL(1 + 2) ok") == ToolCall("calc", "1 + 2")
    with pytest.raises(ValueError, match="named group"):
        RegexToolParser(r"@(.*)", name="calc")


def test_hermes_parser():
    p = HermesToolParser()
    text = 'I will compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call> tail'
    call = p.parse(text)
    assert call == ToolCall("calculator", json.dumps({"expression": "2+3"}))
    assert json.loads(call.arguments) == {"expression": "2+3"}
    # the first block counts; no arguments -> "{}"; a string (OpenAI style) is kept as it is
    two = '<tool_call>{"name": "a"}</tool_call><tool_call>{"name": "b"}</tool_call>'
    assert p.parse(two) == ToolCall("a", "{}")
    assert p.parse('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>') == ToolCall("f", '{"x": 1}')
    # unclosed at the end of the turn (stopped on EOS before the closing tag)
    assert p.parse('<tool_call>{"name": "f", "arguments": {}}') == ToolCall("f", "{}")


@pytest.mark.parametrize(
    "text",
    [
        "no call here",
        "",
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"name": "f", "arguments": {</tool_call>',
        "<tool_call>[1, 2]</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": "", "arguments": {}}</tool_call>',
        '<tool_call>{"name": 3}</tool_call>',
    ],
)
def test_hermes_parser_malformed(text):
    assert HermesToolParser().parse(text) is None


# ---------------------------------------------------------------------------------------------
# calculator


@pytest.mark.parametrize(
    "expr,value",
    [
        ("1+2", "3"),
        ("48213+9975", "58188"),
        (" 12 + 30 ", "42"),
        ("10-25", "-15"),
        ("2+3*4", "14"),
        ("(2+3)*4", "20"),
        ("-5+2", "-3"),
        ("--5", "5"),
        ("007+1", "8"),
        ("99999+99999", "199998"),
        ("0", "0"),
    ],
)
def test_calculator(expr, value):
    assert calculator(expr) == value


@pytest.mark.parametrize(
    "expr",
    ["", "   ", "1+", "+1", "1/2", "2**3", "1 2", "abc", "1+2)", "(1+2", "1e5", "٣+1", "__import__('os')",
     "1" * 101, "1+" * 150 + "1", "(" * 30 + "1" + ")" * 30, "*".join(["9999999999"] * 15)],
)
def test_calculator_rejects(expr):
    with pytest.raises(CalculatorError):
        calculator(expr)
    assert issubclass(CalculatorError, ValueError)


# ---------------------------------------------------------------------------------------------
# environment


def _row(truth="58188"):
    return {"data_source": "synthetic/calc", "ground_truth": truth, "extra_info": {},
            "raw_prompt": "48213+9975=", "source_prompt": {"prompt": "48213+9975="}}


def test_env_tool_call_then_right_answer():
    env = CalculatorEnv()
    assert env.reset(_row()) == ""
    r = env.step("@48213+9975")
    assert r == StepResult(observation="=58188", reward=0.0, done=False, info={})
    r = env.step("58188")
    assert r.done and r.reward == 1.0 and r.observation == ""
    assert r.info == {"acc": 1.0, "tool_calls": 1, "bad_tool_calls": 0}
    with pytest.raises(RuntimeError):
        env.step("58188")


def test_env_direct_answers():
    env = CalculatorEnv()
    env.reset(_row())
    r = env.step("48188")  # add without carry
    assert r.done and r.reward == 0.0 and r.info == {"acc": 0.0, "tool_calls": 0, "bad_tool_calls": 0}
    env.reset(_row())
    r = env.step(" 58188 \nthat is all")  # read like rlflow.rewards.synthetic: first line, stripped
    assert r.done and r.reward == 1.0 and r.info["acc"] == 1.0
    env.reset(_row())
    assert env.step("").reward == 0.0


def test_env_wrong_call_result_is_the_models_problem():
    env = CalculatorEnv()
    env.reset(_row())
    assert env.step("@48213+9976").observation == "=58189"  # a mis-copied operand
    r = env.step("58189")
    assert r.done and r.reward == 0.0 and r.info == {"acc": 0.0, "tool_calls": 1, "bad_tool_calls": 0}


@pytest.mark.parametrize("turn", ["@48213+", "@", "@4821x+9975", "@1/2"])
def test_env_malformed_call(turn):
    env = CalculatorEnv()
    env.reset(_row())
    r = env.step(turn)
    assert r == StepResult(observation="=?", reward=0.0, done=False, info={})
    assert env.step("@48213+9975").observation == "=58188"  # a retry works
    r = env.step("58188")
    assert r.reward == 1.0 and r.info == {"acc": 1.0, "tool_calls": 2, "bad_tool_calls": 1}

    env = CalculatorEnv(on_bad_call="end")
    env.reset(_row())
    r = env.step(turn)
    assert r.done and r.reward == 0.0 and r.observation == ""
    assert r.info == {"acc": 0.0, "tool_calls": 1, "bad_tool_calls": 1}


def test_env_reset_starts_over_and_takes_verl_rows():
    env = CalculatorEnv()
    env.reset(_row())
    env.step("@1+1")
    env.step("2")
    row = make_synthetic_rows("calc", 1, seed=0)[0]  # a raw dataset row (reward_model.ground_truth)
    env.reset(row)
    r = env.step(row["reward_model"]["ground_truth"])
    assert r.reward == 1.0 and r.info["tool_calls"] == 0
    with pytest.raises(RuntimeError, match="before reset"):
        CalculatorEnv().step("1")


def test_env_deterministic():
    def play(turns):
        env = CalculatorEnv()
        env.reset(_row())
        return [env.step(t) for t in turns]

    turns = ["@1+", "@48213+9975", "58188"]
    assert play(turns) == play(turns)


def test_env_hermes_syntax():
    env = CalculatorEnv(syntax="hermes")
    env.reset(_row())
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "48213+9975"}}</tool_call>'
    assert env.step(call) == StepResult("<tool_response>58188</tool_response>", 0.0, False, {})
    bad = '<tool_call>{"name": "search", "arguments": {"expression": "1+1"}}</tool_call>'
    assert env.step(bad).observation == "<tool_response>error</tool_response>"
    assert env.step("<tool_call>{oops</tool_call>").observation == "<tool_response>error</tool_response>"
    r = env.step("The answer is 58188")
    assert r.done and r.reward == 0.0  # the answer is the whole first line
    env.reset(_row())
    r = env.step("58188")
    assert r.reward == 1.0 and r.info["tool_calls"] == 0
    with pytest.raises(ValueError):
        CalculatorEnv(syntax="xml")
    with pytest.raises(ValueError):
        CalculatorEnv(on_bad_call="retry")


def test_env_loads_by_import_path():
    assert load_env_class("rlflow.agents.calculator:CalculatorEnv") is CalculatorEnv


# ---------------------------------------------------------------------------------------------
# task rows


def test_calc_rows():
    assert "calc" in TASKS and get_task("synthetic/calc").name == "calc"
    rows = make_synthetic_rows("calc", 200, seed=0)
    for r in rows:
        a, b = r["prompt"].rstrip("=").split("+")
        assert r["prompt"].endswith("=") and len(a) == len(b) == 5
        assert int(r["reward_model"]["ground_truth"]) == int(a) + int(b)
        assert r["data_source"] == "synthetic/calc"
    assert make_synthetic_rows("calc", 200, seed=0) == rows
    assert set("@?=+0123456789") <= set(get_task("calc").alphabet)
    # distractor: add without carry, right only when no column carries
    spec = get_task("calc")
    assert spec.distractor("48213+19975=", "68188") == "57188"
    assert spec.distractor("12345+11111=", "23456") == "23456"


def test_calc_splits_disjoint():
    train = {r["prompt"] for r in make_synthetic_rows("calc", 4000, seed=0, split="train")}
    val = make_synthetic_rows("calc", 400, seed=0, split="val")
    test = make_synthetic_rows("calc", 200, seed=7, split="test")
    assert not train & {r["prompt"] for r in val}
    assert not train & {r["prompt"] for r in test}


# ---------------------------------------------------------------------------------------------
# multi-turn SFT examples


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny.build_tokenizer(tmp_path_factory.mktemp("tok"))


def _enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_encode_episode_layout(tok):
    eos = tok.eos_token_id
    ids, labels = tiny.encode_episode(tok, "48213+19975=", "", ["@48213+19975", "68188"], ["=68188"])
    p, t1, o1, t2 = (tok("48213+19975=")["input_ids"], _enc(tok, "@48213+19975") + [eos],
                     _enc(tok, "=68188"), _enc(tok, "68188") + [eos])
    assert ids == p + t1 + o1 + t2
    assert labels == [-100] * len(p) + t1 + [-100] * len(o1) + t2
    # no tokens merge across the pieces: each character of the syntax is one token
    assert len(t1) == 13 and len(o1) == 6 and len(t2) == 6
    # a one-turn episode, and a non-empty first observation (not trained on)
    ids, labels = tiny.encode_episode(tok, "1+2=", "hint", ["3"], [])
    assert ids == tok("1+2=")["input_ids"] + _enc(tok, "hint") + _enc(tok, "3") + [eos]
    assert labels == [-100] * (len(ids) - 2) + _enc(tok, "3") + [eos]
    with pytest.raises(ValueError):
        tiny.encode_episode(tok, "1+2=", "", ["@1+2", "3"], [])


def test_prompt_ids_match_the_dataset(tok):
    from rlflow.data.dataset import PromptDataset

    rows = make_synthetic_rows("calc", 8, seed=0, split="val")
    ds = PromptDataset(rows, tok, max_prompt_length=16)
    for item, row in zip(ds, rows):
        ids, _ = tiny.encode_episode(tok, row["prompt"], "", ["1"], [])
        assert ids[: len(item["input_ids"])] == item["input_ids"]
        assert len(item["input_ids"]) == 12  # nothing added (no BOS)


def test_agent_sft_examples(tok):
    eos = tok.eos_token_id
    rows = make_synthetic_rows("calc", 400, seed=0)
    demos = tiny.agent_demos("calc", rows, 0.3, seed=0)
    assert demos == tiny.agent_demos("calc", rows, 0.3, seed=0)
    examples = tiny.agent_sft_examples(tok, "calc", rows, 0.3, seed=0)
    n_tool = 0
    for row, demo, (ids, labels) in zip(rows, demos, examples):
        prompt, truth = row["prompt"], row["reward_model"]["ground_truth"]
        p = tok(prompt)["input_ids"]
        if len(demo["turns"]) == 2:  # tool: call, observation from the env, copied answer
            n_tool += 1
            assert demo["turns"] == ["@" + prompt[:-1], truth] and demo["observations"] == ["=" + truth]
            t1, o1, t2 = _enc(tok, "@" + prompt[:-1]) + [eos], _enc(tok, "=" + truth), _enc(tok, truth) + [eos]
            assert ids == p + t1 + o1 + t2
            assert labels == [-100] * len(p) + t1 + [-100] * len(o1) + t2
        else:  # direct: the distractor
            assert demo["turns"] == [get_task("calc").distractor(prompt, truth)]
            t1 = _enc(tok, demo["turns"][0]) + [eos]
            assert ids == p + t1 and labels == [-100] * len(p) + t1
    assert 0.22 < n_tool / len(rows) < 0.38
    assert all(len(d["turns"]) == 2 for d in tiny.agent_demos("calc", rows[:20], 1.0, seed=0))


def test_existing_tasks_sft_options_unchanged():
    for task in ("add", "reverse", "sort"):
        assert task not in tiny.TASK_SFT_DEFAULTS and task not in tiny.AGENT_TASKS
    assert set(tiny.TASK_SFT_DEFAULTS["calc"]) <= set(tiny.SFT_DEFAULTS)


def test_calc_warm_start_runs(tmp_path):
    small = {"hidden_size": 32, "num_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
             "intermediate_size": 64}
    path = tiny.warm_start("calc", cache_dir=tmp_path, model=small, steps=2, batch_size=8, num_rows=32,
                           warmup_steps=1, verbose=False)
    meta = json.loads(open(os.path.join(path, "rlflow_warm_start.json")).read())
    assert meta["task"] == "calc" and meta["sft"]["steps"] == 2
    assert meta["sft"]["correct_frac"] == tiny.TASK_SFT_DEFAULTS["calc"]["correct_frac"]
    assert meta["final_loss"] == meta["final_loss"]  # not NaN
