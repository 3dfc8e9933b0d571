"""SFT (controllers/sft.py, `rlflow sft`): real fits of the actor's worker group on the synthetic
task's prompts and answers.

The exactness family: the same 2 steps (2 optimizer steps each: mini-batches of 4 of a step's 8
rows, targets of unequal token counts) under every layout take the same gradient (the probes of
trainer.grad_probes, the grad norm, the loss) and end at the same parameters (SGD: a parameter
difference is a gradient difference). The negative control is the 2024 gradient-accumulation bug
of transformers: each micro-batch's token-mean over its own tokens (exactness_workers
LocalNormalisation) must fail the comparison.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from conftest import tiny_overrides

LR = 0.5  # SGD: parameters move by lr * gradient, so they compare gradients too
SFT_FAMILY = {
    "trainer.total_steps": 2, "data.train_batch_size": 8, "actor.ppo_mini_batch_size": 4,
    "actor.optim.name": "sgd", "actor.optim.lr": LR, "actor.grad_clip": 1e6, "actor.loss_agg_mode": "token-mean",
    "trainer.grad_probes.enable": True, "trainer.deterministic": True, "trainer.val_before_train": False,
    "trainer.test_freq": 0, "data.max_response_length": 5,
}
LAYOUTS = {
    "whole": {"actor.ppo_micro_batch_size_per_gpu": 4},
    "mb1": {"actor.ppo_micro_batch_size_per_gpu": 1},
    "dyn": {"actor.use_dynamic_bsz": True, "actor.ppo_max_token_len_per_gpu": 24},
    "dp2-fsdp2-mb1": {"actor.dp_size": 2, "actor.strategy": "fsdp2", "actor.ppo_micro_batch_size_per_gpu": 1},
    "packed-mb2": {"actor.use_remove_padding": True, "actor.ppo_micro_batch_size_per_gpu": 2},
}
PROBE_RTOL = 1e-4


def _sft_fit(model_dir, out_dir, workers=None, **overrides):
    import exactness_workers
    from controllers.sft import SFTTrainer, sft_config

    class Trainer(SFTTrainer):
        final_weights = None

        def train_step(self, step):
            metrics = super().train_step(step)
            if step + 1 == self.cfg.trainer.total_steps:
                self.final_weights = self.gather_weights()
            return metrics

    cfg = sft_config(None, tiny_overrides(model_dir, **{**SFT_FAMILY, "trainer.default_local_dir": out_dir,
                                                         **overrides}))
    trainer = Trainer(cfg, worker_classes={"actor": workers or exactness_workers.RecordingActor})
    clock = time.perf_counter()
    history = trainer.fit()
    initial = torch.load(exactness_workers.initial_weights_path(out_dir, "actor"), weights_only=True)
    return history, trainer.final_weights["actor"], initial, time.perf_counter() - clock


def _differences(a, b):
    """Failures of b against a: every gradient probe (relative to the largest of its kind at that
    step), actor/grad_norm and actor/pg_loss, and every parameter's change."""
    history_a, weights_a, initial, _ = a
    history_b, weights_b, _, _ = b
    failures, worst = [], 0.0
    for ha, hb in zip(history_a, history_b, strict=True):
        probes = [k for k in ha if k.startswith("actor/grad_probe/")]
        assert probes and set(probes) == {k for k in hb if k.startswith("actor/grad_probe/")}
        scale = max(abs(ha[k]) for k in probes)
        for key in probes + ["actor/grad_norm", "actor/pg_loss"]:
            tol = PROBE_RTOL * (scale if key in probes else abs(ha[key]))
            excess = abs(ha[key] - hb[key]) / tol
            worst = max(worst, excess)
            if excess > 1:
                failures.append(f"step {ha['step']} {key}: {ha[key]!r} vs {hb[key]!r}")
    moved = max((weights_a[n] - initial[n]).abs().max().item() for n in initial)
    for name in initial:
        excess = (weights_a[name] - weights_b[name]).abs().max().item() / (PROBE_RTOL * moved)
        worst = max(worst, excess)
        if excess > 1:
            failures.append(f"parameter {name}")
    return failures, worst


