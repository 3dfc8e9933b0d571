"""The embedded tiny model's chat template (rlflow.tiny.CHAT_TEMPLATE) and the README's in-memory
example with chat-message rows, run as the README writes it."""

from __future__ import annotations

import os
import re

import pytest
import transformers

from conftest import tiny_overrides
from rlflow import tiny
from rlflow.data.dataset import PromptDataset

README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")


def test_tiny_chat_template_renders_the_agent_loop_layout(tiny_model_dir):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tok.chat_template == tiny.CHAT_TEMPLATE
    # one user message: its text as it is, no generation prompt, so the ids of the plain prompt
    user = [{"role": "user", "content": "12345+678="}]
    text = tok.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
    assert text == "12345+678="
    assert tok(text, add_special_tokens=False)["input_ids"] == tok("12345+678=")["input_ids"]
    # a conversation: system + newline, user as it is, assistant + EOS, tool as it is; text parts
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "48213+9975="},
            {"role": "assistant", "content": "@48213+9975"},
            {"role": "tool", "content": [{"type": "text", "text": "=58188"}]},
            {"role": "assistant", "content": "58188"}]
    assert (tok.apply_chat_template(conv, tokenize=False)
            == "be brief\n48213+9975=@48213+9975<|endoftext|>=58188" "58188<|endoftext|>")
    # ... which is the warm start's layout of a calculator episode (prompt, turn + EOS, observation)
    ids, _ = tiny.encode_episode(tok, "48213+9975=", "", ["@48213+9975", "58188"], ["=58188"])
    rendered = tok.apply_chat_template(conv[1:], tokenize=False)
    assert tok(rendered, add_special_tokens=False)["input_ids"] == ids
    # a chat row through the dataset: the same ids as the plain-string row
    rows = [{"prompt": m, "data_source": "t", "reward_model": {"ground_truth": "1"}}
            for m in ("12345+678=", user)]
    ds = PromptDataset(rows, tok, 16)
    assert ds[0]["input_ids"] == ds[1]["input_ids"] and ds[1]["raw_prompt"] == "12345+678="


def test_a_cached_warm_start_without_the_template_gets_it_unchanged(tmp_path, monkeypatch):
    small = {"hidden_size": 32, "num_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
             "intermediate_size": 64}
    sft = {"steps": 2, "batch_size": 8, "num_rows": 32, "warmup_steps": 1}
    path = tiny.warm_start("reverse", cache_dir=tmp_path, model=small, verbose=False, **sft)
    template = os.path.join(path, "chat_template.jinja")
    weights = open(os.path.join(path, "model.safetensors"), "rb").read()
    os.remove(template)  # an entry built before the tiny tokenizer had a chat template

    def boom(*a, **k):
        raise AssertionError("retrained although cached")

    monkeypatch.setattr(tiny, "_run_sft", boom)
    assert tiny.warm_start("reverse", cache_dir=tmp_path, model=small, verbose=False, **sft) == path
    assert open(template).read() == tiny.CHAT_TEMPLATE
    assert open(os.path.join(path, "model.safetensors"), "rb").read() == weights
    assert sorted(os.listdir(tmp_path / "warm")) == [os.path.basename(path)]
    assert not [f for f in os.listdir(path) if f.endswith(".tmp")]


def _readme_example() -> str:
    """The README's "Data and reward from Python" code block, as written."""
    text = open(README, encoding="utf-8").read()
    after = text.split("Data and reward from Python", 1)[1]
    return re.search(r"```python\n(.*?)```", after, re.S).group(1)


@pytest.mark.timeout(300)
def test_readme_in_memory_chat_example_runs(ray_session, tiny_model_dir, tmp_path):
    from rlflow import RLFlow, load_config

    code = _readme_example()
    assert '"role": "user"' in code and "RLFlow(cfg, train_dataset=rows" in code
    # the README's config at test sizes: one step and validation on the random tiny model, whose
    # tokenizer and chat template are the embedded default's
    cfg = load_config(None, tiny_overrides(tiny_model_dir, **{
        "trainer.default_local_dir": str(tmp_path), "trainer.experiment_name": "readme_chat",
        "algorithm.adv_estimator": "grpo", "trainer.total_steps": 1, "trainer.test_freq": 1,
        "data.max_response_length": 4}))
    scope = {"RLFlow": RLFlow, "cfg": cfg}
    exec(compile(code, "README.md (in-memory example)", "exec"), scope)
    history = scope["history"]
    assert [row["step"] for row in history] == [1]
    assert "reward/score_mean" in history[-1] and "val/score_mean" in history[-1]
    # the prompts the run trained on are the chat template's rendering of the rows' messages
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    ds = PromptDataset(scope["rows"], tok, cfg.data.max_prompt_length)
    assert ds.num_dropped == 0 and ds[0]["raw_prompt"] == "Reverse: abc"
