"""The tiny Qwen2 model + tokenizer builder and the cached SFT warm start (rlflow.tiny)."""

import json
import os

import pytest
import torch
import transformers

from rlflow import tiny
from rlflow.data.synthetic import TASKS

# A warm start small enough to run in a couple of seconds.
TINY_MODEL = {"hidden_size": 32, "num_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 1, "intermediate_size": 64}
TINY_SFT = {"steps": 3, "batch_size": 8, "num_rows": 64, "warmup_steps": 1}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def auto_tok(model_dir):
    return transformers.AutoTokenizer.from_pretrained(model_dir)


ROUND_TRIP = [
    "12+345=357",
    "0123456789",
    "31415>51413",
    "9876:6789",
    " leading space",
    "trailing space ",
    "two  spaces and\ta tab",
    "line one\nline two\n",
    "  ",
    "",
    "héllo wörld ∑ 😀",
]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_auto_tokenizer_round_trip(auto_tok, text):
    ids = auto_tok.encode(text, add_special_tokens=False)
    assert auto_tok.decode(ids) == text


def test_round_trip_every_task_character(auto_tok):
    chars = sorted({c for t in TASKS.values() for c in t.alphabet} | set(" \n"))
    text = "".join(chars) + " " + " ".join(chars)
    assert auto_tok.decode(auto_tok.encode(text, add_special_tokens=False)) == text
    # one token per digit, so per-digit answers are per-token decisions
    for d in "0123456789":
        assert len(auto_tok.encode(d, add_special_tokens=False)) == 1


def test_special_tokens(auto_tok, model_dir):
    assert auto_tok.eos_token == tiny.EOS_TOKEN
    assert auto_tok.pad_token == tiny.PAD_TOKEN
    assert auto_tok.eos_token_id != auto_tok.pad_token_id
    assert auto_tok.encode("1+2=", add_special_tokens=False) == auto_tok("1+2=")["input_ids"]
    ids = auto_tok.encode("357", add_special_tokens=False) + [auto_tok.eos_token_id]
    assert auto_tok.decode(ids, skip_special_tokens=True) == "357"
    cfg = json.loads(open(os.path.join(model_dir, "config.json")).read())
    assert cfg["eos_token_id"] == auto_tok.eos_token_id
    assert cfg["pad_token_id"] == auto_tok.pad_token_id
    assert cfg["vocab_size"] == len(auto_tok)


def test_tokenizer_only_folder_round_trips(tmp_path):
    hf = tiny.build_tokenizer(tmp_path)
    again = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in ROUND_TRIP:
        assert again.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
        assert again.decode(again.encode(text, add_special_tokens=False)) == text


def test_model_loads_and_generates(model_dir, auto_tok):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert next(model.parameters()).dtype == torch.float32
    assert os.path.isfile(os.path.join(model_dir, "model.safetensors"))
    n = sum(p.numel() for p in model.parameters())
    assert 0.9e6 <= n <= 5e6, n
    auto_tok.padding_side = "left"
    enc = auto_tok(["1+2=", "123+456="], return_tensors="pt", padding=True)
    out = model.generate(**enc, max_new_tokens=4, do_sample=False,
                         pad_token_id=auto_tok.pad_token_id, eos_token_id=auto_tok.eos_token_id)
    assert out.shape[0] == 2 and 1 <= out.shape[1] - enc["input_ids"].shape[1] <= 4


def test_model_options_and_determinism(tmp_path):
    a = tiny.build_tiny_model(tmp_path / "a", **TINY_MODEL)
    b = tiny.build_tiny_model(tmp_path / "b", **TINY_MODEL)
    ma = transformers.AutoModelForCausalLM.from_pretrained(a)
    mb = transformers.AutoModelForCausalLM.from_pretrained(b)
    assert ma.config.hidden_size == 32 and ma.config.num_hidden_layers == 1
    for pa, pb in zip(ma.parameters(), mb.parameters()):
        assert torch.equal(pa, pb)
    with pytest.raises(TypeError):
        tiny.build_tiny_model(tmp_path / "c", hidden_sizes=3)


def test_warm_start_caches(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RLFLOW_CACHE", str(tmp_path))
    path = tiny.warm_start("reverse", model=TINY_MODEL, **TINY_SFT)
    assert path.startswith(str(tmp_path))
    assert "warm start" in capsys.readouterr().err
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert model.config.hidden_size == 32
    assert tok.decode(tok.encode("123>321", add_special_tokens=False)) == "123>321"
    meta = json.loads(open(os.path.join(path, "rlflow_warm_start.json")).read())
    assert meta["task"] == "reverse" and meta["sft"]["steps"] == 3

    def boom(*a, **k):
        raise AssertionError("retrained although cached")

    monkeypatch.setattr(tiny, "_run_sft", boom)
    assert tiny.warm_start("reverse", model=TINY_MODEL, **TINY_SFT) == path
    # a different SFT budget is a different entry
    with pytest.raises(AssertionError, match="retrained"):
        tiny.warm_start("reverse", model=TINY_MODEL, **{**TINY_SFT, "steps": 4})
    leftovers = [p for p in os.listdir(tmp_path / "warm") if p.startswith(".tmp")]
    assert leftovers == []
    assert os.listdir(tmp_path / "warm") == [os.path.basename(path)]


def test_warm_start_interrupted_leaves_nothing(tmp_path, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(tiny, "_run_sft", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tiny.warm_start("reverse", cache_dir=tmp_path, model=TINY_MODEL, **TINY_SFT)
    assert os.listdir(tmp_path / "warm") == []


def test_warm_start_rejects_unknown_options(tmp_path):
    with pytest.raises(TypeError):
        tiny.warm_start("reverse", cache_dir=tmp_path, stepz=3)
    with pytest.raises(KeyError):
        tiny.warm_start("no-such-task", cache_dir=tmp_path)


def test_sft_targets_mix_distractor():
    from rlflow.data.synthetic import make_synthetic_rows

    rows = make_synthetic_rows("reverse", 400, seed=0)
    targets = tiny.sft_targets("reverse", rows, 0.4, seed=0)
    assert targets == tiny.sft_targets("reverse", rows, 0.4, seed=0)
    truth = [r["reward_model"]["ground_truth"] for r in rows]
    copies = [r["prompt"][:-1] for r in rows]
    correct = sum(t == g for t, g in zip(targets, truth))
    assert all(t == g or t == c for t, g, c in zip(targets, truth, copies))
    assert 0.3 * len(rows) < correct < 0.5 * len(rows)
    assert tiny.sft_targets("reverse", rows, 1.0, seed=0) == truth
