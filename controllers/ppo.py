"""The single controller: the PPO/GRPO fit loop on the Ray driver.

rollout and reward (a rollout source, controllers/rollout_source.py; with trainer.max_staleness
k >= 1 the next k steps' rollouts are generated while this one trains, and the next one is scored
during its updates) -> every role's forward (old and reference log-probs, values, ...;
concurrently) -> KL -> advantages -> for each ppo epoch a seeded shuffle into mini-batches,
BatchMeta computed here for each whole mini-batch and attached to every dp shard -> every trained
role's update (actor, critic; concurrently) -> metric reduction -> weight sync -> validation /
logging / checkpoint. The roles are data (controllers/roles.py); what a run builds before its
first step (model, tokenizer, data, reward, worker groups, weight sync) is controllers/setup.py.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import signal
import sys
import time
from collections import defaultdict

import torch
from tensordict import TensorDict

from controllers import checkpoint
from controllers.recovery import AsyncSaver, Preemption, Recovery
from controllers.roles import MODEL_INPUT_KEYS, Role, RunContext, enabled_roles, resolve_roles
from controllers.rollout_source import check_resumable
from controllers.setup import (check_env_and_reward_model, check_reward_fn, choose_weight_sync, connect_reward_model,
                               core_share, critic_model_path, init_models, load_tokenizer, make_agent_loop,
                               make_data, make_kl_controller, make_replay, make_reward_manager, make_rollouts,
                               make_scorer, parking_keys, place_roles, resolve_model_path,
                               rows_in_memory, start_env_pool, start_ray, start_worker_groups)
from controllers.worker_group import (FAILED_RUN_RELEASE_WAIT_S, IDLE_WORKERS, RELEASE_WAIT_S, WorkerError,
                                     all_finished, gather_groups, release_groups, stop_workers)
from rlflow.algos import estimator_inputs, get_adv_estimator_fn, kl_penalty, masked_mean
from rlflow.algos.pass_at_k import group_samples, pass_at_k_metrics, sample_passes
from rlflow.config import RLFlowConfig, config_to_dict, load_config, micro_batch_token_budget, to_dataclass
from rlflow.data.dataset import ROW_DATA_KEYS, collate, get_row_data
from rlflow.logging import make_trackers
from rlflow.metrics import mean_over_minibatches, reduce_metrics
from rlflow.plugins import import_modules
from rlflow.protocol import (MICRO_PLAN_KEY, attach_meta, compute_batch_meta, grouped_by_prompt,
                             common_micro_batch_count, pad_rows, row_token_counts, split_dp)

# what the console prints each step (every metric goes to the other trackers)
CONSOLE_KEYS = (
    "reward/score_mean", "reward/acc_mean", "val/acc_mean", "val/score_mean", "val/nll_mean", "actor/pg_loss", "critic/vf_loss",
    "actor/ppo_kl", "actor/kl_loss", "actor/distill_reverse_kl", "actor/entropy", "response/length_mean", "rollout/num_gen_batches", "timing/gen",
    "timing/update", "timing/step",
)
# what the step keeps of the rollout's batch (the estimator's declared inputs are added to it)
STEP_KEYS = MODEL_INPUT_KEYS + ("group_index", "token_level_scores")
OPTIONAL_STEP_KEYS = ("acc", "reward_baselines", "rollout_log_probs", "rule_scores", "rm_scores", "judge_scores",
                      "judge_errors", "overlong_penalty")


class Timer:
    """Wall seconds per phase name; `prefixed(p)` shares the record under names starting with p."""

    def __init__(self, seconds: dict[str, float] | None = None, prefix: str = ""):
        self.seconds: dict[str, float] = defaultdict(float) if seconds is None else seconds
        self.prefix = prefix

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[self.prefix + name] += time.perf_counter() - start

    def prefixed(self, prefix: str) -> "Timer":
        return Timer(self.seconds, self.prefix + prefix)


def _shares_prompts(section) -> bool:
    """Whether a trained role's section asks for the shared-prompt forward (<role>.model.share_prompt_forward)."""
    return bool(getattr(getattr(section, "model", None), "share_prompt_forward", False))


