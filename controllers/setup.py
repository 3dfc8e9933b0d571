"""What a run builds before its first step (PPOTrainer.setup, controllers/ppo.py), as small functions.

PPOTrainer.setup calls them in this order, so that whatever can fail on the driver fails before Ray
starts: the model folder and its tokenizer, the prompt data (files, rows given in memory, or the
synthetic task), the reward function (loaded, or pickled for the reward pool), the environment
class and the reward model's folder. Then Ray, one resource pool per role (or one shared), the
worker groups (started concurrently), every role's model, the agent loop, and the path the actor's
weights take to the rollout engine.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import ray
from transformers import AutoTokenizer

from controllers import cluster
from controllers.agent_loop import AgentLoop
from controllers.endpoint_loop import EndpointAgentLoop
from controllers.openai_endpoint import load_tool_parser, require_server_packages
from controllers.roles import Role, RunContext
from controllers.rollout_source import (GeneratingSource, RecordingSource, ReplaySource, RolloutQueue, Scorer,
                                       StreamingQueue)
from controllers.worker_group import RayWorkerGroup, ResourcePool, WorkerError, gather_groups
from rlflow.agents import load_env_class
from rlflow.agents.fn import load_agent_fn
from rlflow.agents.pool import make_env_pool
from rlflow.algos import get_kl_controller
from rlflow.config import RLFlowConfig
from rlflow.data.dataset import PromptDataset, StatefulDataLoader, rows_from
from rlflow.data.synthetic import make_synthetic_rows
from rlflow.models import MODEL_ALIASES, resolve_model_name
from rlflow.rewards import RewardManager, compute_score, load_custom_reward_fn
from rlflow.rewards.judge import make_judge_pool
from rlflow.rewards.model import RewardModelClient, check_reward_model_folder
from rlflow.rewards.pool import RewardPool, pickle_reward_fn
from workers.base import fixed_worker_threads

# what the workers inherit of the driver's environment (besides OMP_WAIT_POLICY: worker_env)
WORKER_ENV_KEYS = ("RLFLOW_WORKER_THREADS", "RLFLOW_CACHE", "VLLM_ENABLE_V1_MULTIPROCESSING")


# -- the model ----------------------------------------------------------------------------------------

def resolve_model_path(cfg: RLFlowConfig) -> str:
    """"tiny" means the embedded model, built and warm-started locally (cached); an alias of
    rlflow.models.MODEL_ALIASES (e.g. "smollm2-135m") a packaged model converted once into the cache."""
    path = cfg.actor.model.path
    if path == "tiny" or path in MODEL_ALIASES:
        return resolve_model_name(path, cfg.data.synthetic_task)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"actor.model.path={path!r} is not a folder (a local HF model folder, 'tiny', "
                                f"or one of {', '.join(sorted(MODEL_ALIASES))})")
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


def critic_model_path(cfg: RLFlowConfig, model_path: str) -> str:
    """The value model's folder: the policy's (resolved) unless critic.model.path names another."""
    path = cfg.critic.model.path
    return model_path if path in ("", "tiny", cfg.actor.model.path) else path


def load_tokenizer(path: str):
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer in {path} has no eos token; set eos_token in its tokenizer_config.json")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # common for causal LMs; masks keep it out of losses
    return tokenizer


# -- what RLFlow(...) is given in memory (checked in PPOTrainer's constructor) --------------------------

def rows_in_memory(dataset, cfg: RLFlowConfig, name: str) -> list[dict] | None:
    """train_dataset / val_dataset as checked rows (None: not given); an error names `name`, the row
    and the column."""
    return None if dataset is None else rows_from(dataset, prompt_key=cfg.data.prompt_key, name=name)


def check_reward_fn(cfg: RLFlowConfig, reward_fn) -> None:
    """A Python callable that replaces reward.custom_function (None: not given)."""
    if reward_fn is None:
        return
    if not callable(reward_fn):
        raise TypeError(f"reward_fn must be a callable (data_source, solution_str, ground_truth, "
                        f"extra_info=None) -> float | dict, got a {type(reward_fn).__name__}")
    if cfg.reward.num_workers > 0:
        pickle_reward_fn(reward_fn)  # the pool's processes get it pickled: fail now if it does not pickle
    if cfg.reward.custom_function.path:
        print(f"[rlflow] warning: reward_fn replaces reward.custom_function.path="
              f"{cfg.reward.custom_function.path} (that file is not loaded)", flush=True)


# -- data, reward, KL ---------------------------------------------------------------------------------

def make_data(cfg: RLFlowConfig, tokenizer, train_rows: list[dict] | None, val_rows: list[dict] | None,
              target_key: str | None = None):
    """(train dataset, validation dataset or None, the train loader): rows given in memory replace
    data.train_files or the synthetic task (and then validation runs only on val_rows). target_key:
    each item also holds its row's target response (SFT)."""
    data = cfg.data
    kwargs = dict(prompt_key=data.prompt_key, apply_chat_template=_chat_flag(data.apply_chat_template),
                  filter_overlong=data.filter_overlong_prompts, target_key=target_key)
    if train_rows is not None:
        train = PromptDataset(train_rows, tokenizer, data.max_prompt_length,
                              source="train_dataset (rows given in memory)", **kwargs)
        val = None
    elif data.train_files:
        train = PromptDataset.from_files(list(data.train_files), tokenizer, data.max_prompt_length, **kwargs)
        val_files = list(data.val_files) or None
        val = PromptDataset.from_files(val_files, tokenizer, data.max_prompt_length, **kwargs) if val_files else None
    else:
        synthetic_train = make_synthetic_rows(data.synthetic_task, data.synthetic_train_size, data.seed, split="train")
        synthetic_val = make_synthetic_rows(data.synthetic_task, data.synthetic_val_size, data.seed, split="val")
        train = PromptDataset(synthetic_train, tokenizer, data.max_prompt_length, source="synthetic train", **kwargs)
        val = PromptDataset(synthetic_val, tokenizer, data.max_prompt_length, source="synthetic val", **kwargs)
    if val_rows is not None:
        val = PromptDataset(val_rows, tokenizer, data.max_prompt_length,
                            source="val_dataset (rows given in memory)", **kwargs)
    loader = StatefulDataLoader(train, data.train_batch_size, shuffle=data.shuffle, seed=data.seed)
    return train, val, loader


