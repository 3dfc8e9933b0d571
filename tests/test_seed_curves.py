"""scripts/seed_curves.py (the runner behind the engine and asynchrony learning-curve comparisons):
two arms x two seeds of a 2-step tiny run, each a real fit; its table and PNG come out, and each arm's
overrides reach its runs (the kept metrics show them)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
from conftest import tiny_overrides

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "seed_curves.py"


@pytest.fixture(scope="module")
def seed_curves():
    spec = importlib.util.spec_from_file_location("rlflow_seed_curves_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_arm_is_a_name_and_its_overrides(seed_curves):
    assert seed_curves.parse_arm("hf:rollout.name=hf,trainer.seed=3") == ("hf", ["rollout.name=hf", "trainer.seed=3"])
    assert seed_curves.parse_arm("base:") == ("base", [])
    with pytest.raises(Exception, match="NAME:key=value"):
        seed_curves.parse_arm("rollout.name=hf")


def test_two_arms_two_seeds_print_the_table_and_draw(seed_curves, ray_session, tiny_model_dir, tmp_path, capsys):
    extra = tiny_overrides(tiny_model_dir, **{"trainer.test_freq": 2, "trainer.val_before_train": True,
                                              "algorithm.adv_estimator": "grpo", "reward.num_workers": 0})
    out = tmp_path / "curves.png"
    keep = tmp_path / "runs"
    arms = [("lr1", ["actor.optim.lr=1e-6"]), ("lr2", ["actor.optim.lr=2e-6"])]
    assert seed_curves.compare(None, arms, [0, 1], extra, str(out), str(keep), "smoke") == 0
    printed = capsys.readouterr().out
    for name in ("lr1", "lr2"):
        for seed in (0, 1):
            assert f"{name} seed {seed}: wall" in printed
            records = [json.loads(line) for line in (keep / "rlflow" / f"{name}_seed{seed}" / "metrics.jsonl").open()]
            lrs = {r["actor/lr"] for r in records if "actor/lr" in r}
            assert lrs == {1e-6 if name == "lr1" else 2e-6}, lrs
            assert [r["step"] for r in records if "val/acc_mean" in r] == [0, 2]
    assert "| lr1 | actor.optim.lr=1e-6 |" in printed and "(reference)" in printed
    assert re.search(r"\| lr2 \| actor\.optim\.lr=2e-6 \| [\d.]+ / [\d.]+ \| [\d.]+ \| [+-]\d\.\d{3} \(", printed), printed
    assert out.stat().st_size > 10_000