class PPOTrainer:
    """roles: extra or replacing role declarations (controllers/roles.py); worker_classes:
    {role: subclass of that role's worker} (custom or test workers)."""

    def __init__(self, config, worker_classes: dict[str, type] | None = None, roles: list[Role] | None = None, *,
                 train_dataset=None, val_dataset=None, reward_fn=None):
        self.cfg: RLFlowConfig = to_dataclass(config)
        import_modules(self.cfg.trainer.imports)  # a config that skipped load_config (done there otherwise)
        self.roles = resolve_roles(roles, worker_classes)
        # in-memory data and reward (RLFlow's docstring): checked here, before anything starts
        self.train_rows = rows_in_memory(train_dataset, self.cfg, "train_dataset")
        self.val_rows = rows_in_memory(val_dataset, self.cfg, "val_dataset")
        check_reward_fn(self.cfg, reward_fn)
        self.reward_fn = reward_fn
        self.history: list[dict] = []
        self.groups = {}
        self.pools = []
        self.env_pool = None
        self.resumed_from = None  # the checkpoint folder this fit resumed from
        self.weight_version = 0  # training steps whose update the rollout's weights include
        self.phase = 0  # numbers the phases _share_cores sizes
        self._rollout_threads = 0  # what the rollout ranks were last told (rollout.partial)
        self._rollout_threads_follow_phases = False  # set in setup

    @property
    def worker_classes(self) -> dict[str, type]:
        return {name: role.worker_class() for name, role in self.roles.items()}

    def setup(self) -> None:
        """Everything the steps use (controllers/setup.py); what can fail on the driver fails before Ray starts."""
        cfg = self.cfg
        torch.manual_seed(cfg.trainer.seed)
        self.model_path = resolve_model_path(cfg)
        self.critic_path = critic_model_path(cfg, self.model_path)
        self.tokenizer = load_tokenizer(self.model_path)
        self.train_dataset, self.val_dataset, self.loader = make_data(cfg, self.tokenizer, self.train_rows,
                                                                      self.val_rows)
        self.reward_manager = make_reward_manager(cfg, self.reward_fn)
        check_env_and_reward_model(cfg)
        self.score = make_scorer(cfg, self.tokenizer, self.reward_manager)
        self.kl_ctrl = make_kl_controller(cfg)
        replay = make_replay(cfg)
        if replay is not None and cfg.algorithm.rollout_correction.mode != "none" and cfg.trainer.total_steps > 0:
            self._check_rollout_log_probs(replay.next(0, Timer()).batch, 0)  # before Ray starts
        self.replay = replay
        self.active_roles = enabled_roles(self.roles, cfg)
        self.cores = core_share(cfg, self.active_roles, self.model_path)
        from workers.rollout.worker import resolve_engine_name

        # the HF engine reads its threads per chunk; vLLM-CPU binds them when it starts
        self._rollout_threads_follow_phases = (cfg.rollout.partial.enable and not self.cores.steady
                                               and resolve_engine_name(cfg.rollout.name) == "hf")
        start_ray(cfg, self.active_roles)
        self.score.start()  # the judge's processes load their model while the workers start
        self.start_workers()

    def start_workers(self, kept: dict | None = None, stopped: dict | None = None) -> None:
        """The worker groups with their models, and what the driver wires to them (the agent loop,
        the reward model, the weight sync, the rollout source); again after a lost worker (kept,
        stopped: release_worker_groups)."""
        cfg = self.cfg
        self.start_groups(kept, stopped)
        if self.env_pool is None:  # its processes replace themselves; a restart keeps it
            self.env_pool = start_env_pool(cfg, self.groups)
        if getattr(self, "agent", None) is not None and hasattr(self.agent, "close"):
            self.agent.close()  # rollout.agent.fn's endpoint: the new loop serves its own
        self.agent = make_agent_loop(cfg, self.groups, self.env_pool, self.tokenizer, lambda: self.weight_version)
        connect_reward_model(self.score, self.groups)
        self.weight_sync = choose_weight_sync(cfg.rollout, self.groups)
        self.rollouts = make_rollouts(cfg, self.replay, self.loader, self.groups, self.score,
                                      lambda: self.weight_version, self.tokenizer, self.agent)

    def start_groups(self, kept: dict | None = None, stopped: dict | None = None) -> None:
        """Every active role's worker group with its model loaded. At the start: the groups completed
        runs parked for this run's roles, new ones for the rest. After a lost worker: the kept groups
        host their roles again; a stopped group's role gets new processes in its placement group
        while a kept group holds it (colocated ranks share bundles), else in a new one."""
        cfg = self.cfg
        self.parking = parking_keys(cfg, self.active_roles)
        rehost = IDLE_WORKERS.claim(self.parking) if kept is None else kept
        self.groups.update(rehost)  # shutdown stops them if what follows fails
        restart = {name: group for name, group in (stopped or {}).items() if not group.pool.removed}
        missing = {name: role for name, role in self.active_roles.items() if name not in rehost and name not in restart}
        placement = None
        if missing:
            placement = place_roles(cfg, missing)
            self.pools = placement.pools
        start_worker_groups(cfg, self.active_roles, self.groups, self.cores, placement, rehost, restart)
        context = RunContext(cfg, self.model_path, self.critic_path, self.tokenizer.pad_token_id,
                             self.tokenizer.eos_token_id)
        init_models(self.active_roles, self.groups, context)

    def release_worker_groups(self, lost_roles) -> tuple[dict, dict]:
        """After a lost worker: ({role: group} whose ranks released what they held, to host their roles
        again, {role: group} stopped): the lost roles' groups (None: any may be lost, all) stop at
        once, and so does a group still busy after RELEASE_WAIT_S (it may wait in a collective on a
        lost peer)."""
        groups, self.groups = self.groups, {}
        kept = release_groups(groups, RELEASE_WAIT_S, lost_roles)
        return kept, {name: group for name, group in groups.items() if name not in kept}

    # ------------------------------------------------------------------------------------------
    # the loop
    # ------------------------------------------------------------------------------------------
    def fit(self) -> list[dict]:
        cfg = self.cfg
        run_dir = os.path.join(cfg.trainer.default_local_dir, cfg.trainer.project_name, cfg.trainer.experiment_name)
        self.run_dir = run_dir
        self.recovery = Recovery(cfg, run_dir)
        self.saver = AsyncSaver() if cfg.trainer.async_save else None
        self.stopped_by = None  # the signal's name, when a SIGTERM / SIGINT stopped the run
        completed, failure = False, None
        try:
            with Preemption() as preemption:
                self.setup()
                preemption.arm()
                start_step = self.maybe_resume()
                os.makedirs(run_dir, exist_ok=True)
                self.tracker = make_trackers(list(cfg.trainer.logger), run_dir, cfg.trainer.total_steps,
                                             cfg.trainer.project_name, cfg.trainer.experiment_name,
                                             config_to_dict(cfg), console_keys=CONSOLE_KEYS)
                if cfg.trainer.val_before_train and self.val_dataset is not None and start_step == 0:
                    val = self.validate()
                    self.history.append({"step": 0, **val})
                    self.tracker.log(val, step=0)
                self.recovery.started(self, start_step)
                step = start_step
                while step < cfg.trainer.total_steps and not preemption.requested:
                    try:
                        self.run_step(step)
                    except WorkerError as err:
                        step = self.recovery.recover(self, step, err)  # the step to run again; or it raises
                        continue
                    except FloatingPointError as err:
                        raise FloatingPointError(f"step {step + 1} (of {cfg.trainer.total_steps}): {err}") from err
                    step += 1
                if preemption.requested:
                    self.stop_for_preemption(step, preemption.signal)
                self.wait_for_save()
                self.tracker.close()
                completed = not preemption.requested  # a stopped run's workers are not kept for another
                return self.history
        except Exception as err:
            failure = err
            raise
        finally:
            # a failed run keeps the groups that release what they held (a notebook's next fit after
            # the fix takes them); its lost roles' processes stop
            self.shutdown(keep_workers=completed or failure is not None,
                          lost=getattr(failure, "lost_roles", frozenset()), failed=failure is not None)

    def run_step(self, step: int) -> None:
        """One step, its validation and logging, and the restore points due after it."""
        cfg = self.cfg
        metrics = self.train_step(step)
        is_last = step + 1 == cfg.trainer.total_steps
        if self.val_dataset is not None and cfg.trainer.test_freq > 0 and ((step + 1) % cfg.trainer.test_freq == 0 or is_last):
            metrics.update(self.validate())
        metrics.update(self.recovery.metrics())
        self.history.append({"step": step + 1, **metrics})
        self.tracker.log(metrics, step=step + 1)
        # after the history has this step: a checkpoint holds the history up to its step
        self.note_finished_save(wait=False)
        save_due = cfg.trainer.save_freq > 0 and ((step + 1) % cfg.trainer.save_freq == 0 or is_last)
        if save_due or self.recovery.snapshot_due(step + 1):
            snapshot = checkpoint.collect(self, step + 1)
            if self.recovery.snapshot_due(step + 1):
                self.recovery.snapshotted(snapshot)
            if save_due:
                self.save_snapshot(snapshot)

    def save_snapshot(self, snapshot: checkpoint.Snapshot) -> None:
        """Write a collected snapshot as a checkpoint: now, or (trainer.async_save) in a thread once
        the previous write is done. A write that fails is a failure of the run (Recovery.save_failed)."""
        if self.saver is None:
            try:
                self.recovery.saved(checkpoint.write(snapshot, self.run_dir, self.cfg, self.model_path), snapshot.step)
            except checkpoint.SaveError as err:
                self.recovery.save_failed(err, snapshot.step)
            return
        self.note_finished_save(wait=True)
        self.saver.submit(snapshot, self.run_dir, self.cfg, self.model_path)

    def note_finished_save(self, wait: bool) -> None:
        """How the asynchronous write in progress ended (wait: once it has)."""
        if self.saver is None:
            return
        try:
            finished = self.saver.finished(wait)
        except checkpoint.SaveError as err:
            self.recovery.save_failed(err, err.step)
            return
        if finished is not None:
            self.recovery.saved(finished[1], finished[0])

    def wait_for_save(self) -> None:
        self.note_finished_save(wait=True)

    def stop_for_preemption(self, steps_done: int, signum: int) -> None:
        """A SIGTERM / SIGINT asked the run to stop: the steps done are checkpointed (unless the last
        one just was), and a line says how to go on."""
        self.wait_for_save()
        name = signal.Signals(signum).name
        self.stopped_by = name
        root = checkpoint.checkpoint_root(self.run_dir)
        latest = checkpoint.find_latest(root)
        if steps_done > 0 and (latest is None or not latest.endswith(f"step_{steps_done}")):
            latest = checkpoint.save(self, steps_done)
        where = (f"checkpoint {latest}" if latest else "nothing to checkpoint")
        how = ("run the same command again to go on" if self.cfg.trainer.resume_mode == "auto" else
               "run the same command with trainer.resume_mode=auto to go on")
        print(f"rlflow: stopped by {name} after step {steps_done} of {self.cfg.trainer.total_steps} ({where}); "
              f"{how} (trainer.resume_mode=auto continues from the latest checkpoint under {self.run_dir})",
              file=sys.stderr, flush=True)

    def train_step(self, step: int) -> dict:
        timer = Timer()
        metrics = {}
        with timer("step"):
            self._memory_peaks(None, metrics)
            self._share_cores_with_rollout(trainers_running=False)
            rollout = self.rollouts.take(step, timer)
            self._memory_peaks("gen", metrics)
            staleness = self._check_staleness(rollout.weight_version, step)
            batch = rollout.batch.select(*STEP_KEYS, *(k for k in OPTIONAL_STEP_KEYS if k in rollout.batch.keys()))
            self._check_rollout_log_probs(batch, step)
            on_policy = self.update_is_on_policy(batch.batch_size[0])
            with timer("forward"):
                self._forward(batch, on_policy)
            self._memory_peaks("forward", metrics)
            with timer("adv"):
                self._apply_kl_and_advantages(batch, metrics)
            with timer("update"):
                # max_staleness >= 1: the next step's rollout is collected and scored on the driver
                # while the roles train (its waits under timing/next_*), not after the weight sync
                finish_next = functools.partial(self.rollouts.finish_next, step, timer.prefixed("next_"))
                metrics.update(self._update(batch, step, on_policy, meanwhile=finish_next))
            self._memory_peaks("update", metrics)
            with timer("sync"):
                self.sync_weights()
                self.weight_version = step + 1
            self._memory_peaks("sync", metrics)
        metrics.update(self._batch_metrics(batch, rollout.extras))
        metrics["rollout/staleness"] = float(staleness)
        metrics.update({f"timing/{k}": v for k, v in timer.seconds.items()})
        return metrics

    def _memory_peaks(self, phase: str | None, metrics: dict) -> None:
        """trainer.memory_metrics: each role's peak memory during `phase` (the largest of its
        ranks) and the sum over every worker process; each read resets the peaks (phase None:
        only that, at the start of a step)."""
        if not self.cfg.trainer.memory_metrics:
            return
        pending = {name: group.call_all_async("memory_peak") for name, group in self.groups.items()}
        total = 0
        for name, futures in pending.items():
            peaks = self.groups[name].gather(futures, "memory_peak")
            if phase is not None:
                metrics[f"memory/{phase}/{name}_gb"] = max(peaks) / 2**30
            total += sum(peaks)
        if phase is not None:
            metrics[f"memory/{phase}/all_workers_gb"] = total / 2**30

    def _check_staleness(self, weight_version: int, step: int) -> int:
        """Updates the actor has had since the weights that generated step's batch; a batch older
        than trainer.max_staleness (or from a later step: a mismatched recording) stops the run."""
        staleness = step - weight_version
        limit = self.cfg.trainer.max_staleness
        if not 0 <= staleness <= limit:
            raise RuntimeError(f"the rollout of step {step + 1} was generated by the weights after {weight_version} "
                               f"steps: {staleness} updates behind the actor, outside trainer.max_staleness={limit}")
        return staleness

    def _check_rollout_log_probs(self, batch: TensorDict, step: int) -> None:
        """A rollout correction weights tokens by the engine's log-probs: a batch without them (a
        recording made with rollout.calculate_log_probs=false) stops the run before any forward."""
        mode = self.cfg.algorithm.rollout_correction.mode
        if mode != "none" and "rollout_log_probs" not in batch.keys():
            raise ValueError(f"algorithm.rollout_correction.mode={mode} needs rollout_log_probs, which the batch of "
                             f"step {step + 1} lacks (recorded or generated with rollout.calculate_log_probs=false?)")

    def _forward(self, batch: TensorDict, on_policy: bool) -> None:
        """Every role's no-grad pass over the batch (old log-probs, reference log-probs, values,
        ...), dispatched together; each adds the key it produces."""
        model_batch = batch.select(*MODEL_INPUT_KEYS)
        running = [name for name, role in self.active_roles.items()
                   if role.forward is not None and role.forward.when(self.cfg, on_policy)]
        self._share_cores(running)
        pending = {name: self.groups[name].dispatch_dp_async(self.active_roles[name].forward.method, model_batch)
                   for name in running}
        for name, futures in pending.items():
            forward = self.active_roles[name].forward
            produced = self.groups[name].collect_dp(futures, forward.method)
            batch.update(produced)  # `produces`, and any key it adds (the teacher's top k)
            self._check_finite(batch, name, forward)

    def _share_cores(self, running: list[str]) -> None:
        """The processes of the roles about to compute get their share of the cores for the phase
        (controllers/setup.py CoreShare): a phase that runs alone gets all of them. rollout.partial
        (HF): the trainers take every core and the stream keeps its share beside them, one thread
        more than there are cores: the step waits for the update, not for the stream, which is
        ahead (docs/results/async.md, the thread policy)."""
        self.phase += 1
        generating = (self.cores.generates_ahead and self.rollouts.generating()
                      and not self._rollout_threads_follow_phases)
        threads = self.cores.threads(running, generating=generating)
        self._tell_threads(running, "set_threads", threads)
        self._share_cores_with_rollout(trainers_running=True)

    def _share_cores_with_rollout(self, trainers_running: bool) -> None:
        """rollout.partial: the rollout ranks generate through every phase, a chunk at a time, each
        chunk with the threads they were last told. While the step waits for its batch and no
        trainer computes, they take every core; when a trainers' phase starts, their share again.
        The HF engine only: vLLM-CPU binds its threads to its share when it starts."""
        if not self._rollout_threads_follow_phases or "rollout" not in self.groups:
            return
        threads = self.cores.threads(self.cores.trained if trainers_running else (), generating=True)
        if threads != self._rollout_threads:
            self._tell_threads(["rollout"], "set_threads", threads)
            self._rollout_threads = threads

    def _widen(self, running: list[str]) -> None:
        """The rollout group stopped generating while `running` update: they take its cores from
        their next micro-batch (CoreShare.widened). Under rollout.partial (HF) they hold every core
        already (_share_cores)."""
        if self._rollout_threads_follow_phases:
            return
        threads = self.cores.widened(running)
        if threads is not None:
            self._tell_threads(running, "widen_threads", threads)

    def _tell_threads(self, roles: list[str], method: str, threads: int) -> None:
        """Every rank of `roles` gets `method(threads, phase)`, all dispatched before any is awaited."""
        told = {name: self.groups[name].call_all_async(method, threads, self.phase) for name in roles}
        for name, futures in told.items():
            self.groups[name].gather(futures, method)

    def _check_finite(self, batch: TensorDict, role: str, forward) -> None:
        """A non-finite forward output stops the run naming its role (nan_policy=abort); under
        skip, the mini-batches it reaches are skipped by the updates."""
        mask = batch["response_mask"].bool()
        bad = int((~torch.isfinite(batch[forward.produces][mask])).sum())
        if bad and self.cfg.trainer.nan_policy == "abort":
            raise FloatingPointError(
                f"{role}: {forward.method} returned non-finite {forward.produces} for {bad} of {int(mask.sum())} "
                "response tokens; set trainer.nan_policy=skip to skip the mini-batches they reach")

    def _apply_kl_and_advantages(self, batch: TensorDict, metrics: dict) -> None:
        algo = self.cfg.algorithm
        mask = batch["response_mask"].float()
        rewards = batch["token_level_scores"]
        if algo.use_kl_in_reward:
            kl = kl_penalty(batch["old_log_probs"], batch["ref_log_prob"], algo.kl_penalty) * mask
            rewards = rewards - self.kl_ctrl.value * kl
            current_kl = masked_mean(kl, mask).item()
            metrics["actor/reward_kl_penalty"] = current_kl
            metrics["actor/reward_kl_coef"] = self.kl_ctrl.value
            self.kl_ctrl.update(current_kl, n_steps=batch.batch_size[0])
        batch["token_level_rewards"] = rewards
        fn = get_adv_estimator_fn(algo.adv_estimator)
        inputs = dict(
            token_level_rewards=rewards, response_mask=mask, gamma=algo.gamma, lam=algo.lam,
            index=batch["group_index"], norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo,
        )
        # the batch keys the estimator declares (values, reward_baselines, or a user estimator's own)
        inputs.update({key: batch[key] for key in estimator_inputs(algo.adv_estimator)
                       if key not in inputs and key in batch.keys()})
        missing = [name for name in estimator_inputs(algo.adv_estimator) if name not in inputs]
        if missing:
            raise ValueError(f"algorithm.adv_estimator={algo.adv_estimator} needs {missing}, which this batch lacks "
                             "(a replayed rollout recorded with another estimator?)")
        advantages, returns = fn(**inputs)
        batch["advantages"], batch["returns"] = advantages, returns

    # -- the mini-batch plan: the only place batch metadata is computed ---------------------------
    def plan_minibatches(self, batch: TensorDict, role: str, step: int) -> list[list[TensorDict]]:
        """Per rank, the list of its shards of every mini-batch of this step (epochs included)."""
        section = getattr(self.cfg, role)
        dp = section.dp_size
        num_rows = batch.batch_size[0]
        per_rank: list[list[TensorDict]] = [[] for _ in range(dp)]
        for epoch in range(section.ppo_epochs):
            if section.shuffle:
                generator = torch.Generator().manual_seed(self.cfg.trainer.seed * 7_919 + step * 131 + epoch)
                order = torch.randperm(num_rows, generator=generator)
            else:
                order = torch.arange(num_rows)
            for start in range(0, num_rows, section.ppo_mini_batch_size):
                minibatch = batch[order[start : start + section.ppo_mini_batch_size]]
                if dp > 1 and not section.use_dynamic_bsz and _shares_prompts(section):
                    # each rank gets a prompt's rows together, for its shared-prompt forward; which
                    # rank holds which rows of the mini-batch changes no loss
                    minibatch = minibatch[grouped_by_prompt(minibatch)]
                meta = compute_batch_meta(minibatch, dp, section.loss_scale_factor)
                shards, _ = split_dp(minibatch, dp, balance_by_tokens=section.use_dynamic_bsz)
                num_micro = None
                if section.use_dynamic_bsz:
                    # every rank runs the same number of micro-batches (FSDP collectives line up)
                    num_micro = common_micro_batch_count([row_token_counts(s).tolist() for s in shards],
                                                         micro_batch_token_budget(section))
                for rank, shard in enumerate(shards):
                    attach_meta(shard, meta)
                    if num_micro is not None:
                        shard.set_non_tensor(MICRO_PLAN_KEY, num_micro)
                    per_rank[rank].append(shard)
        return per_rank

    def update_is_on_policy(self, num_rows: int) -> bool:
        """True when this step's actor update is one optimizer step over the whole batch.

        The old log-probs are always the actor's own at the start of the update (for a stale
        batch, the proximal policy of the decoupled objective, rlflow/algos/rollout_correction.py;
        the rollout's are only the behaviour policy), so for a single optimizer step their forward
        is skipped and the actor uses its update forward's log-probs, detached: the same values.
        KL in the reward needs them on the driver, so it keeps the forward.
        """
        actor = self.cfg.actor
        return (actor.skip_old_log_prob_when_on_policy and actor.ppo_epochs == 1
                and num_rows <= actor.ppo_mini_batch_size and not self.cfg.algorithm.use_kl_in_reward)

    def _update(self, batch: TensorDict, step: int, on_policy: bool, meanwhile=None) -> dict:
        """Every trained role's update, dispatched together: per rank, its shards of every mini-batch.
        `meanwhile(updating)` runs on the driver after the dispatch, before the updates are waited
        for (`updating()`: whether one still runs); True from it: the rollout group stopped
        generating, and the updates take its cores (_widen)."""
        pending = {}
        trained = [name for name, role in self.active_roles.items() if role.trains]
        self._share_cores(trained)
        for name, role in self.active_roles.items():
            if role.trains:
                keys = role.update_keys(self.cfg, on_policy)
                keys = (*keys, *(k for k in role.optional_update_keys if k in batch.keys() and k not in keys))
                shards = self.plan_minibatches(batch.select(*keys), role.section or name, step)
                pending[name] = self.groups[name].call_per_dp_rank_async("update", [(s,) for s in shards])
        updates = [future for per_rank in pending.values() for future in per_rank]
        if meanwhile is not None and meanwhile(lambda: not all_finished(updates)):
            self._widen(trained)
        metrics = {}
        for name, futures in pending.items():
            per_rank = self.groups[name].gather(futures, "update")
            num_minibatches = len(per_rank[0])
            per_minibatch = [reduce_metrics(rec for rank in per_rank for rec in rank[j]) for j in range(num_minibatches)]
            metrics.update(mean_over_minibatches(per_minibatch))
            skipped = f"{name}/skipped_minibatches"  # a count (nan_policy=skip), not a mean
            if any(skipped in m for m in per_minibatch):
                metrics[skipped] = float(sum(m.get(skipped, 0.0) for m in per_minibatch))
        return metrics

    def sync_weights(self) -> None:
        if "rollout" not in self.groups:
            return
        actor = self.groups["actor"]
        if self.weight_sync == "shared_memory":
            published = actor.call_all_async("publish_weights")  # a collective under FSDP2
            # Ray starts each load once rank 0's publish has returned: one wait on the driver
            loads = self.groups["rollout"].call_all_async("load_shared_weights", published[0])
            actor.gather(published, "publish_weights")
            self.groups["rollout"].gather(loads, "load_shared_weights")
            return
        if self.weight_sync == "collective":
            # both sides block in the broadcast until the other side is in it: started together,
            # awaited together (a failure on either side is raised at once)
            sends = actor.call_all_async("send_weights")  # every rank: a collective under FSDP2
            receives = self.groups["rollout"].call_all_async("receive_weights")
            gather_groups([(actor, sends, "send_weights"), (self.groups["rollout"], receives, "receive_weights")])
            return
        weights = actor.call_all_async("get_weights")  # a collective under FSDP2: every rank calls
        # rank 0's object goes straight from the actor to the rollout workers, not via the driver
        loads = self.groups["rollout"].call_all_async("load_weights", weights[0])
        self.groups["rollout"].gather(loads, "load_weights")
        # the loads succeeded, so rank 0's get_weights did: fetching its state dict into the driver
        # as well would only copy it through the object store; the other ranks return {} under FSDP2
        actor.gather_ranks(weights[1:], "get_weights", ranks=list(range(1, len(weights))))

    def trained_groups(self) -> dict:
        """{role: worker group} of the roles that train (updated, checkpointed, gathered)."""
        return {name: self.groups[name] for name, role in self.active_roles.items() if role.trains}

    def gather_weights(self) -> dict[str, dict[str, torch.Tensor]]:
        """The full (unsharded) state dict of each trained role, from its rank 0."""
        # a collective under FSDP2: every rank calls
        return {name: group.call_all("get_weights")[0] for name, group in self.trained_groups().items()}

    def _batch_metrics(self, batch: TensorDict, extras: dict) -> dict:
        mask = batch["response_mask"].float()
        lengths = mask.sum(-1)
        scores = batch["token_level_scores"].sum(-1)
        metrics = {
            "reward/score_mean": scores.mean().item(),
            "reward/reward_mean": batch["token_level_rewards"].sum(-1).mean().item(),
            "response/length_mean": lengths.mean().item(),
            # the response (an agent's whole trajectory) filled data.max_response_length
            "response/clip_ratio": (batch["attention_mask"][:, -1] == 1).float().mean().item(),
            "adv/mean": masked_mean(batch["advantages"], mask).item(),
            "returns/mean": masked_mean(batch["returns"], mask).item(),
        }
        if "values" in batch.keys():
            metrics["critic/values_mean"] = masked_mean(batch["values"], mask).item()
        if "acc" in batch.keys():
            metrics["reward/acc_mean"] = batch["acc"].mean().item()
        for key, name in (("rule_scores", "reward/rule_score_mean"), ("rm_scores", "reward/rm_score_mean"),
                          ("judge_scores", "reward/judge_score_mean"), ("judge_errors", "reward/judge_error_frac"),
                          ("overlong_penalty", "reward/overlong_penalty_mean")):
            if key in batch.keys():
                metrics[name] = batch[key].mean().item()
        if "overlong_penalty" in batch.keys():
            metrics["reward/overlong_frac"] = (batch["overlong_penalty"] < 0).float().mean().item()
        if extras.get("num_reward_errors"):
            metrics["reward/num_errors"] = float(extras["num_reward_errors"])
        metrics.update(extras.get("metrics", {}))  # the rollout source's own (dynamic sampling)
        for name, value in metrics.items():
            if not math.isfinite(value) and self.cfg.trainer.nan_policy == "abort":
                raise FloatingPointError(f"metric {name} is {value}; set trainer.nan_policy=skip to continue past it")
        return metrics

    # -- validation ---------------------------------------------------------------------------------
    def validate(self) -> dict:
        """Scores rollout.val_n responses per validation prompt (sampled at rollout.val_temperature
        and rollout.val_top_p when rollout.val_do_sample, greedy otherwise) with the fixed seed 0: the val_n draws of a
        prompt differ, and a run repeats them. val/score_mean, val/acc_mean and
        val/response_length_mean average over all samples; val_n > 1 adds val/pass@k (k = 1, the
        powers of 2 below val_n, val_n; Chen et al.'s unbiased estimator, rlflow/algos/pass_at_k.py:
        a sample passes when its acc == 1, or its score > 0 where the reward reports no acc) and
        val/mean@{val_n} (the prompts' mean score over their samples, averaged over prompts)."""
        cfg = self.cfg
        n = cfg.rollout.val_n
        items = list(self.val_dataset)
        scores, accs, lengths, passed = [], [], [], []
        for start in range(0, len(items), cfg.data.val_batch_size):
            chunk = collate(items[start : start + cfg.data.val_batch_size], self.val_dataset.pad_token_id)
            rows = {key: get_row_data(chunk, key) for key in ROW_DATA_KEYS}
            prompts = chunk.select("input_ids", "attention_mask", "position_ids")
            if self.agent is not None:  # whole episodes, scored by their environments
                out, token_scores, extras = self.agent.run(prompts, rows, n, cfg.rollout.val_do_sample, 0, False,
                                                           cfg.rollout.val_temperature, cfg.rollout.val_top_p)
            else:
                out = self.groups["rollout"].dispatch_dp("generate", pad_rows(prompts, cfg.rollout.dp_size), n,
                                                         cfg.rollout.val_do_sample, 0, False, cfg.rollout.val_temperature,
                                                         cfg.rollout.val_top_p)
                out = out[: prompts.batch_size[0] * n]  # row r answers prompt r // n
                rows = {key: [v for v in vals for _ in range(n)] for key, vals in rows.items()}
                token_scores, extras = self.score(out, rows)
            chunk_scores = token_scores.sum(-1).tolist()
            scores.extend(chunk_scores)
            accs.extend(extras.get("acc", []))
            lengths.extend(out["response_mask"].sum(-1).tolist())
            if n > 1:
                passed.extend(self._val_passes(chunk_scores, extras.get("acc")))
        metrics = {"val/score_mean": sum(scores) / len(scores), "val/response_length_mean": sum(lengths) / len(lengths)}
        if accs:
            metrics["val/acc_mean"] = sum(accs) / len(accs)
        if n > 1:
            metrics.update(pass_at_k_metrics(group_samples(passed, n), group_samples(scores, n), prefix="val/"))
        return metrics

    @staticmethod
    def _val_passes(scores: list[float], accs: list[float] | None) -> list[bool]:
        """Which validation samples pass (for pass@k): acc == 1 where the reward reports acc, else score > 0."""
        accs = accs if accs else [None] * len(scores)
        return [sample_passes(score, acc) for score, acc in zip(scores, accs, strict=True)]

    # -- checkpoints (controllers/checkpoint.py saves the trained roles and this driver state) -----
    def driver_state(self) -> dict:
        """in_flight: the rollouts started for the next steps (max_staleness >= 1), finished and
        kept whole; the data position is past their prompts."""
        # first: finishing them may take more prompts (dynamic sampling's refills)
        in_flight = self.rollouts.state_dict(Timer())
        return {"dataloader": self.loader.state_dict(), "kl_ctrl": self.kl_ctrl.state_dict(),
                "history": list(self.history), "model_path": str(self.model_path), "in_flight": in_flight}

    def load_driver_state(self, state: dict, step: int) -> None:
        in_flight = state.get("in_flight", [])
        check_resumable(in_flight, step, self.cfg)
        self.loader.load_state_dict(state["dataloader"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.history = list(state["history"])
        self.rollouts.load_state_dict(in_flight, step)
        self.sync_weights()  # the rollout engine generates with the restored actor
        self.weight_version = step

    def maybe_resume(self) -> int:
        return checkpoint.resume(self)

    def save_checkpoint(self, step: int) -> None:
        checkpoint.save(self, step)

    def shutdown(self, keep_workers: bool = False, lost=frozenset(), failed: bool = False) -> None:
        """Stops the run's processes; keep_workers (a run that completed or failed): its worker groups
        wait trainer.keep_workers_s for the next run in this driver (IdleWorkers), but those of the
        roles in `lost` (None: all) and those still busy after RELEASE_WAIT_S (a failed run: briefly,
        since its error waits for this) stop."""
        if getattr(self, "saver", None) is not None:
            with contextlib.suppress(Exception):
                self.saver.finished(wait=True)  # a checkpoint being written is finished, whatever else failed
        with contextlib.suppress(Exception):
            self.reward_manager.close()  # the reward pool's processes
        if getattr(self, "score", None) is not None:
            with contextlib.suppress(Exception):
                self.score.close()  # the judge's pool
        if getattr(self, "env_pool", None) is not None:
            with contextlib.suppress(Exception):
                self.env_pool.close()
        if hasattr(getattr(self, "agent", None), "close"):
            with contextlib.suppress(Exception):
                self.agent.close()  # rollout.agent.fn's OpenAI endpoint
        wait_s = FAILED_RUN_RELEASE_WAIT_S if failed else RELEASE_WAIT_S
        if keep_workers and self.groups and IDLE_WORKERS.park(getattr(self, "parking", None), self.groups,
                                                              self.cfg.trainer.keep_workers_s, wait_s, lost):
            self.groups, self.pools = {}, []
            return
        stop_workers(self.groups.values(), self.pools)
        self.groups, self.pools = {}, []


class RLFlow:
    """The Python API: `RLFlow(config).fit()` returns the per-step metrics history.

    train_dataset / val_dataset: prompt rows in memory, in the layout of the data files
    (rlflow/data/dataset.py: `data.prompt_key`, `data_source`, `reward_model: {"ground_truth": ...}`,
    optional `extra_info`, `ability`): a list of dicts, a pandas DataFrame or a datasets.Dataset.
    train_dataset replaces data.train_files (or the synthetic task); with it, validation runs only
    on val_dataset (None: no validation, whatever data.val_files says). val_dataset alone replaces
    the config's validation rows. Rows are checked here, before Ray starts: an error names the
    argument, the row and the column.

    reward_fn: a callable (data_source, solution_str, ground_truth, extra_info=None) -> float | dict
    (`async def` allowed), the contract of a reward file's compute_score; it replaces
    reward.custom_function. With reward.num_workers > 0 it is pickled (cloudpickle: by value for a
    function of a notebook, a lambda or a closure) to the reward processes, so it must pickle:
    checked here. With reward.num_workers=0 the driver calls it.

    worker_classes: {role: subclass of that role's worker} to run custom workers; roles: extra
    role declarations (controllers/roles.py)."""

    def __init__(self, config=None, worker_classes: dict[str, type] | None = None, roles: list[Role] | None = None,
                 *, train_dataset=None, val_dataset=None, reward_fn=None):
        self.config = load_config() if config is None else config
        self.trainer = PPOTrainer(self.config, worker_classes=worker_classes, roles=roles, train_dataset=train_dataset,
                                  val_dataset=val_dataset, reward_fn=reward_fn)

    def fit(self) -> list[dict]:
        return self.trainer.fit()