def make_reward_manager(cfg: RLFlowConfig, reward_fn=None) -> RewardManager | RewardPool:
    """The reward function's runner: a RewardPool of reward.num_workers processes (they start on
    the first batch, once Ray runs) or, with 0, the driver. `reward_fn` replaces reward.custom_function."""
    reward, custom = cfg.reward, cfg.reward.custom_function
    # loaded here too, before Ray starts: a missing file, an import error or a missing function
    # stops the run at once, with the same error whether or not a pool scores
    if reward_fn is None:
        fn = load_custom_reward_fn(custom.path, custom.name) if custom.path else compute_score
    else:
        fn = reward_fn
    if reward.num_workers > 0:
        path = None if reward_fn is not None else custom.path
        return RewardPool(path, custom.name, reward.num_workers, reward.timeout_s, reward.on_error,
                          startup_timeout_s=cfg.trainer.startup_timeout_s, fn=reward_fn)
    return RewardManager(fn, on_error=reward.on_error)


def check_env_and_reward_model(cfg: RLFlowConfig) -> None:
    """rollout.agent.env's class and reward_model.path's folder, before Ray starts (the environment
    pool and the reward model's worker group start with the other groups)."""
    if cfg.rollout.agent.env:
        load_env_class(cfg.rollout.agent.env)
    if cfg.rollout.agent.fn:  # the function and the endpoint's tool parser
        require_server_packages()
        load_agent_fn(cfg.rollout.agent.fn)
        load_tool_parser(cfg.rollout.agent.tool_parser)
    if cfg.reward_model.enable:
        check_reward_model_folder(cfg.reward_model.path)


def make_scorer(cfg: RLFlowConfig, tokenizer, reward_manager) -> Scorer:
    """Scores a rollout; its reward model client is set once that worker group runs. The judge's
    folder, template and parser are checked here, before Ray starts (its pool starts on the first batch)."""
    return Scorer(tokenizer, reward_manager, rule_weight=cfg.reward.rule_weight,
                  reward_model_weight=cfg.reward_model.weight, judge=make_judge_pool(cfg),
                  judge_weight=cfg.reward.judge.weight)


