"""The single controller: the PPO/GRPO fit loop on the Ray driver.

rollout -> reward -> ref/old log-probs and values (concurrently) -> KL -> advantages -> for each
ppo epoch a seeded shuffle into mini-batches, BatchMeta computed here for each whole mini-batch
and attached to every dp shard -> actor and critic updates dispatched concurrently -> metric
reduction -> weight sync -> validation / logging / checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import torch
from tensordict import TensorDict

from rlflow.algos import estimator_inputs, get_adv_estimator_fn, get_kl_controller, kl_penalty, masked_mean
from rlflow.config import RLFlowConfig, config_to_dict, to_dataclass
from rlflow.metrics import mean_over_minibatches, reduce_metrics
from rlflow.protocol import MICRO_PLAN_KEY, attach_meta, compute_batch_meta, num_bins_for_token_budget, row_token_counts, split_dp

# what the console prints each step (every metric goes to the other trackers)
CONSOLE_KEYS = (
    "reward/score_mean", "reward/acc_mean", "val/acc_mean", "val/score_mean", "actor/pg_loss", "critic/vf_loss",
    "actor/ppo_kl", "actor/kl_loss", "actor/entropy", "response/length_mean", "timing/gen", "timing/update", "timing/step",
)
ROLLOUT_KEYS = ("prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids")


class Timer:
    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start


def resolve_model_path(cfg: RLFlowConfig) -> str:
    """"tiny" means the embedded model, built and warm-started locally (cached)."""
    path = cfg.actor.model.path
    if path == "tiny":
        from rlflow.tiny import warm_start

        return warm_start(cfg.data.synthetic_task)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"actor.model.path={path!r} is not a folder (a local HF model folder, or 'tiny')")
    check_causal_lm_folder(path)
    return path


def check_causal_lm_folder(path: str) -> None:
    """Fail on the driver, before Ray starts, when the folder cannot be a policy."""
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"actor.model.path={path!r} has no config.json: not a HF model folder")
    with open(config_file) as f:
        architectures = json.load(f).get("architectures") or []
    if not any(arch.endswith("ForCausalLM") for arch in architectures):
        raise ValueError(
            f"actor.model.path={path!r} holds a {architectures or 'model without architectures'} model, "
            "not a causal LM: point it at a *ForCausalLM checkpoint"
        )


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer in {path} has no eos token; set eos_token in its tokenizer_config.json")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # common for causal LMs; masks keep it out of losses
    return tokenizer


def default_worker_classes() -> dict[str, type]:
    """The worker class of each role."""
    from workers.actor import ActorWorker, ReferenceWorker
    from workers.critic import CriticWorker
    from workers.rollout.worker import RolloutWorker

    return {"actor": ActorWorker, "critic": CriticWorker, "reference": ReferenceWorker, "rollout": RolloutWorker}


def resolve_worker_classes(overrides: dict[str, type] | None) -> dict[str, type]:
    """The defaults, with a subclass per role where the caller passes one (custom or test workers)."""
    classes = default_worker_classes()
    for role, cls in (overrides or {}).items():
        if role not in classes:
            raise ValueError(f"worker_classes: unknown role {role!r}; roles: {', '.join(classes)}")
        if not (isinstance(cls, type) and issubclass(cls, classes[role])):
            raise TypeError(f"worker_classes[{role!r}] must be a subclass of {classes[role].__name__}, got {cls!r}")
        classes[role] = cls
    return classes


class PPOTrainer:
    def __init__(self, config, worker_classes: dict[str, type] | None = None):
        self.cfg: RLFlowConfig = to_dataclass(config)
        self.worker_classes = resolve_worker_classes(worker_classes)
        self.history: list[dict] = []
        self.groups = {}
        self.pools = []

    # ------------------------------------------------------------------------------------------
    # setup
    # ------------------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        torch.manual_seed(cfg.trainer.seed)
        self.model_path = resolve_model_path(cfg)
        self.critic_path = self.model_path if cfg.critic.model.path in ("", "tiny", cfg.actor.model.path) else cfg.critic.model.path
        self.tokenizer = load_tokenizer(self.model_path)
        self._setup_data()
        self._setup_reward()
        self.kl_ctrl = get_kl_controller(cfg.algorithm.kl_ctrl.type, cfg.algorithm.kl_ctrl.kl_coef,
                                         cfg.algorithm.kl_ctrl.target_kl, cfg.algorithm.kl_ctrl.horizon)
        self.replay = None
        if cfg.trainer.replay_rollouts:
            self.replay = torch.load(cfg.trainer.replay_rollouts, weights_only=True)
            missing = [s for s in range(cfg.trainer.total_steps) if s not in self.replay]
            if missing:
                raise ValueError(f"trainer.replay_rollouts={cfg.trainer.replay_rollouts} has no rollout for steps {missing[:5]}")
        self.recorded: dict = {}
        from controllers.cluster import ensure_ray

        ensure_ray(cfg)
        self._setup_workers()

    def _setup_data(self) -> None:
        from rlflow.data.dataset import PromptDataset, StatefulDataLoader

        cfg, data = self.cfg, self.cfg.data
        kwargs = dict(prompt_key=data.prompt_key, apply_chat_template=_chat_flag(data.apply_chat_template),
                      filter_overlong=data.filter_overlong_prompts)
        if data.train_files:
            train = PromptDataset.from_files(list(data.train_files), self.tokenizer, data.max_prompt_length, **kwargs)
            val_files = list(data.val_files) or None
            val = PromptDataset.from_files(val_files, self.tokenizer, data.max_prompt_length, **kwargs) if val_files else None
        else:
            from rlflow.data.synthetic import make_synthetic_rows

            train_rows = make_synthetic_rows(data.synthetic_task, data.synthetic_train_size, data.seed, split="train")
            val_rows = make_synthetic_rows(data.synthetic_task, data.synthetic_val_size, data.seed, split="val")
            train = PromptDataset(train_rows, self.tokenizer, data.max_prompt_length, source="synthetic train", **kwargs)
            val = PromptDataset(val_rows, self.tokenizer, data.max_prompt_length, source="synthetic val", **kwargs)
        self.train_dataset, self.val_dataset = train, val
        self.loader = StatefulDataLoader(train, data.train_batch_size, shuffle=data.shuffle, seed=data.seed)

    def _setup_reward(self) -> None:
        from rlflow.rewards import RewardManager, compute_score, load_custom_reward_fn

        custom = self.cfg.reward.custom_function
        fn = load_custom_reward_fn(custom.path, custom.name) if custom.path else compute_score
        self.reward = RewardManager(fn, on_error=self.cfg.reward.on_error)

    def _setup_workers(self) -> None:
        from controllers.worker_group import RayWorkerGroup, ResourcePool

        cfg = self.cfg
        classes = self.worker_classes
        roles = {"actor": (classes["actor"], cfg.actor.dp_size)}
        if self.needs_rollout():
            roles["rollout"] = (classes["rollout"], cfg.rollout.dp_size)
        if cfg.critic.enable:
            roles["critic"] = (classes["critic"], cfg.critic.dp_size)
        if cfg.reference.enable:
            roles["reference"] = (classes["reference"], 1)
        use_gpu = _cluster_gpus() > 0
        per_worker = cfg.trainer.cpus_per_worker
        env = dict(_worker_env())
        if cfg.trainer.colocate:
            bundles = max(size for _, size in roles.values())
            pool = ResourcePool(bundles, per_worker * len(roles), int(use_gpu), name="colocated")
            self.pools = [pool]
            pools = {role: pool for role in roles}
        else:
            pools = {role: ResourcePool(size, per_worker, int(use_gpu), name=role) for role, (_, size) in roles.items()}
            self.pools = list(pools.values())
        gpus = (1.0 / len(roles) if cfg.trainer.colocate else 1.0) if use_gpu else 0.0
        # the groups start concurrently: each waits for its processes to import torch & co
        with ThreadPoolExecutor(max_workers=len(roles)) as executor:
            starting = {role: executor.submit(RayWorkerGroup, cls, role, size, cfg, pools[role], per_worker, gpus, env=env)
                        for role, (cls, size) in roles.items()}
            errors = []
            for role, future in starting.items():
                try:
                    self.groups[role] = future.result()
                except Exception as err:  # noqa: BLE001 - the first is re-raised once all have settled
                    errors.append(err)
            if errors:
                raise errors[0]
        total = cfg.trainer.total_steps
        inits = {"actor": self.groups["actor"].call_all_async("init_model", self.model_path, total)}
        if "rollout" in self.groups:
            inits["rollout"] = self.groups["rollout"].call_all_async(
                "init_engine", self.model_path, self.tokenizer.pad_token_id, self.tokenizer.eos_token_id)
        if "critic" in self.groups:
            inits["critic"] = self.groups["critic"].call_all_async("init_model", self.critic_path, total)
        if "reference" in self.groups:
            inits["reference"] = self.groups["reference"].call_all_async("init_model", self.model_path)
        for role, futures in inits.items():
            self.groups[role].gather(futures, "init", startup=True)
        self.num_params = self.groups["actor"].gather(self.groups["actor"].call_all_async("ping"), "ping")
        self.weight_sync = self._setup_weight_sync()

    def _setup_weight_sync(self) -> str:
        """shared_memory where every rollout worker shares actor rank 0's node, else object_store."""
        if "rollout" not in self.groups:
            return "none"
        mode = self.cfg.rollout.weight_sync
        if mode == "object_store":
            return mode
        from controllers.worker_group import WorkerError

        actor, rollout = self.groups["actor"], self.groups["rollout"]
        actor_node = actor.gather([actor.workers[0].node_id.remote()], "node_id", startup=True)[0]
        rollout_nodes = set(rollout.gather(rollout.call_all_async("node_id"), "node_id", startup=True))
        try:
            if rollout_nodes != {actor_node}:
                raise WorkerError("some rollout workers are on another node than actor rank 0")
            layout = actor.gather(actor.call_all_async("open_weight_share"), "open_weight_share", startup=True)[0]
            try:
                rollout.gather(rollout.call_all_async("attach_weight_share", layout), "attach_weight_share", startup=True)
            finally:
                actor.gather([actor.workers[0].unlink_weight_share.remote()], "unlink_weight_share", startup=True)
        except WorkerError as err:
            if mode == "shared_memory":
                raise WorkerError(f"rollout.weight_sync=shared_memory cannot be used: {err}") from err
            print(f"[rlflow] weight sync through Ray's object store (shared memory unavailable: {err})", flush=True)
            return "object_store"
        return "shared_memory"

    def needs_rollout(self) -> bool:
        """Replaying recorded rollouts without validation generates nothing: no rollout group."""
        trainer = self.cfg.trainer
        return not trainer.replay_rollouts or trainer.val_before_train or trainer.test_freq > 0

    # ------------------------------------------------------------------------------------------
    # the loop
    # ------------------------------------------------------------------------------------------
    def fit(self) -> list[dict]:
        cfg = self.cfg
        from rlflow.logging import make_trackers

        run_dir = os.path.join(cfg.trainer.default_local_dir, cfg.trainer.project_name, cfg.trainer.experiment_name)
        self.run_dir = run_dir
        try:
            self.setup()
            start_step = self.maybe_resume()
            os.makedirs(run_dir, exist_ok=True)
            self.tracker = make_trackers(list(cfg.trainer.logger), run_dir, cfg.trainer.total_steps,
                                         cfg.trainer.project_name, cfg.trainer.experiment_name, config_to_dict(cfg),
                                         console_keys=CONSOLE_KEYS)
            if cfg.trainer.val_before_train and self.val_dataset is not None and start_step == 0:
                val = self.validate()
                self.history.append({"step": 0, **val})
                self.tracker.log(val, step=0)
            from controllers.worker_group import WorkerError

            for step in range(start_step, cfg.trainer.total_steps):
                try:
                    metrics = self.train_step(step)
                except (WorkerError, FloatingPointError) as err:
                    raise type(err)(f"step {step + 1} (of {cfg.trainer.total_steps}): {err}") from err
                is_last = step + 1 == cfg.trainer.total_steps
                if self.val_dataset is not None and cfg.trainer.test_freq > 0 and ((step + 1) % cfg.trainer.test_freq == 0 or is_last):
                    metrics.update(self.validate())
                self.history.append({"step": step + 1, **metrics})
                self.tracker.log(metrics, step=step + 1)
                # after the history has this step: a checkpoint holds the history up to its step
                if cfg.trainer.save_freq > 0 and ((step + 1) % cfg.trainer.save_freq == 0 or is_last):
                    self.save_checkpoint(step + 1)
            if cfg.trainer.record_rollouts:
                _atomic_torch_save(self.recorded, cfg.trainer.record_rollouts)
            self.tracker.close()
            return self.history
        finally:
            self.shutdown()

    def _next_rollout(self, step: int, timer: Timer) -> tuple[TensorDict, dict]:
        cfg = self.cfg
        n = cfg.rollout.n
        if self.replay is not None:
            record = self.replay[step]
            batch = TensorDict({k: v for k, v in record.items() if isinstance(v, torch.Tensor)},
                               batch_size=[record["responses"].shape[0]])
            return batch, {"acc": record.get("acc")}
        from rlflow.data.dataset import ROW_DATA_KEYS, get_row_data

        prompts = next(self.loader)
        rows = {key: get_row_data(prompts, key) for key in ROW_DATA_KEYS}
        prompts = prompts.select("input_ids", "attention_mask", "position_ids")
        with timer("gen"):
            batch = self.groups["rollout"].dispatch_dp(
                "generate", prompts, n, cfg.rollout.do_sample, self._sampling_seed(step), cfg.rollout.calculate_log_probs)
        num_prompts = prompts.batch_size[0]
        batch["group_index"] = torch.arange(num_prompts).repeat_interleave(n) + step * num_prompts
        with timer("reward"):
            scores, extras = self._score(batch, {k: [v for v in vals for _ in range(n)] for k, vals in rows.items()})
        batch["token_level_scores"] = scores
        if "reward_baselines" in estimator_inputs(cfg.algorithm.adv_estimator):
            # ReMax's baseline: the score of each prompt's greedy response, shared by its n samples
            with timer("gen"):
                greedy = self.groups["rollout"].dispatch_dp("generate", prompts, 1, False, self._sampling_seed(step))
            with timer("reward"):
                greedy_scores, _ = self._score(greedy, rows)
            batch["reward_baselines"] = greedy_scores.sum(-1).repeat_interleave(n)
        if "acc" in extras:
            batch["acc"] = torch.tensor(extras["acc"], dtype=torch.float32)
        if cfg.trainer.record_rollouts:
            self.recorded[step] = {k: batch[k].clone() for k in batch.keys()}
        return batch, extras

    def _sampling_seed(self, step: int) -> int:
        return self.cfg.trainer.seed * 1_000_003 + step

    def _score(self, batch: TensorDict, rows: dict) -> tuple[torch.Tensor, dict]:
        responses = batch["responses"]
        mask = batch["response_mask"]
        texts = [self.tokenizer.decode(ids[m.bool()].tolist(), skip_special_tokens=True)
                 for ids, m in zip(responses, mask)]
        scores, extras, num_errors = self.reward.score_batch(texts, rows["data_source"], rows["ground_truth"], rows["extra_info"])
        token_scores = torch.zeros(responses.shape, dtype=torch.float32)
        lengths = mask.sum(-1).long()
        for row, (score, length) in enumerate(zip(scores, lengths.tolist())):
            token_scores[row, max(length - 1, 0)] = float(score)  # the last valid response token
        extras = dict(extras)
        extras["num_reward_errors"] = num_errors
        return token_scores, extras

    def train_step(self, step: int) -> dict:
        cfg = self.cfg
        timer = Timer()
        with timer("step"):
            batch, extras = self._next_rollout(step, timer)
            batch = batch.select(*ROLLOUT_KEYS, "group_index", "token_level_scores",
                                 *(k for k in ("acc", "reward_baselines", "rollout_log_probs") if k in batch.keys()))
            model_batch = batch.select(*ROLLOUT_KEYS)
            on_policy = self.update_is_on_policy(batch.batch_size[0])
            # independent forwards, dispatched together
            with timer("forward"):
                futures = {}
                if not on_policy:
                    futures["old_log_probs"] = self.groups["actor"].dispatch_dp_async("compute_log_prob", model_batch)
                if "reference" in self.groups:
                    futures["ref_log_prob"] = self.groups["reference"].dispatch_dp_async("compute_ref_log_prob", model_batch)
                if "critic" in self.groups:
                    futures["values"] = self.groups["critic"].dispatch_dp_async("compute_values", model_batch)
                for key, fut in futures.items():
                    batch[key] = self.groups[_role_of(key)].collect_dp(fut, key)[key]
            metrics = {}
            with timer("adv"):
                self._apply_kl_and_advantages(batch, metrics)
            with timer("update"):
                metrics.update(self._update(batch, step, on_policy))
            with timer("sync"):
                self.sync_weights()
        metrics.update(self._batch_metrics(batch, extras))
        metrics.update({f"timing/{k}": v for k, v in timer.seconds.items()})
        return metrics

    def _apply_kl_and_advantages(self, batch: TensorDict, metrics: dict) -> None:
        cfg, algo = self.cfg, self.cfg.algorithm
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
        for key in ("values", "reward_baselines"):
            if key in batch.keys():
                inputs[key] = batch[key]
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
                meta = compute_batch_meta(minibatch, dp, section.loss_scale_factor)
                shards, _ = split_dp(minibatch, dp, balance_by_tokens=section.use_dynamic_bsz)
                num_micro = None
                if section.use_dynamic_bsz:
                    # every rank runs the same number of micro-batches (FSDP collectives line up)
                    num_micro = max(num_bins_for_token_budget(row_token_counts(s).tolist(), section.ppo_max_token_len_per_gpu)
                                    for s in shards)
                for rank, shard in enumerate(shards):
                    attach_meta(shard, meta)
                    if num_micro is not None:
                        shard.set_non_tensor(MICRO_PLAN_KEY, num_micro)
                    per_rank[rank].append(shard)
        return per_rank

    def update_is_on_policy(self, num_rows: int) -> bool:
        """True when this step's actor update is one optimizer step on the rollout's own policy.

        Then the old log-probs are the actor's current ones (the rollout was synced from it), so
        their forward is skipped and the actor uses its update forward's log-probs, detached.
        KL in the reward needs them on the driver, so it keeps the forward.
        """
        actor = self.cfg.actor
        return (actor.skip_old_log_prob_when_on_policy and actor.ppo_epochs == 1
                and num_rows <= actor.ppo_mini_batch_size and not self.cfg.algorithm.use_kl_in_reward)

    def _update(self, batch: TensorDict, step: int, on_policy: bool) -> dict:
        actor_keys = (ROLLOUT_KEYS + ("advantages",) + (() if on_policy else ("old_log_probs",))
                      + (("ref_log_prob",) if self.cfg.actor.use_kl_loss else ()))
        pending = {}
        pending["actor"] = self.groups["actor"].call_per_rank_async(
            "update", [(shards,) for shards in self.plan_minibatches(batch.select(*actor_keys), "actor", step)])
        if "critic" in self.groups:
            critic_keys = ROLLOUT_KEYS + ("values", "returns")
            pending["critic"] = self.groups["critic"].call_per_rank_async(
                "update", [(shards,) for shards in self.plan_minibatches(batch.select(*critic_keys), "critic", step)])
        metrics = {}
        for role, futures in pending.items():
            per_rank = self.groups[role].gather(futures, "update")
            num_minibatches = len(per_rank[0])
            per_minibatch = [reduce_metrics(rec for rank in per_rank for rec in rank[j]) for j in range(num_minibatches)]
            metrics.update(mean_over_minibatches(per_minibatch))
            skipped = f"{role}/skipped_minibatches"  # a count (nan_policy=skip), not a mean
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
        weights = actor.call_all_async("get_weights")  # a collective under FSDP2: every rank calls
        # rank 0's object goes straight from the actor to the rollout workers, not via the driver
        loads = self.groups["rollout"].call_all_async("load_weights", weights[0])
        self.groups["rollout"].gather(loads, "load_weights")
        # the loads succeeded, so rank 0's get_weights did: fetching its state dict into the driver
        # as well would only copy it through the object store (measured ~11 ms a step at 0.9M
        # parameters); the other ranks return {} under FSDP2
        actor.gather_ranks(weights[1:], "get_weights", ranks=list(range(1, len(weights))))

    def gather_weights(self) -> dict[str, dict[str, torch.Tensor]]:
        """The full (unsharded) state dict of each trained role, from its rank 0."""
        weights = {}
        for role in ("actor", "critic"):
            if role in self.groups:
                weights[role] = self.groups[role].call_all("get_weights")[0]  # a collective under FSDP2
        return weights

    def _batch_metrics(self, batch: TensorDict, extras: dict) -> dict:
        mask = batch["response_mask"].float()
        lengths = mask.sum(-1)
        scores = batch["token_level_scores"].sum(-1)
        metrics = {
            "reward/score_mean": scores.mean().item(),
            "reward/reward_mean": batch["token_level_rewards"].sum(-1).mean().item(),
            "response/length_mean": lengths.mean().item(),
            "response/clip_ratio": (lengths >= mask.shape[1]).float().mean().item(),
            "adv/mean": masked_mean(batch["advantages"], mask).item(),
            "returns/mean": masked_mean(batch["returns"], mask).item(),
        }
        if "values" in batch.keys():
            metrics["critic/values_mean"] = masked_mean(batch["values"], mask).item()
        if "acc" in batch.keys():
            metrics["reward/acc_mean"] = batch["acc"].mean().item()
        if extras.get("num_reward_errors"):
            metrics["reward/num_errors"] = float(extras["num_reward_errors"])
        for name, value in metrics.items():
            if not math.isfinite(value) and self.cfg.trainer.nan_policy == "abort":
                raise FloatingPointError(f"metric {name} is {value}; set trainer.nan_policy=skip to continue past it")
        return metrics

    # -- validation ---------------------------------------------------------------------------------
    def validate(self) -> dict:
        from rlflow.data.dataset import ROW_DATA_KEYS, collate, get_row_data

        cfg = self.cfg
        items = list(self.val_dataset)
        scores, accs, lengths = [], [], []
        for start in range(0, len(items), cfg.data.val_batch_size):
            chunk = collate(items[start : start + cfg.data.val_batch_size], self.val_dataset.pad_token_id)
            rows = {key: get_row_data(chunk, key) for key in ROW_DATA_KEYS}
            prompts = chunk.select("input_ids", "attention_mask", "position_ids")
            pad = (-prompts.batch_size[0]) % cfg.rollout.dp_size
            out = self.groups["rollout"].dispatch_dp("generate", _pad_rows(prompts, pad), 1, cfg.rollout.val_do_sample, 0)
            out = out[: prompts.batch_size[0]]
            token_scores, extras = self._score(out, rows)
            scores.extend(token_scores.sum(-1).tolist())
            accs.extend(extras.get("acc", []))
            lengths.extend(out["response_mask"].sum(-1).tolist())
        metrics = {"val/score_mean": sum(scores) / len(scores), "val/response_length_mean": sum(lengths) / len(lengths)}
        if accs:
            metrics["val/acc_mean"] = sum(accs) / len(accs)
        return metrics

    # -- checkpoints (hooks; see controllers/checkpoint.py) ------------------------------------------
    def maybe_resume(self) -> int:
        try:
            from controllers.checkpoint import resume
        except ImportError:
            return 0
        return resume(self)

    def save_checkpoint(self, step: int) -> None:
        from controllers.checkpoint import save

        save(self, step)

    def shutdown(self) -> None:
        for group in self.groups.values():
            with contextlib.suppress(Exception):
                group.kill()
        for pool in self.pools:
            with contextlib.suppress(Exception):
                pool.remove()
        self.groups, self.pools = {}, []


