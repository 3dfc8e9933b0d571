"""GPU check of the vLLM rollout engine (for a CUDA machine with the GPU `vllm` extra installed).

    pip install -e '.[test,vllm]'
    python scripts/gpu_check_vllm.py                       # tiny Qwen2 built in a temp folder
    python scripts/gpu_check_vllm.py --model DIR --dtype bfloat16 --batch 256 --response-length 128
    python scripts/gpu_check_vllm.py --train               # also the short PPO run (hook below)

What it does, printing each result:
1. versions and the device;
2. rollout throughput of HF generate (workers/rollout/hf.py) and vLLM (workers/rollout/vllm.py)
   on the same batch: tokens/s, engine start, one weight sync;
3. weight sync: trains a copy of the HF model a few optimizer steps towards a probe answer,
   load_weights into the running vLLM engine, then checks that vLLM's greedy answer changed to it
   and that vLLM's rollout log-probs equal the HF model's (max |diff| < --tol; TF32 off on the HF
   side);
4. tensor parallelism (rollout.tensor_parallel_size): a second engine with tensor_parallel_size = the
   number of visible GPUs (--tp to choose; skipped, with a printed line, when only one GPU is
   visible; on a CPU machine only with --tp): its parallel config has that many ranks, then the
   weight-sync check of 3 on it;
5. with --train: `rlflow train rollout.name=vllm trainer.total_steps=3` in a subprocess (HOOK).
Exits non-zero if a check fails.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402

from bench_rollout import make_batch, time_engine, time_sync  # noqa: E402

PROBE = "Q: what is 3+4? A:"


def train_to_answer(model, tok, prompt: str, answer_ids: list[int], device, max_steps: int = 300) -> int:
    ids = tok.encode(prompt, add_special_tokens=False)
    full = torch.tensor([ids + answer_ids], device=device)
    labels = full.clone()
    labels[0, : len(ids)] = -100
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    step = 0
    for step in range(1, max_steps + 1):
        loss = model(input_ids=full, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            if model(input_ids=full).logits[0, len(ids) - 1 : -1].argmax(-1).tolist() == answer_ids:
                break
    model.eval()
    return step


@torch.no_grad()
def hf_log_probs(model, out, device) -> torch.Tensor:
    P = out["prompts"].shape[1]
    result = torch.zeros(out["responses"].shape, dtype=torch.float32)
    for row in range(out.batch_size[0]):
        prompt = out["prompts"][row][out["attention_mask"][row, :P].bool()]
        length = int(out["response_mask"][row].sum())
        response = out["responses"][row, :length]
        ids = torch.cat([prompt, response])[None].to(device)
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        result[row, :length] = logits.log_softmax(-1).gather(-1, response[:, None].to(device))[:, 0].cpu()
    return result


def weight_sync_result(engine, model_dir, tok, args, device) -> dict:
    """The weight-sync check's numbers: trains a copy of the model towards PROBE's answer, loads
    it into `engine`, then its greedy answer and its log-probs against the HF model's (args:
    max_prompt_length, tol). "ok" is the verdict."""
    from transformers import AutoModelForCausalLM

    from tensordict import TensorDict

    from rlflow.protocol import left_pad

    ids, mask = left_pad([tok.encode(PROBE, add_special_tokens=False)], tok.pad_token_id)
    probe = TensorDict({"input_ids": ids, "attention_mask": mask}, batch_size=[1])
    before = engine.generate(probe, n=1, do_sample=False)
    answer = tok.encode(" 7", add_special_tokens=False) + [tok.eos_token_id]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    steps = train_to_answer(model, tok, PROBE, answer, device)
    t0 = time.perf_counter()
    engine.load_weights(model.state_dict())
    sync_s = time.perf_counter() - t0
    after = engine.generate(probe, n=1, do_sample=False, return_log_probs=True)
    got = after["responses"][0, : len(answer)].tolist()
    changed = not torch.equal(before["responses"], after["responses"])
    batch = make_batch(tok, 16, args.max_prompt_length)
    sampled = engine.generate(batch, n=2, do_sample=True, seed=0, return_log_probs=True)
    diffs = []
    for out in (after, sampled):
        ref = hf_log_probs(model, out, device)
        diffs.append(float(((ref - out["rollout_log_probs"]) * out["response_mask"]).abs().max()))
    ok_answer = got == answer and changed
    ok_lp = max(diffs) < args.tol
    return {"ok": ok_answer and ok_lp, "ok_answer": ok_answer, "ok_log_probs": ok_lp, "steps": steps,
            "sync_s": sync_s, "got": got, "answer": answer, "diff_greedy": diffs[0], "diff_sampled": diffs[1],
            "tol": args.tol}


def engine_common(tok, args) -> dict:
    """The engine options both engines of the checks share (args: max_prompt_length, response_length, dtype)."""
    return dict(
        max_prompt_length=args.max_prompt_length, max_response_length=args.response_length,
        temperature=1.0, dtype=args.dtype, seed=0,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
    )


def check_weight_sync(engine, model_dir, tok, args, device, label: str = "weight sync") -> bool:
    r = weight_sync_result(engine, model_dir, tok, args, device)
    answer = "changed to the trained one" if r["ok_answer"] else f"WRONG: {r['got']} (wanted {r['answer']})"
    print(f"{label}: {r['steps']} optimizer steps, load_weights {r['sync_s']:.3f}s; greedy answer {answer}; "
          f"max |vLLM - HF| log-prob greedy {r['diff_greedy']:.2e}, sampled {r['diff_sampled']:.2e} "
          f"(tol {r['tol']:g}) -> {'PASS' if r['ok'] else 'FAIL'}")
    return r["ok"]


def check_tensor_parallel(model_dir, tok, args, device, common) -> bool:
    """An engine split over the visible GPUs, as rollout.tensor_parallel_size builds it."""
    from transformers import AutoConfig

    from workers.rollout.vllm import VLLMRollout

    if device.type == "cuda":
        visible = torch.cuda.device_count()
        tp = args.tp or visible
        if visible < 2:
            print(f"tensor parallel: SKIPPED, {visible} visible GPU (tensor_parallel_size > 1 needs 2 or more)")
            return True
        if not 2 <= tp <= visible:
            print(f"tensor parallel: SKIPPED, --tp {tp} is not in 2..{visible} (the visible GPUs)")
            return True
    else:  # vLLM-CPU runs TP too (a worker process per rank, the cores split between them): only with --tp
        tp = args.tp
        if tp < 2:
            print("tensor parallel: SKIPPED, no GPU (--tp N checks it on vLLM-CPU)")
            return True
    heads = AutoConfig.from_pretrained(model_dir).num_attention_heads
    if heads % tp:
        print(f"tensor parallel: SKIPPED, tensor_parallel_size {tp} does not divide the model's {heads} attention "
              f"heads (--tp to choose another)")
        return True
    t0 = time.perf_counter()
    engine = VLLMRollout(
        model_dir, gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=True,
        engine_in_process=not args.multiprocess, tensor_parallel_size=tp, **common,
    )
    start = time.perf_counter() - t0
    try:
        parallel = engine.llm.llm_engine.vllm_config.parallel_config
        ok_config = parallel.tensor_parallel_size == tp and parallel.world_size == tp
        print(f"tensor parallel: engine start {start:.1f}s; parallel_config tensor_parallel_size "
              f"{parallel.tensor_parallel_size}, world_size {parallel.world_size}, executor "
              f"{parallel.distributed_executor_backend} (wanted {tp}) -> {'PASS' if ok_config else 'FAIL'}")
        ok_sync = check_weight_sync(engine, model_dir, tok, args, device,
                                    label=f"weight sync, tensor_parallel_size {tp}")
    finally:
        engine.shutdown()
    return ok_config and ok_sync


# ----------------------------------------------------------------------------------------------
# HOOK: the short PPO run with the vLLM rollout. It needs `rlflow train` (rlflow/cli.py); until
# that exists, --train reports it as skipped. Extra overrides: --train-arg key=value (repeatable).
def run_ppo_smoke(model_dir: str | None, extra: list[str]) -> bool:
    cmd = ["rlflow"] if shutil.which("rlflow") else [sys.executable, "-m", "rlflow.cli"]
    cmd += ["train", "rollout.name=vllm", "trainer.total_steps=3"]
    if model_dir is not None:
        cmd.append(f"actor.model.path={model_dir}")
    cmd += extra
    try:
        import rlflow.cli  # noqa: F401
    except ImportError as exc:
        print(f"PPO smoke run: SKIPPED, rlflow.cli is not importable ({exc}); command would be: {' '.join(cmd)}")
        return True
    print("PPO smoke run:", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=str(ROOT))
    print(f"PPO smoke run: exit {proc.returncode} after {time.perf_counter() - t0:.0f}s "
          f"-> {'PASS' if proc.returncode == 0 else 'FAIL'}")
    return proc.returncode == 0
# ----------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF model folder (default: build the tiny Qwen2 in a temp folder)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--response-length", type=int, default=16)
    parser.add_argument("--max-prompt-length", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--greedy", action="store_true")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--multiprocess", action="store_true", help="vLLM's engine in its own process (default: in this one)")
    parser.add_argument("--tol", type=float, default=1e-3, help="log-prob tolerance of the weight-sync check")
    parser.add_argument("--tp", type=int, default=0,
                        help="tensor_parallel_size of the tensor-parallel check (default: the visible GPUs)")
    parser.add_argument("--train", action="store_true", help="also run the short PPO run with rollout.name=vllm")
    parser.add_argument("--train-arg", action="append", default=[], help="extra override for the PPO run")
    args = parser.parse_args()

    import vllm
    from transformers import AutoTokenizer

    from workers.rollout.hf import HFRollout
    from workers.rollout.vllm import VLLMRollout

    if not torch.cuda.is_available():
        print("warning: no CUDA device; this script is meant for a GPU machine (scripts/bench_rollout.py is the CPU one)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    print(f"torch {torch.__version__}, vllm {vllm.__version__}, device {name}")

    tmp = None
    model_dir = args.model
    if model_dir is None:
        from rlflow.tiny import build_tiny_model

        tmp = tempfile.TemporaryDirectory(prefix="rlflow-gpu-check-")
        model_dir = build_tiny_model(tmp.name)
    tok = AutoTokenizer.from_pretrained(model_dir)
    batch = make_batch(tok, args.batch, args.max_prompt_length)
    common = engine_common(tok, args)
    ok = True
    rows = []

    t0 = time.perf_counter()
    hf = HFRollout(model_dir, micro_batch_size=args.batch, device=str(device), **common)
    start = time.perf_counter() - t0
    rows.append(("hf generate", start, time_engine(hf, batch, args), time_sync(hf, model_dir)))
    del hf
    if device.type == "cuda":
        torch.cuda.empty_cache()

    t0 = time.perf_counter()
    engine = VLLMRollout(
        model_dir, gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=True,
        engine_in_process=not args.multiprocess, **common,
    )
    start = time.perf_counter() - t0
    rows.append(("vllm", start, time_engine(engine, batch, args), time_sync(engine, model_dir)))

    print(f"\nbatch {args.batch} x n {args.n}, response length {args.response_length}, "
          f"{'greedy' if args.greedy else 'sampled'}, {args.dtype}")
    print(f"{'engine':<14}{'start s':>10}{'gen s':>10}{'tokens':>9}{'tokens/s':>11}{'sync s':>9}")
    for label, start, res, sync in rows:
        print(f"{label:<14}{start:>10.1f}{res['seconds']:>10.3f}{res['tokens']:>9.0f}{res['tok_s']:>11.0f}{sync:>9.3f}")
    print()

    ok &= check_weight_sync(engine, model_dir, tok, args, device)
    engine.shutdown()

    ok &= check_tensor_parallel(model_dir, tok, args, device, common)

    if args.train:
        ok &= run_ppo_smoke(args.model, args.train_arg)
    else:
        print("PPO smoke run: not requested (--train)")

    if tmp is not None:
        tmp.cleanup()
    print("ALL PASS" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
