"""The OpenAI-compatible endpoint (controllers/openai_endpoint.py) and agents as plain code
(rollout.agent.fn, rlflow/agents/fn.py): a real uvicorn server on a real port, the real openai
client, and, for the fit, Ray actors and the tiny model.

Token exactness: a trajectory of several calls is the concatenation of what the engine sampled and
the ids of the messages between calls (the chat template's delta), never a re-tokenisation of the
conversation's text; a template that renders earlier assistant turns differently (strips
whitespace and <think> blocks) changes nothing."""

from __future__ import annotations

import json
import os
import shutil
import threading

import openai
import pytest
import torch

from conftest import tiny_overrides
from rlflow import load_config

AGENTS = os.path.join(os.path.dirname(__file__), "openai_agents.py")

# the tiny template (rlflow/tiny.py), but earlier assistant turns lose their <think> block and their
# surrounding whitespace, as many real templates do: a re-render of the conversation differs from
# the tokens sampled
TRAP_TEMPLATE = (
    "{%- macro text(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content -%}{%- for part in content -%}{{ part['text'] }}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- if loop.last -%}{{ text(message['content']) }}"
    "{%- else -%}{{ text(message['content']).split('</think>')[-1] | trim }}{%- endif -%}{{ eos_token }}"
    "{%- else -%}{{ text(message['content']) }}{%- endif -%}"
    "{%- endfor -%}"
)

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"word": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = TRAP_TEMPLATE
    return tok


class ScriptedEngine:
    """Answers each context with the next scripted text (as ids, + EOS), log-prob -0.25 a token;
    keeps every batch it was called with."""

    def __init__(self, tok, texts):
        self.tok, self.texts, self.batches = tok, list(texts), []
        self.lock = threading.Lock()

    def __call__(self, contexts, max_new_tokens):
        with self.lock:
            self.batches.append([list(c) for c in contexts])
            out = []
            for _ in contexts:
                ids = self.tok.encode(self.texts.pop(0), add_special_tokens=False) + [self.tok.eos_token_id]
                ids = ids[:max_new_tokens]
                out.append((ids, [-0.25] * len(ids)))
            return out


def _endpoint(tok, engine, **kwargs):
    from controllers.openai_endpoint import OpenAIEndpoint

    endpoint = OpenAIEndpoint(tok, engine, max_prompt_length=24, max_response_length=256, **kwargs)
    endpoint.start()
    return endpoint


def test_openai_endpoint_chat_tools_stream_and_token_exact_sessions(tokenizer):
    """Chat with tools (a Hermes tool call comes back as tool_calls), a streamed second call after
    the tool result, and the session's ids: the first prompt rendered once, then the sampled ids and
    the template's delta of the tool message, although the template would re-render the first turn
    without its <think> block and spaces."""
    tok = tokenizer
    first = ' <think>hm </think> <tool_call>{"name": "lookup", "arguments": {"word": "ab"}}</tool_call> '
    engine = ScriptedEngine(tok, [first, " 42 "])
    endpoint = _endpoint(tok, engine)
    try:
        url = endpoint.open(1)[0]
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        messages = [{"role": "user", "content": "ab="}]
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        call = choice.message.tool_calls[0]
        assert call.function.name == "lookup" and json.loads(call.function.arguments) == {"word": "ab"}
        assert choice.message.content == "<think>hm </think>"
        messages += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": "=ba"}]
        chunks = list(client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, stream=True,
                                                     stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == " 42 "
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
        assert chunks[-1].usage.completion_tokens == len(tok.encode(" 42 ", add_special_tokens=False)) + 1
    finally:
        sessions = endpoint.close_rollout()
        endpoint.stop()
    session = sessions[0]
    sampled = [tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] for t in (first, " 42 ")]
    observation = tok.encode("=ba", add_special_tokens=False)
    assert session.prompt == tok.encode("ab=", add_special_tokens=False)
    assert session.ids == sampled[0] + observation + sampled[1]
    assert session.mask == [1] * len(sampled[0]) + [0] * len(observation) + [1] * len(sampled[1])
    assert session.log_probs == [-0.25] * len(sampled[0]) + [0.0] * len(observation) + [-0.25] * len(sampled[1])
    assert [c.ids for c in session.calls] == sampled and session.dropped_calls == 0
    assert engine.batches[1] == [session.prompt + sampled[0] + observation]  # the context the engine saw
    # the trap: a re-render of the conversation is not what was sampled
    rerender = tok.apply_chat_template([{"role": "user", "content": "ab="},
                                        {"role": "assistant", "content": first},
                                        {"role": "tool", "content": "=ba"},
                                        {"role": "assistant", "content": " 42 "}], tokenize=False)
    assert tok.encode(rerender, add_special_tokens=False) != session.prompt + session.ids