class RLFlow:
    """The Python API: `RLFlow(config).fit()` returns the per-step metrics history.

    worker_classes: {role: subclass of that role's worker} to run custom workers."""

    def __init__(self, config=None, worker_classes: dict[str, type] | None = None):
        from rlflow.config import load_config

        self.config = load_config() if config is None else config
        self.trainer = PPOTrainer(self.config, worker_classes=worker_classes)

    def fit(self) -> list[dict]:
        return self.trainer.fit()


def _role_of(key: str) -> str:
    return {"old_log_probs": "actor", "ref_log_prob": "reference", "values": "critic"}[key]


def _pad_rows(td: TensorDict, pad: int) -> TensorDict:
    return td if pad == 0 else torch.cat([td, td[:1].expand(pad).clone()], dim=0)


def _chat_flag(value: str):
    return {"auto": "auto", "true": True, "false": False}.get(str(value).lower(), value)


def _cluster_gpus() -> float:
    import ray

    return float(ray.cluster_resources().get("GPU", 0))


def _worker_env() -> dict:
    keep = ("RLFLOW_WORKER_THREADS", "RLFLOW_CACHE", "VLLM_ENABLE_V1_MULTIPROCESSING")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    # OpenMP threads that spin while waiting burn the cores the other colocated workers (and any
    # other load) need: measured on a 2-core machine, a worker's forward/backward ran 10-35x
    # slower with the default policy. Sleeping waiters change no result. The user's value wins.
    env["OMP_WAIT_POLICY"] = os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
    return env


def _atomic_torch_save(obj, path: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)