def make_kl_controller(cfg: RLFlowConfig):
    kl = cfg.algorithm.kl_ctrl
    return get_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)


def make_replay(cfg: RLFlowConfig) -> ReplaySource | None:
    """The recorded rollouts to train on (trainer.replay_rollouts), or None: generate."""
    trainer = cfg.trainer
    return ReplaySource(trainer.replay_rollouts, trainer.total_steps) if trainer.replay_rollouts else None


# -- Ray, worker groups, models ----------------------------------------------------------------------

def start_ray(cfg: RLFlowConfig, roles: dict[str, Role]) -> None:
    """Ray as the config says (controllers/cluster.py), sized for the processes of `roles`."""
    cluster.ensure_ray(cfg, [role.num_processes(cfg) for role in roles.values()])


@dataclass
class Placement:
    """Where each role's workers go: `pools` (to remove at shutdown), {role: its pool}, and
    {role: the GPUs each of its workers holds}."""

    pools: list[ResourcePool]
    pool_of: dict[str, ResourcePool]
    gpus: dict[str, float]


def place_roles(cfg: RLFlowConfig, roles: dict[str, Role]) -> Placement:
    """One placement group shared by every role when trainer.colocate (a bundle holds one rank of
    each role), else one per role."""
    use_gpu = float(ray.cluster_resources().get("GPU", 0)) > 0
    sizes = {name: role.num_processes(cfg) for name, role in roles.items()}
    per_worker = cfg.trainer.cpus_per_worker
    # a rollout rank's vLLM engine runs its tensor-parallel ranks on the GPUs the rank holds
    gpus_per_rank = {name: cfg.rollout.tensor_parallel_size if name == "rollout" else 1 for name in roles}
    if cfg.trainer.colocate:
        if use_gpu and max(gpus_per_rank.values()) > 1:
            raise ValueError(f"rollout.tensor_parallel_size={cfg.rollout.tensor_parallel_size} needs "
                             "trainer.colocate=false on GPUs: a colocated bundle holds one GPU")
        pool = ResourcePool(max(sizes.values()), per_worker * len(roles), int(use_gpu), name="colocated")
        pools = [pool]
        pool_of = {name: pool for name in roles}
    else:
        pool_of = {name: ResourcePool(size, per_worker, int(use_gpu) * gpus_per_rank[name], name=name)
                   for name, size in sizes.items()}
        pools = list(pool_of.values())
    gpus = {name: (1.0 / len(roles) if cfg.trainer.colocate else float(gpus_per_rank[name])) if use_gpu else 0.0
            for name in roles}
    return Placement(pools, pool_of, gpus)