def test_openai_endpoint_completions_errors_and_batching(tokenizer):
    """/v1/completions continues a trajectory by text or by ids; n > 1, a long prompt and an
    unknown or ended trajectory are refused; concurrent calls share one engine call."""
    tok = tokenizer
    engine = ScriptedEngine(tok, ["@1+2", "3", " x", "4"] + ["y"] * 4)
    endpoint = _endpoint(tok, engine, batch_window_s=5.0)
    try:
        urls = endpoint.open(6)
        client = openai.OpenAI(base_url=urls[0], api_key="none", max_retries=0)
        one = client.completions.create(model="policy", prompt="1+2=")
        assert one.choices[0].text == "@1+2" and one.choices[0].finish_reason == "stop"
        streamed = list(client.completions.create(model="policy", prompt="1+2=@1+2=3", stream=True))
        assert "".join(c.choices[0].text for c in streamed) == "3"
        by_ids = openai.OpenAI(base_url=urls[1], api_key="none", max_retries=0)
        ids = tok.encode("9=", add_special_tokens=False)
        out = by_ids.completions.create(model="policy", prompt=ids, max_tokens=1)
        assert out.choices[0].finish_reason == "length"  # cut at max_tokens, before its EOS
        sampled = tok.encode(" x", add_special_tokens=False)[:1]
        by_ids.completions.create(model="policy", prompt=ids + sampled + [5])
        with pytest.raises(openai.BadRequestError, match="n=2"):
            client.completions.create(model="policy", prompt="1", n=2)
        with pytest.raises(openai.BadRequestError, match="data.max_prompt_length=24"):
            client.completions.create(model="policy", prompt="1" * 30)
        with pytest.raises(openai.NotFoundError, match="no open trajectory"):
            openai.OpenAI(base_url=urls[0].replace("/0/v1", "/99/v1"), api_key="none",
                          max_retries=0).completions.create(model="policy", prompt="1")
        # four agents at once (rollout.agent.num_workers=4): one engine call
        endpoint.concurrency = 4
        before = len(engine.batches)
        threads = [threading.Thread(target=openai.OpenAI(base_url=urls[i], api_key="none", max_retries=0)
                                    .completions.create, kwargs={"model": "policy", "prompt": "7="})
                   for i in range(2, 6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert [len(b) for b in engine.batches[before:]] == [4]
        sessions = endpoint.close_rollout()
        with pytest.raises(openai.NotFoundError):  # the rollout ended
            client.completions.create(model="policy", prompt="1")
    finally:
        endpoint.stop()
    text_session = sessions[0]
    first = tok.encode("@1+2", add_special_tokens=False) + [tok.eos_token_id]
    assert text_session.prompt == tok("1+2=")["input_ids"]
    assert text_session.ids == first + tok.encode("=3", add_special_tokens=False) + \
        tok.encode("3", add_special_tokens=False) + [tok.eos_token_id]
    assert text_session.mask == [1] * len(first) + [0] * len(tok.encode("=3", add_special_tokens=False)) + \
        [1] * (len(tok.encode("3", add_special_tokens=False)) + 1)
    assert sessions[1].ids == sampled + [5] + tok.encode("4", add_special_tokens=False) + [tok.eos_token_id]
    assert sessions[1].mask == [1, 0] + [1] * (len(sessions[1].ids) - 2)


def test_openai_agent_fn_config_errors_name_the_key(tmp_path, tiny_model_dir):
    from controllers.ppo import PPOTrainer
    from rlflow.config import ConfigError

    with pytest.raises(ConfigError, match="rollout.agent.env=.* and rollout.agent.fn=.* are both set"):
        load_config(None, ["rollout.agent.env=rlflow.agents.calculator:CalculatorEnv",
                           f"rollout.agent.fn={AGENTS}:three_calls"])
    for spec, error, match in [(f"{tmp_path}/nope.py:solve", FileNotFoundError, "rollout.agent.fn=.*no file"),
                               (f"{AGENTS}:missing", AttributeError, "rollout.agent.fn=.*has no missing"),
                               ("three_calls", ValueError, "rollout.agent.fn=.*expected 'file.py:function'")]:
        with pytest.raises(error, match=match):  # before Ray starts
            PPOTrainer(load_config(None, tiny_overrides(tiny_model_dir, **{"rollout.agent.fn": spec}))).fit()


@pytest.fixture(scope="module")
def agent_fit(ray_session, tmp_path_factory):
    """One step of GRPO with the agent function tests/openai_agents.py:three_calls in 2 pool
    processes, on the varied-length tiny model whose tokenizer has TRAP_TEMPLATE."""
    from exactness_helpers import build_varied_length_model

    from controllers.ppo import PPOTrainer

    model_dir = build_varied_length_model(str(tmp_path_factory.mktemp("openai_model")))
    with open(os.path.join(model_dir, "chat_template.jinja"), "w") as f:
        f.write(TRAP_TEMPLATE)
    base = str(tmp_path_factory.mktemp("openai_fit"))
    cfg = load_config(None, tiny_overrides(model_dir, **{
        "rollout.agent.fn": f"{AGENTS}:three_calls", "rollout.agent.num_workers": 2, "rollout.agent.on_error": "zero",
        "data.max_response_length": 40, "algorithm.adv_estimator": "grpo", "trainer.total_steps": 1,
        # one mini-batch: the actor's log-probs of every micro-batch are taken before its one optimizer step
        "actor.ppo_mini_batch_size": 16,
        "trainer.default_local_dir": base, "trainer.record_rollouts": os.path.join(base, "rec"),
        "trainer.deterministic": True}))
    trainer = PPOTrainer(cfg)
    history = trainer.fit()
    yield trainer, history, base, model_dir
    shutil.rmtree(base, ignore_errors=True)


def test_openai_agent_fn_batch_is_what_the_engine_sampled(agent_fit):
    """For each trajectory of three calls: the batch's prompt is the first call's prompt; each call's
    context is the prompt + the trajectory before it; its sampled ids are in the batch with mask 1
    and their log-probs; the ids between calls are the template's text of the new messages encoded
    (mask 0); the reward is on the last sampled token; a failing agent is an error with reward 0."""
    from transformers import AutoTokenizer

    from controllers.rollout_source import read_recorded

    trainer, history, base, model_dir = agent_fit
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert tok.chat_template == TRAP_TEMPLATE
    batch = read_recorded(os.path.join(base, "rec"), 0).batch
    sessions = trainer.agent.last_sessions
    width = batch["prompts"].shape[1]
    failed = 0
    rerender_differs = 0
    for row in range(batch.batch_size[0]):
        session = sessions[row]
        prompt = batch["prompts"][row][batch["attention_mask"][row, :width].bool()].tolist()
        length = int(batch["attention_mask"][row, width:].sum())
        ids = batch["responses"][row, :length].tolist()
        mask = batch["response_mask"][row, :length].tolist()
        assert prompt == session.prompt and len(session.calls) == 3 and session.dropped_calls == 0
        position, texts = 0, []
        between = [tok.encode(" <tool> 7 </tool>", add_special_tokens=False),
                   tok.encode("\n ok?", add_special_tokens=False)]
        for k, call in enumerate(session.calls):
            assert call.prompt_ids == prompt + ids[:position], f"row {row} call {k}: context"
            end = position + len(call.ids)
            assert ids[position:end] == call.ids and mask[position:end] == [1] * len(call.ids)
            assert batch["rollout_log_probs"][row, position:end].tolist() == pytest.approx(call.log_probs, abs=0)
            assert call.weight_version == 0
            texts.append(tok.decode(call.ids, skip_special_tokens=True))
            position = end
            if k < 2:
                observation = ([] if call.ids[-1:] == [tok.eos_token_id] else [tok.eos_token_id]) + between[k]
                assert ids[position:position + len(observation)] == observation, f"row {row}: between calls {k}, {k + 1}"
                assert mask[position:position + len(observation)] == [0] * len(observation)
                position += len(observation)
        assert position == length
        scored = batch["token_level_scores"][row].nonzero().flatten().tolist()
        assert set(scored) <= {max(i for i, m in enumerate(mask) if m)}
        if tok.decode(prompt).startswith("1"):
            failed += 1
            assert scored == []
        conversation = [{"role": "user", "content": tok.decode(prompt)}, {"role": "assistant", "content": texts[0]},
                        {"role": "tool", "content": " <tool> 7 </tool>"}, {"role": "assistant", "content": texts[1]},
                        {"role": "user", "content": "\n ok?"}, {"role": "assistant", "content": texts[2]}]
        rerender = tok.encode(tok.apply_chat_template(conversation, tokenize=False), add_special_tokens=False)
        rerender_differs += rerender != prompt + ids
    assert history[-1]["reward/num_errors"] == failed
    assert history[-1]["agent/endpoint_calls_mean"] == 3.0 and history[-1]["agent/turns_mean"] == 3.0
    assert rerender_differs > 0, "no trajectory would re-tokenise differently: the trap is not exercised"


def test_openai_agent_fn_log_probs_equal_the_actors_forward(agent_fit):
    """The rollout log-probs of the sampled tokens equal the actor's forward on the assembled batch
    (its rollout_corr/abs_diff_max: the largest |actor - rollout| over the sampled tokens, taken
    before the step's one optimizer step), and a plain HF forward of the model folder, within 1e-5."""
    from transformers import AutoModelForCausalLM

    from controllers.rollout_source import read_recorded

    _, history, base, model_dir = agent_fit
    assert history[-1]["rollout_corr/abs_diff_max"] < 1e-5
    batch = read_recorded(os.path.join(base, "rec"), 0).batch
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits
    width = batch["prompts"].shape[1]
    log_probs = torch.log_softmax(logits[:, width - 1:-1].float(), dim=-1)
    log_probs = log_probs.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    mask = batch["response_mask"].bool()
    assert mask.sum() > 0
    diff = (log_probs[mask] - batch["rollout_log_probs"][mask]).abs().max().item()
    assert diff < 1e-5, diff


def test_openai_calculator_agent_trajectory_is_the_calc_episode_layout(tiny_model_dir):
    """The recipe's agent (rlflow/agents/examples/calculator_openai.py) through the endpoint with its
    CompactCalls parser: the model's "@a+b" turn comes back as a calculator tool call, the agent's
    tool message "=sum" and the final answer make the trajectory the calculator environment's agent
    loop lays out (prompt, call + EOS, "=sum", answer + EOS): the layout the warm start trains on."""
    from transformers import AutoTokenizer

    from rlflow.agents.examples.calculator_openai import solve

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)  # the tiny chat template
    engine = ScriptedEngine(tok, ["@48213+9975", "58188"])
    endpoint = _endpoint(tok, engine, tool_parser="rlflow.agents.examples.calculator_openai:CompactCalls")
    try:
        url = endpoint.open(1)[0]
        result = solve({"raw_prompt": "48213+9975=", "ground_truth": "58188"},
                       openai.OpenAI(base_url=url, api_key="none", max_retries=0))
        session = endpoint.close_rollout()[0]
    finally:
        endpoint.stop()
    assert result == {"reward": 1.0, "acc": 1.0}
    eos = tok.eos_token_id
    call, observation, answer = (tok.encode(t, add_special_tokens=False) for t in ("@48213+9975", "=58188", "58188"))
    assert session.prompt == tok("48213+9975=")["input_ids"]
    assert session.ids == call + [eos] + observation + answer + [eos]
    assert session.mask == [1] * (len(call) + 1) + [0] * len(observation) + [1] * (len(answer) + 1)


def test_openai_endpoint_a_call_waiting_when_its_rollout_ends_records_nothing(tokenizer):
    """An episode whose process was killed may leave a call waiting on the engine: once the rollout's
    sessions are taken (close_rollout), its answer is not recorded and the call gets 404."""
    tok = tokenizer
    release = threading.Event()

    def slow_engine(contexts, max_new_tokens):
        release.wait(10)
        return [(tok.encode("7", add_special_tokens=False) + [tok.eos_token_id], [-0.5, -0.5]) for _ in contexts]

    endpoint = _endpoint(tok, slow_engine)
    errors = []

    def call(url):
        try:
            openai.OpenAI(base_url=url, api_key="none", max_retries=0).completions.create(model="policy", prompt="1=")
        except openai.NotFoundError as err:
            errors.append(err)

    try:
        url = endpoint.open(1)[0]
        thread = threading.Thread(target=call, args=(url,))
        thread.start()
        while not endpoint.sessions[0].prompt:  # the call is in (the session is taken in the server's loop, after it)
            threading.Event().wait(0.01)
        session = endpoint.close_rollout()[0]
        snapshot = (list(session.prompt), list(session.ids), len(session.calls))
        release.set()
        thread.join(10)
    finally:
        endpoint.stop()
    assert len(errors) == 1 and "ended while its call waited" in str(errors[0])
    assert (session.prompt, session.ids, len(session.calls)) == snapshot == (tok("1=")["input_ids"], [], 0)


def test_a_tool_parser_that_cannot_be_used_is_named_with_its_key(tmp_path):
    """rollout.agent.tool_parser: each way it can be wrong raises before Ray starts, naming the key."""
    from controllers.openai_endpoint import load_tool_parser
    from rlflow.agents.examples.calculator_openai import CompactCalls
    from rlflow.agents.tools import HermesToolParser

    assert isinstance(load_tool_parser("hermes"), HermesToolParser)
    assert isinstance(load_tool_parser("rlflow.agents.examples.calculator_openai:CompactCalls"), CompactCalls)
    no_parse = tmp_path / "no_parse.py"
    no_parse.write_text("class Parser:\n    pass\n")
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('broken on import')\n")
    key = r"rollout\.agent\.tool_parser="
    for spec, error, pattern in (("qwen", ValueError, key + r"'qwen': expected 'hermes'"),
                                 (f"{tmp_path}/absent.py:Parser", FileNotFoundError, key + ".*no file"),
                                 (f"{broken}:Parser", ImportError, key + ".*RuntimeError: broken on import"),
                                 ("rlflow.no_such_module:Parser", ImportError, key + ".*cannot import"),
                                 (f"{no_parse}:Other", AttributeError, key + ".*has no Other"),
                                 (f"{no_parse}:Parser", TypeError, key + ".*Parser has no parse")):
        with pytest.raises(error, match=pattern):
            load_tool_parser(spec)
