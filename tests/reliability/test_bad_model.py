"""A model folder that cannot be a policy, or a tokenizer without EOS: one clear error, before Ray starts."""

from __future__ import annotations

import json
import shutil

import pytest

from controllers.ppo import PPOTrainer
from controllers.setup import check_causal_lm_folder, load_tokenizer
from rlflow import load_config


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def test_a_non_causal_lm_folder_is_refused_naming_the_key(tiny_model_dir, tmp_path):
    folder = _copy(tiny_model_dir, tmp_path / "cls")
    config = json.loads((tmp_path / "cls" / "config.json").read_text())
    config["architectures"] = ["Qwen2ForSequenceClassification"]
    (tmp_path / "cls" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"actor\.model\.path=.*Qwen2ForSequenceClassification.*not a causal LM"):
        check_causal_lm_folder(folder)


def test_a_folder_without_config_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        check_causal_lm_folder(str(tmp_path))


def test_tokenizer_without_eos_is_refused(tiny_model_dir, tmp_path):
    folder = _copy(tiny_model_dir, tmp_path / "noeos")
    cfg_path = tmp_path / "noeos" / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg["eos_token"] = None
    tok_cfg["pad_token"] = None
    cfg_path.write_text(json.dumps(tok_cfg))
    gen = tmp_path / "noeos" / "generation_config.json"
    if gen.exists():
        gen.unlink()
    with pytest.raises(ValueError, match="has no eos token"):
        load_tokenizer(folder)


def test_setup_fails_before_ray_starts(tiny_model_dir, tmp_path, monkeypatch):
    """Bad inputs found in setup never reach Ray: ensure_ray is not called."""
    import controllers.cluster as cluster

    def no_ray(cfg):
        raise AssertionError("Ray was started before the bad input was found")

    monkeypatch.setattr(cluster, "ensure_ray", no_ray)
    missing = tmp_path / "missing.parquet"
    cfg = load_config(None, [f"actor.model.path={tiny_model_dir}", f"data.train_files=[{missing}]"])
    with pytest.raises(Exception, match="missing.parquet"):
        PPOTrainer(cfg).setup()
    cfg = load_config(None, [f"actor.model.path={tiny_model_dir}", f"reward.custom_function.path={tmp_path / 'nope.py'}"])
    with pytest.raises(FileNotFoundError, match="nope.py"):
        PPOTrainer(cfg).setup()