@dataclass(frozen=True)
class CoreShare:
    """How many threads each worker process computes with, phase by phase: the cores split evenly
    between the processes of the roles that compute at the same time. A process that takes more
    contends with the others; one that takes fewer leaves cores idle while its phase runs alone
    (in the synchronous loop every phase does). With trainer.max_staleness >= 1 the rollout group
    generates through every phase of the step before. RLFLOW_WORKER_THREADS, when set, is the
    user's count for every process and phase."""

    num_cores: int
    processes: dict[str, int]  # role -> its worker processes
    trained: tuple[str, ...]  # the roles that update every step
    generates_ahead: bool  # the rollout group runs alongside the trainers' phases
    fixed: int = 0
    # trainer.deterministic: no thread count changes inside a phase, where timing decides when
    # (a thread count can change float rounding)
    steady: bool = False

    def threads(self, busy, generating: bool | None = None) -> int:
        """Each process's threads in a phase that runs the roles `busy`, and the rollout group
        when `generating` (default: when it generates ahead)."""
        if self.fixed:
            return self.fixed
        generating = self.generates_ahead if generating is None else generating
        roles = set(busy) | ({"rollout"} if generating else set())
        return max(1, self.num_cores // max(1, sum(self.processes[name] for name in roles)))

    def widened(self, running) -> int | None:
        """The threads of `running`, mid-phase, once the rollout group stops generating beside them
        (None: no change)."""
        threads = self.threads(running, generating=False)
        return None if self.steady or threads == self.threads(running, generating=True) else threads

    def start_threads(self, role: str) -> int:
        """A role's threads between the phases the driver sizes (ppo.py sets the trainers' per phase):
        the rollout group's for the whole run, every other role's as if all computed at once."""
        if role == "rollout":
            return self.threads(("rollout", *self.trained) if self.generates_ahead else ("rollout",))
        return self.threads(self.processes)


def usable_cores() -> int:
    """The cores this process may run on (a container's or taskset's limit, not the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# Below this many model parameters a phase computes with the static share (cores // all worker
# processes) instead: the tiny model's generation and update were slower on 2 threads than on 1
# (docs/BENCHMARKS.md); SmolLM2-135M's were faster. Where between the two it turns is not measured.
PER_PHASE_MIN_PARAMETERS = 10_000_000


def model_parameters(model_path: str) -> int | None:
    """The parameters in a model folder's safetensors files, from their headers (None: no such files)."""
    from safetensors import safe_open

    files = [name for name in os.listdir(model_path) if name.endswith(".safetensors")] if os.path.isdir(model_path) else []
    total = 0
    for name in files:
        with safe_open(os.path.join(model_path, name), framework="pt") as weights:
            for key in weights.keys():
                count = 1
                for dim in weights.get_slice(key).get_shape():
                    count *= dim
                total += count
    return total if files else None


def core_share(cfg: RLFlowConfig, roles: dict[str, Role], model_path: str) -> CoreShare:
    processes = {name: role.num_processes(cfg) for name, role in roles.items()}
    num_cores, fixed = usable_cores(), fixed_worker_threads()
    parameters = model_parameters(model_path)
    if not fixed and parameters is not None and parameters < PER_PHASE_MIN_PARAMETERS:
        fixed = max(1, num_cores // max(1, sum(processes.values())))
    return CoreShare(num_cores=num_cores, processes=processes,
                     trained=tuple(name for name, role in roles.items() if role.trains),
                     generates_ahead=cfg.trainer.max_staleness >= 1 and "rollout" in roles,
                     fixed=fixed, steady=cfg.trainer.deterministic)


def start_worker_groups(cfg: RLFlowConfig, roles: dict[str, Role], groups: dict[str, RayWorkerGroup],
                        cores: CoreShare, placement: Placement | None = None,
                        rehost: dict[str, RayWorkerGroup] | None = None,
                        restart: dict[str, RayWorkerGroup] | None = None) -> None:
    """Every role's worker group, started concurrently (each waits for its processes to import torch &
    co, or to build its worker), added to `groups` as it starts, so the caller can stop the started
    ones when another fails; the first error is raised once all have settled. A role's group is its
    group in `rehost` (processes that released an earlier run, or this run's before a lost worker,
    hosting the role's worker again), new processes like its stopped group in `restart` (in that
    group's placement group), or new processes in `placement`."""
    rehost, restart = rehost or {}, restart or {}
    groups.update(rehost)  # stopped with the others if one fails
    env = worker_env()

    def start(name: str, role: Role) -> RayWorkerGroup:
        threads = cores.start_threads(name)
        if name in rehost:
            rehost[name].reinit(cfg, threads, role.worker_class(), name, role.sp_size(cfg))
            return rehost[name]
        if name in restart:
            return restart[name].restarted(cfg, threads)
        return RayWorkerGroup(role.worker_class(), name, role.num_processes(cfg), cfg, placement.pool_of[name],
                              cfg.trainer.cpus_per_worker, placement.gpus[name], env=env, num_threads=threads,
                              sp_size=role.sp_size(cfg))

    with ThreadPoolExecutor(max_workers=len(roles)) as executor:
        starting = {name: executor.submit(start, name, role) for name, role in roles.items()}
        errors = []
        for name, future in starting.items():
            try:
                groups[name] = future.result()
            except Exception as err:  # noqa: BLE001 - the first is re-raised once all have settled
                errors.append(err)
        if errors:
            raise errors[0]


def parking_keys(cfg: RLFlowConfig, roles: dict[str, Role]) -> list[tuple[tuple, tuple[str, ...]]]:
    """[(key, roles)]: what a run must share with a finished one to take its worker groups (IdleWorkers,
    controllers/worker_group.py). Where the placement is only CPU accounting (one node, no GPUs),
    each role's group on its own, and any role's: a process hosts any role's worker
    (workers/process.py), so a group is its number of ranks, the CPUs each reserves and the workers'
    environment, all fixed when its processes start. Elsewhere the whole layout at once (and the
    placement): colocated roles share their bundles' GPUs and nodes."""
    trainer = cfg.trainer
    env = tuple(sorted(worker_env().items()))
    nodes = [node for node in ray.nodes() if node.get("Alive")]
    if len(nodes) == 1 and not ray.cluster_resources().get("GPU", 0):
        return [(("ranks", trainer.cpus_per_worker, env, role.num_processes(cfg)), (name,))
                for name, role in sorted(roles.items())]

    def role_key(name: str, role: Role) -> tuple:
        engine = (cfg.rollout.name, cfg.rollout.tensor_parallel_size) if name == "rollout" else None
        return (name, role.worker_class(), role.num_processes(cfg), role.sp_size(cfg), engine)

    layout = (trainer.colocate, trainer.cpus_per_worker, env,
              tuple(role_key(name, role) for name, role in sorted(roles.items())))
    return [(("layout", *layout), tuple(sorted(roles)))]


def init_models(roles: dict[str, Role], groups: dict[str, RayWorkerGroup], context: RunContext) -> None:
    """Every role's init call (its model loaded on every rank), all dispatched before any is awaited."""
    inits = {}
    for name, role in roles.items():
        method, args = role.init(context)
        inits[name] = (method, groups[name].call_all_async(method, *args))
    for name, (method, futures) in inits.items():
        groups[name].gather(futures, method, startup=True)


def start_env_pool(cfg: RLFlowConfig, groups: dict[str, RayWorkerGroup]):
    """rollout.agent.env's environments (rlflow/agents/pool.py), or None without an environment
    (or without a rollout group: replaying recorded rollouts)."""
    if (cfg.rollout.agent.env or cfg.rollout.agent.fn) and "rollout" in groups:
        return make_env_pool(cfg.rollout.agent, cfg.trainer.startup_timeout_s)
    return None


def make_agent_loop(cfg: RLFlowConfig, groups: dict[str, RayWorkerGroup], env_pool, tokenizer,
                    weight_version=None) -> AgentLoop | None:
    """The agent loop of rollout.agent.env, or of rollout.agent.fn (with its OpenAI endpoint)."""
    if env_pool is None:
        return None
    if cfg.rollout.agent.fn:
        return EndpointAgentLoop(cfg, groups["rollout"], env_pool, tokenizer, weight_version)
    return AgentLoop(cfg, groups["rollout"], env_pool, tokenizer)


def connect_reward_model(scorer: Scorer, groups: dict[str, RayWorkerGroup]) -> None:
    """The Scorer calls the reward model's worker group (reward_model.enable), once it runs."""
    if "reward_model" in groups:
        scorer.reward_model = RewardModelClient(groups["reward_model"])


def choose_weight_sync(rollout_cfg, groups: dict[str, RayWorkerGroup]) -> str:
    """How the actor's weights reach the rollout engine (rollout.weight_sync): collective only when
    asked for; shared_memory where every rollout worker shares actor rank 0's node and a share
    opens there, else object_store; "none" without a rollout group."""
    mode = rollout_cfg.weight_sync
    if "rollout" not in groups:
        return "none"
    if mode == "object_store":
        return mode
    if mode == "collective":
        open_collective_sync(groups["actor"], groups["rollout"], rollout_cfg.weight_sync_bucket_mb)
        return mode
    actor, rollout = groups["actor"], groups["rollout"]
    actor_node = actor.gather(actor.call_rank_async(0, "node_id"), "node_id", startup=True)[0]
    rollout_nodes = set(rollout.gather(rollout.call_all_async("node_id"), "node_id", startup=True))
    try:
        if rollout_nodes != {actor_node}:
            raise WorkerError("some rollout workers are on another node than actor rank 0")
        layout = actor.gather(actor.call_all_async("open_weight_share"), "open_weight_share", startup=True)[0]
        try:
            rollout.gather(rollout.call_all_async("attach_weight_share", layout), "attach_weight_share", startup=True)
        finally:
            actor.gather(actor.call_rank_async(0, "unlink_weight_share"), "unlink_weight_share", startup=True)
    except WorkerError as err:
        if mode == "shared_memory":
            raise WorkerError(f"rollout.weight_sync=shared_memory cannot be used: {err}") from err
        print(f"[rlflow] weight sync through Ray's object store (shared memory unavailable: {err})", flush=True)
        return "object_store"
    return "shared_memory"


def open_collective_sync(actor: RayWorkerGroup, rollout: RayWorkerGroup, bucket_mb: int) -> None:
    """rollout.weight_sync=collective (workers/weight_collective.py): actor rank 0 and every rollout
    rank join a process group of their own; the bucket layout goes to the rollout ranks once."""
    key = "rollout.weight_sync=collective"
    actor_device, rollout_devices = gather_groups(
        [(actor, actor.call_rank_async(0, "weight_sync_device"), "weight_sync_device"),
         (rollout, rollout.call_all_async("weight_sync_device"), "weight_sync_device")], startup=True)
    members = [("actor rank 0", actor_device[0])] + [(f"rollout rank {r}", d) for r, d in enumerate(rollout_devices)]
    for name, (kind, _) in members[1:]:
        if kind != actor_device[0][0]:
            raise WorkerError(f"{key}: actor rank 0 is on {actor_device[0][0]}, {name} on {kind}; one backend (gloo on "
                              "CPU, NCCL on CUDA) serves the group: use rollout.weight_sync=object_store")
    seen: dict[str, str] = {}
    for name, (_, gpu) in members:
        if gpu is not None and gpu in seen:
            raise WorkerError(f"{key}: {seen[gpu]} and {name} share a GPU ({gpu}; trainer.colocate?), and NCCL cannot "
                              "connect two ranks on one GPU: use rollout.weight_sync=shared_memory or object_store")
        seen.setdefault(gpu, name)
    world_size = 1 + rollout.world_size
    spans_nodes = len({actor.node_ids[0], *rollout.node_ids}) > 1
    offer = actor.gather(actor.call_all_async("open_weight_sync", world_size, spans_nodes, bucket_mb * 2**20),
                         "open_weight_sync", startup=True)[0]
    layout = ray.put(offer["layout"])
    joins = rollout.call_per_rank_async("join_weight_sync", [(offer["host"], offer["port"], 1 + rank, world_size, layout,
                                                              spans_nodes) for rank in range(rollout.world_size)])
    gather_groups([(actor, actor.call_rank_async(0, "join_weight_sync"), "join_weight_sync"),
                   (rollout, joins, "join_weight_sync")], startup=True)


def make_rollouts(cfg: RLFlowConfig, replay: ReplaySource | None, loader, groups: dict[str, RayWorkerGroup],
                  score: Scorer, weight_version: Callable[[], int], tokenizer,
                  agent: AgentLoop | None) -> RolloutQueue | StreamingQueue:
    """Where each step's batch comes from: the recording replayed, or generated by the rollout group
    (and recorded when trainer.record_rollouts names a folder): whole batches started ahead
    (RolloutQueue), or streamed groups with rollout.partial."""
    if replay is None and cfg.rollout.partial.enable:
        return StreamingQueue(cfg, loader, groups["rollout"], score, weight_version, tokenizer.pad_token_id,
                              tokenizer.eos_token_id, cfg.trainer.total_steps)
    source = replay or GeneratingSource(cfg, loader, groups["rollout"], score, weight_version=weight_version,
                                        pad_token_id=tokenizer.pad_token_id, agent=agent)
    if cfg.trainer.record_rollouts:
        source = RecordingSource(source, cfg.trainer.record_rollouts)
    return RolloutQueue(source, cfg.trainer.max_staleness, cfg.trainer.total_steps)


def worker_env() -> dict:
    """The environment variables every worker process gets."""
    env = {k: os.environ[k] for k in WORKER_ENV_KEYS if k in os.environ}
    # OpenMP threads that spin while waiting burn the cores the other colocated workers (and any
    # other load) need, and slow every worker down (docs/BENCHMARKS.md). Sleeping waiters change no
    # result. The user's value wins.
    env["OMP_WAIT_POLICY"] = os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
    return env


def _chat_flag(value: str):
    return {"auto": "auto", "true": True, "false": False}.get(str(value).lower(), value)