@pytest.fixture(scope="module")
def sft_fits(ray_session, tiny_model_dir, tmp_path_factory):
    import exactness_workers

    fits = {}
    for name, layout in LAYOUTS.items():
        fits[name] = _sft_fit(tiny_model_dir, str(tmp_path_factory.mktemp(f"sft-{name}")), **layout)
    fits["mb1-localnorm"] = _sft_fit(tiny_model_dir, str(tmp_path_factory.mktemp("sft-localnorm")),
                                     workers=exactness_workers.LocalNormActor, **LAYOUTS["mb1"])
    print("\nSFT fits: " + ", ".join(f"{name} {fit[3]:.1f} s" for name, fit in fits.items()))
    return fits


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "whole"])
def test_sft_layouts_take_the_same_gradient(sft_fits, layout):
    failures, worst = _differences(sft_fits["whole"], sft_fits[layout])
    print(f"\nSFT whole vs {layout}: worst {worst:.3g} of tolerance")
    assert not failures, failures[:10]


def test_sft_negative_control_per_micro_batch_mean_fails(sft_fits):
    """The 2024 bug: each micro-batch (1 row here) a token-mean over its own tokens. Rows have
    unequal target lengths, so the gradient is reweighted and must fail the comparison."""
    history = sft_fits["whole"][0]
    lengths = {h["step"]: h["sft/num_tokens"] for h in history}
    failures, worst = _differences(sft_fits["whole"], sft_fits["mb1-localnorm"])
    print(f"\nSFT whole vs mb1 with per-micro-batch means: {len(failures)} failures, worst {worst:.3g} of tolerance "
          f"(tokens per step {lengths})")
    assert any("grad_probe" in f for f in failures) and any("parameter" in f for f in failures), failures[:5]


def test_sft_learns_checkpoints_and_resumes(ray_session, tiny_model_dir, tmp_path, capsys):
    """`rlflow sft` on the synthetic task: validation NLL per token falls, the checkpoint is an
    ordinary rlflow checkpoint, and a second command goes on from it."""
    from controllers import checkpoint as ckpt
    from rlflow.cli import main

    args = tiny_overrides(tiny_model_dir, **{
        "trainer.total_steps": 6, "data.train_batch_size": 16, "actor.ppo_mini_batch_size": 16,
        "actor.optim.lr": 3e-3, "trainer.val_before_train": True, "trainer.test_freq": 3, "trainer.save_freq": 3,
        "trainer.default_local_dir": str(tmp_path), "trainer.experiment_name": "sft"})
    assert main(["sft", *args]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("rlflow: validation nll per token"))
    before, after = (float(part.split()[0]) for part in line.split("token ", 1)[1].split(" -> "))
    print(line)
    assert after < before
    root = os.path.join(str(tmp_path), "rlflow", "sft", "checkpoints")
    assert [name for _, name in ckpt.list_checkpoints(root)] == ["step_3", "step_6"]
    files = ckpt.verify(os.path.join(root, "step_6"))["files"]
    assert "actor/model.safetensors" in files and not any(f.startswith("critic/") for f in files)
    # the same command with more steps goes on from step 6
    assert main(["sft", *args, "trainer.total_steps=7"]) == 0
    assert f"resumed from {os.path.join(root, 'step_6')} (step 6)" in capsys.readouterr().err


def test_sft_rows_in_memory_need_their_response(ray_session, tiny_model_dir, tmp_path):
    from controllers.sft import SFT, sft_config

    cfg = sft_config(None, tiny_overrides(tiny_model_dir, **{"trainer.total_steps": 1,
                                                              "trainer.default_local_dir": str(tmp_path)}))
    rows = [{"prompt": f"Reverse: {i}{i + 1}", "response": f"{i + 1}{i}", "data_source": "t",
             "reward_model": {"ground_truth": ""}} for i in range(8)]
    rows[3] = {k: v for k, v in rows[3].items() if k != "response"}
    with pytest.raises(ValueError, match=r"train_dataset \(rows given in memory\), row 3: no 'response' "
                                         r"\(data.response_key"):
        SFT(cfg, train_dataset=rows).fit()
