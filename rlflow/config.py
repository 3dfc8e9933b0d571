"""The config schema, loading (yaml + dotlist overrides) and validation.

Everything a run needs is here as dataclasses; `load_config` merges a yaml recipe and command-line
overrides over the defaults, rejects unknown keys (suggesting the closest valid one), checks the
batch algebra, and fills the inherited values (critic from actor, loss_scale_factor from
data.max_response_length) — all before Ray starts.
"""

from __future__ import annotations

import difflib
import importlib.util
import ipaddress
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf  # noqa: F401
from omegaconf.errors import OmegaConfBaseException

from rlflow.algos import ADV_ESTIMATORS, KL_PENALTY_MODES, LOSS_AGG_MODES, NEEDS_CRITIC, NEEDS_GROUPS, POLICY_LOSSES  # torch-only
from rlflow.algos import LossOptionError, actor_loss_terms, critic_loss_terms, estimator_inputs, option_names
from rlflow.algos.rollout_correction import options_from_config as rollout_correction_options
from rlflow.checkpoint_paths import CheckpointError, resolve_checkpoint
from rlflow.plugins import ENGINE_MODULES, absolute_specs, import_modules

WEIGHT_SYNC_MODES = ("auto", "shared_memory", "object_store", "collective")
LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
STRATEGIES = ("fsdp2", "ddp")
NAN_POLICIES = ("abort", "skip")
OPTIMIZERS = ("adamw", "sgd")


class ConfigError(ValueError):
    """A config a run cannot start with; the message names the key and how to fix it."""


@dataclass
class OptimConfig:
    # adamw | sgd (plain SGD, no momentum: the update is -lr * gradient, so a K-times gradient
    # error is a K-times parameter change; Adam's per-element normalisation hides a uniform scale)
    name: str = "adamw"
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    warmup_steps: int = 0
    lr_scheduler: str = "constant"  # constant | cosine


@dataclass
class ModelConfig:
    # "tiny": the embedded tiny Qwen2 model, built and warm-started locally (rlflow.tiny);
    # "smollm2-135m": SmolLM2-135M-Instruct converted once from a pip package (rlflow.models)
    path: str = "tiny"
    dtype: str = "float32"
    gradient_checkpointing: bool = False
    # the rows of a micro-batch with the same prompt (rollout.n responses) run the prompt once
    # (workers/forward.py); outputs equal the plain forward's up to float rounding
    share_prompt_forward: bool = True


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    # used when train_files is empty: the embedded synthetic task
    synthetic_task: str = "reverse"
    synthetic_train_size: int = 4096
    synthetic_val_size: int = 128
    prompt_key: str = "prompt"
    # SFT (rlflow sft): the target response, a column or a dotted path into the row (the synthetic
    # tasks' rows carry a "response")
    response_key: str = "response"
    max_prompt_length: int = 16
    max_response_length: int = 8
    train_batch_size: int = 32  # prompts per step
    val_batch_size: int = 128
    apply_chat_template: str = "auto"
    filter_overlong_prompts: bool = True
    shuffle: bool = True
    seed: int = 0


@dataclass
class ActorLoraConfig:
    """LoRA adapters on the actor (peft): only the adapters train; the rollout receives the merged
    weights (W + alpha / rank * B @ A) under the base model's names; checkpoints hold the adapters."""

    rank: int = 0  # 0: off (the whole model trains)
    alpha: float = 16.0
    # 0: the update is deterministic (dropout draws differ between layouts, breaking exactness)
    dropout: float = 0.0
    # the linear layers that get adapters (names of modules inside the model, as peft matches them)
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


@dataclass
class MixedPrecisionConfig:
    # the dtype forwards and backwards compute in: float32 | bfloat16 | float16. Below the model's
    # dtype (float32) it is mixed precision: the model stays the master copy the optimizer steps
    # (workers/precision.py). None: the model's dtype (the critic's None: the actor's setting)
    param_dtype: str | None = None
    reduce_dtype: str | None = None  # the data-parallel gradient reduction: float32 | bfloat16 | float16


@dataclass
class DistillConfig:
    """On-policy distillation (docs/CONVENTIONS.md, "On-policy distillation"): the actor's loss adds
    coef * the per-token reverse KL(actor || teacher) on its own sampled tokens; needs teacher.enable."""

    coef: float = 0.0  # 0: off
    # the per-token estimator k of rlflow.algos.kl (as actor.kl_loss_type); k3's gradient is the
    # per-token reverse KL's (log pi - log pi_teacher) grad log pi
    kl_type: str = "low_var_kl"
    # > 0: instead of the reverse KL of the sampled tokens, the forward KL over the teacher's top_k
    # most likely tokens at each sampled position (the teacher's distribution renormalised over them)
    top_k: int = 0
    # false: pure distillation, the policy loss is left out of the actor's loss (rewards are still
    # scored and logged, the advantages computed, but nothing trains on them)
    use_policy_loss: bool = True


@dataclass
class ActorConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: ActorLoraConfig = field(default_factory=ActorLoraConfig)
    mixed_precision: MixedPrecisionConfig = field(default_factory=MixedPrecisionConfig)
    # parameters, gradients and optimizer state wait off the device (CUDA: pinned host memory; CPU:
    # a file under trainer.offload_dir) whenever none of this role's calls runs (workers/offload.py)
    offload: bool = False
    strategy: str = "fsdp2"
    dp_size: int = 1
    # sizes count sequences (responses), after rollout.n
    ppo_mini_batch_size: int = 64
    # rows per forward/backward on one rank; at least the rank's shard of a mini-batch (mini /
    # dp_size) runs that shard as one micro-batch. 64 fits the embedded model's whole mini-batch:
    # on a CPU the per-micro-batch overhead of small ones outweighs anything they save
    ppo_micro_batch_size_per_gpu: int = 64
    use_dynamic_bsz: bool = False
    # a micro-batch's budget of tokens (prompt + response, padding not counted) on one rank; with
    # sp_size > 1 a micro-batch holds sp_size times it, each rank a 1/sp_size slice
    ppo_max_token_len_per_gpu: int = 1024
    # packed micro-batches: the rows' valid tokens concatenated into one row, attention kept inside
    # each sequence (workers/sequence.py); no padding is computed. Replaces share_prompt_forward
    use_remove_padding: bool = False
    # Ulysses sequence parallelism: each packed micro-batch's tokens split over sp_size ranks,
    # attention heads exchanged all-to-all; the role runs dp_size x sp_size processes. > 1 packs
    sp_size: int = 1
    ppo_epochs: int = 1
    shuffle: bool = True
    policy_loss: str = "vanilla"
    # PPO's ratio clip: the defaults of the losses that clip the probability ratio (vanilla, gspo)
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0  # dual clip (vanilla)
    # the chosen loss's own options (its dataclass in rlflow.algos.POLICY_LOSSES), over the above,
    # e.g. geo_mean's log-ratio clip {clip_ratio_low: 0.4, clip_ratio_high: 0.4} (its defaults)
    policy_loss_options: dict[str, Any] = field(default_factory=dict)
    loss_agg_mode: str = "token-mean"
    # divisor of seq-mean-token-sum-norm; None -> data.max_response_length (a constant, never
    # the padded width of a micro-batch)
    loss_scale_factor: float | None = None
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    distill: DistillConfig = field(default_factory=DistillConfig)
    grad_clip: float = 1.0
    log_prob_micro_batch_size_per_gpu: int = 64
    # One on-policy optimizer step per rollout (ppo_epochs=1, one mini-batch, no KL in the reward):
    # the old log-probs equal the current ones, so their forward is skipped and the update uses its
    # own log-probs, detached (ratio exactly 1; what TRL does with num_iterations=1)
    skip_old_log_prob_when_on_policy: bool = True
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4))


@dataclass
class CriticConfig:
    enable: bool | None = None  # None: on for the estimators that need values (rlflow.algos.NEEDS_CRITIC: gae)
    model: ModelConfig = field(default_factory=lambda: ModelConfig(path=""))  # "" -> actor's
    mixed_precision: MixedPrecisionConfig = field(default_factory=MixedPrecisionConfig)  # None fields -> actor's
    offload: bool | None = None  # None -> actor's
    strategy: str | None = None  # None -> actor's
    dp_size: int | None = None  # None -> actor's
    ppo_mini_batch_size: int | None = None
    ppo_micro_batch_size_per_gpu: int | None = None
    use_dynamic_bsz: bool | None = None
    ppo_max_token_len_per_gpu: int | None = None
    use_remove_padding: bool | None = None
    sp_size: int | None = None
    ppo_epochs: int | None = None
    shuffle: bool | None = None
    cliprange_value: float = 0.5
    loss_agg_mode: str | None = None
    # None -> the actor's value (verl #6957: the critic must normalise like the actor)
    loss_scale_factor: float | None = None
    grad_clip: float = 1.0
    forward_micro_batch_size_per_gpu: int = 64
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3))


@dataclass
class ReferenceConfig:
    enable: bool | None = None  # None: on when a KL term is used
    dp_size: int = 1  # ranks that split the reference forward (data-parallel like the actor's)
    log_prob_micro_batch_size_per_gpu: int = 64
    use_remove_padding: bool | None = None  # None -> the actor's
    sp_size: int | None = None  # None -> the actor's; the reference runs dp_size x sp_size processes


@dataclass
class TeacherModelConfig:
    # a HF *ForCausalLM folder with the actor's tokenizer, "tiny" (the embedded model's SFT warm
    # start) or an alias of rlflow.models (smollm2-135m); loaded in actor.model.dtype, computing
    # with the actor's precision (as the reference)
    path: str = ""


@dataclass
class TeacherConfig:
    """The teacher of on-policy distillation (actor.distill): a frozen model whose forward gives
    each sampled response token's log-prob (teacher_log_prob), run like the reference's."""

    enable: bool = False
    model: TeacherModelConfig = field(default_factory=TeacherModelConfig)
    dp_size: int = 1  # ranks that split the teacher forward
    log_prob_micro_batch_size_per_gpu: int = 64
    use_remove_padding: bool | None = None  # None -> the actor's
    sp_size: int | None = None  # None -> the actor's; the teacher runs dp_size x sp_size processes


@dataclass
class AgentConfig:
    """Multi-turn rollouts with an environment (rlflow/agents): env=None is one response per prompt."""

    env: str | None = None  # "file.py:Class" or "package.module:Class", a subclass of rlflow.agents.Environment
    # or an agent as plain code (not with env): "file.py:function" or "package.module:function", called as
    # fn(row, openai_client) -> reward | {"reward": ..., "acc": ...} in the environment processes; the client's
    # base_url is the rollout's OpenAI-compatible endpoint (controllers/openai_endpoint.py, docs/AGENTS.md)
    fn: str | None = None
    # with fn: how a sampled turn becomes an OpenAI tool call when the request has tools: "hermes"
    # (<tool_call>{json}</tool_call>) or "file.py:name" / "module:name" (an object with parse(text) -> ToolCall | None)
    tool_parser: str = "hermes"
    env_kwargs: dict = field(default_factory=dict)  # passed to the class for every trajectory
    max_turns: int = 4  # model turns per trajectory at most
    # environments run in this many Ray processes (rlflow/agents/pool.py); 0: in the driver, no timeout
    num_workers: int = 2
    timeout_s: float = 30.0  # seconds one reset or step call may run; then its process is killed
    on_error: str = "raise"  # raise | zero: a failing, hung or crashing call stops the run, or ends its episode with reward 0


@dataclass
class PartialRolloutConfig:
    """Partial rollout with streamed groups (workers/rollout/stream.py, docs/ASYNC.md): the rollout
    group generates continuously; a weight sync lands between two chunks and the responses in
    flight go on under the new weights; a step trains on the first complete groups. Needs
    trainer.max_staleness >= 1, which bounds the lag of a batch's oldest token."""

    enable: bool = False
    chunk_tokens: int = 16  # tokens sampled for every response in flight between two syncs' chances
    # responses a rollout rank generates at a time; 0: its share of one step's (train_batch_size * n / dp_size)
    max_rows: int = 0
    # which complete groups a step trains: "finished" (the first to finish: short answers first, so a
    # step's batch leans short) or "submitted" (the prompts in loader order, waiting for a slow group)
    batch_order: str = "finished"


@dataclass
class RolloutConfig:
    name: str = "auto"  # hf | vllm | auto (vllm when importable) | <module>:<RolloutEngine subclass>
    dp_size: int = 1
    n: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    do_sample: bool = True
    val_do_sample: bool = False
    val_temperature: float = 1.0
    val_top_p: float = 1.0
    # validation samples per prompt (> 1: val/pass@k and val/mean@{val_n}; needs val_do_sample)
    val_n: int = 1
    # rollout_log_probs: each sampled token's log-prob under the distribution it was drawn from
    calculate_log_probs: bool = True
    micro_batch_size: int = 256  # prompts per decode call of the hf engine
    dtype: str = "float32"
    # vLLM: ranks one engine's model is split over (vllm.LLM's tensor_parallel_size); hf: must be 1
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.1
    enforce_eager: bool = True
    # actor -> rollout weights: shared_memory (a /dev/shm file, same node only), object_store (Ray),
    # collective (a broadcast from actor rank 0: gloo on CPU, NCCL on CUDA; any node), auto
    # (shared_memory when every rollout worker is on actor rank 0's node and it works there)
    weight_sync: str = "auto"
    weight_sync_bucket_mb: int = 256  # collective: the largest flat buffer one broadcast sends
    # free the engine's memory whenever no rollout call runs (vLLM's sleep mode on CUDA, the HF
    # model to host memory on CUDA; nothing to free on CPU); it keeps its weights while asleep
    sleep: bool = False
    partial: PartialRolloutConfig = field(default_factory=PartialRolloutConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)


@dataclass
class CustomRewardConfig:
    path: str | None = None
    name: str = "compute_score"


@dataclass
class OverlongBufferConfig:
    """DAPO's soft overlong punishment of training responses (rlflow/algos/dynamic_sampling.py): a
    response longer than data.max_response_length - len tokens gets -penalty_factor * (its excess
    over that) / len added to its score, reaching -penalty_factor at max_response_length."""

    enable: bool = False
    len: int = 4  # the buffer, in tokens, before data.max_response_length
    penalty_factor: float = 1.0


@dataclass
class JudgeConfig:
    """A judge reward (rlflow/rewards/judge.py): an LLM asked for a verdict on each response, the
    verdict parsed to a score, added with `weight`; it runs in a reward pool of its own
    (num_workers processes, each loading the judge once) under reward.timeout_s and reward.on_error."""

    enable: bool = False
    model_path: str = ""  # a local HF causal LM folder (an instruct model), or an alias (smollm2-135m)
    engine: str = "auto"  # hf | vllm | auto (vllm when importable)
    # the judge's prompt: {prompt}, {response}, {ground_truth} replaced; "" and no template_file: the default
    template: str = ""
    template_file: str = ""  # a text file holding the template (over `template`)
    parser: str = ""  # "": the default ([[x]], Rating: x, yes/no, a number); module:function or file.py:function
    max_prompt_length: int = 1024  # tokens of the judge's prompt; a longer one loses its start
    max_new_tokens: int = 64  # tokens of a verdict
    temperature: float = 0.0  # 0: greedy
    dtype: str = "float32"
    weight: float = 1.0  # a sample's score: reward.rule_weight * rule + weight * the judge's
    num_workers: int = 1  # judge processes, each with its own copy of the judge
    num_gpus: float = 0.0  # GPUs each judge process reserves (0: the judge runs on CPU)


@dataclass
class RewardConfig:
    custom_function: CustomRewardConfig = field(default_factory=CustomRewardConfig)
    # raise | zero: a sample whose function raises, returns NaN/inf, runs past timeout_s or kills its
    # process stops the run (naming it), or scores 0 and is counted in reward/num_errors
    on_error: str = "raise"
    # the reward function runs in this many Ray processes (rlflow/rewards/pool.py); 0: in the driver,
    # one sample after the other, without timeout_s
    num_workers: int = 2
    # seconds a sample may run, from when its process begins it; then the process is killed and replaced
    timeout_s: float = 30.0
    # a sample's score: rule_weight * the reward function's + reward_model.weight * the reward
    # model's (when reward_model.enable); rule_weight=0 with a reward model: the function is not called
    rule_weight: float = 1.0
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)


@dataclass
class RewardModelConfig:
    """A learned reward model (rlflow/rewards/model.py): a *ForSequenceClassification HF folder
    with one label, its own tokenizer and chat template; its score of (prompt, response) is added
    to each sample's score with `weight` (reward.rule_weight weights the reward function's)."""

    enable: bool = False
    path: str = ""
    weight: float = 1.0
    dp_size: int = 1
    micro_batch_size: int = 32  # texts per forward
    max_length: int = 1024  # tokens of a formatted (prompt, response); longer texts lose their start
    dtype: str = "float32"


@dataclass
class KLControlConfig:
    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


@dataclass
class RolloutCorrectionConfig:
    """The rollout engine's vs the trainer's log-probs of each sampled token (rlflow.algos.rollout_correction):
    the mismatch metrics (rollout_corr/*) are reported whenever the batch carries rollout_log_probs;
    mode weights every policy loss's per-token terms by pi_old / pi_rollout (decoupled PPO)."""

    mode: str = "none"  # none | token_tis | seq_tis | token_mis | seq_mis
    cap: float = 2.0  # C of the *_tis modes: weight min(ratio, C); >= 1
    low: float = 0.5  # [low, high]: the *_mis modes' band (ratio outside -> weight 0) and the
    high: float = 2.0  # band of the rollout_corr/out_of_band_frac metric; low <= 1 <= high


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling (rlflow/algos/dynamic_sampling.py): groups (a prompt's rollout.n
    responses) whose `metric` is the same for every response are dropped, and batches of
    data.train_batch_size prompts are generated until train_batch_size groups are kept."""

    enable: bool = False
    metric: str = "acc"  # acc (the reward function's) | score (the sample's final score)
    # generation batches per step at most (the first included); hitting it: on_cap
    max_num_gen_batches: int = 10
    # raise: stop naming the key | fill: complete the batch with dropped groups, warn, count them
    on_cap: str = "raise"


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "gae"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)


@dataclass
class RayConfig:
    address: str | None = None  # None: RAY_ADDRESS, an initialised Ray, or a new local one
    num_cpus: int | None = None
    include_dashboard: bool = False
    dashboard_host: str = "127.0.0.1"  # loopback unless configured otherwise


@dataclass
class GradProbeConfig:
    """A diagnostic, off by default: per optimizer step each trainable worker reports the norm of
    every parameter tensor's gradient and `num_projections` fixed random projections <g, r_k> of
    the whole gradient, after the data-parallel reduction and before clipping (workers/probes.py)."""

    enable: bool = False
    num_projections: int = 4
    seed: int = 0


@dataclass
class TrainerConfig:
    total_steps: int = 40
    test_freq: int = 10
    val_before_train: bool = True
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    project_name: str = "rlflow"
    experiment_name: str = "default"
    default_local_dir: str = "outputs"
    save_freq: int = -1
    resume_mode: str = "auto"  # auto | disable | a checkpoint path
    max_to_keep: int = 2
    # a worker lost (its process died, or a call hung past remote_timeout_s): restart its group (the
    # other groups host their roles again in their processes), restore the newest restore point and
    # go on, up to this many times (0: stop)
    max_failures: int = 0
    # with max_failures: every this many steps, a copy of the trained state in the driver's memory
    # (a restore point newer than the last checkpoint; 0: checkpoints only)
    snapshot_freq: int = 0
    # write each checkpoint in a thread while the next steps run (the state is collected first)
    async_save: bool = False
    seed: int = 0
    deterministic: bool = False
    replay_rollouts: str | None = None  # a folder of recorded rollouts to train on instead of generating
    record_rollouts: str | None = None  # a folder: each step's rollout batch is written to step_<N>.pt
    # 0: each step trains on a rollout of its own weights. k >= 1: the rollouts of the next k steps
    # are generated while this step trains (a batch is at most k updates older than the actor)
    max_staleness: int = 0
    remote_timeout_s: float = 600.0  # every remote call and collective of a step
    startup_timeout_s: float = 900.0  # spawning workers and loading models (at least remote_timeout_s)
    # a completed (or failed: all but its lost workers) run's worker processes wait this long for the
    # next run in the same driver (a notebook's next fit), which then skips their start-up; 0: they
    # stop with the run
    keep_workers_s: float = 60.0
    nan_policy: str = "abort"  # abort | skip (skip the mini-batch and count it)
    colocate: bool = True  # all roles share one placement group of bundles
    cpus_per_worker: float = 0.5
    # where a role's ranks meet for torch.distributed (gloo/NCCL), on a cluster of several nodes:
    # null: rank 0's node IP as Ray sees it (loopback when the group is on one node); a network
    # interface name ("eth0"): its IPv4 address on rank 0's node, and GLOO/NCCL_SOCKET_IFNAME on
    # every rank; an IPv4 address of rank 0's node (every role with several ranks has rank 0 there)
    dist_interface: str | None = None
    # where offloaded trainer state waits on a CPU device (<role>.offload): null, the system's
    # temporary directory. One nameless file per worker, gone when reloaded or when the process ends
    offload_dir: str | None = None
    # memory/<phase>/<role>_gb: each process's peak memory during each phase of a step (CPU:
    # resident set; CUDA: torch's allocated), a few Ray calls per phase
    memory_metrics: bool = False
    grad_probes: GradProbeConfig = field(default_factory=GradProbeConfig)
    # modules imported on the driver (before validation) and first in every role's worker process,
    # where user code registers its own losses, estimators, engines (rlflow/plugins.py): file.py
    # paths or dotted module names
    imports: list[str] = field(default_factory=list)


@dataclass
class RLFlowConfig:
    data: DataConfig = field(default_factory=DataConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    ray: RayConfig = field(default_factory=RayConfig)


# ---------------------------------------------------------------------------------------------
# Unknown keys, with the closest valid key suggested
# ---------------------------------------------------------------------------------------------


def _schema_children(schema: Any) -> dict[str, Any]:
    return {f.name: getattr(schema, f.name) for f in fields(schema)}


def _all_paths(schema: Any, prefix: str = "") -> list[str]:
    paths = []
    for name, value in _schema_children(schema).items():
        path = f"{prefix}{name}"
        paths.append(path)
        if is_dataclass(value):
            paths.extend(_all_paths(value, path + "."))
    return paths


def _suggest(bad_path: str, siblings: list[str], schema_root: Any) -> str:
    leaf = bad_path.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.6)
    if close:
        parent = bad_path.rsplit(".", 1)[0] + "." if "." in bad_path else ""
        return f"did you mean '{parent}{close[0]}'?"
    full = difflib.get_close_matches(bad_path, _all_paths(schema_root), n=1, cutoff=0.5)
    same_leaf = [p for p in _all_paths(schema_root) if p.rsplit(".", 1)[-1] == leaf]
    if same_leaf:
        return f"did you mean '{same_leaf[0]}'?"
    if full:
        return f"did you mean '{full[0]}'?"
    return f"valid keys here: {', '.join(sorted(siblings))}"


def check_unknown_keys(user: Any, source: str, schema: Any = None, prefix: str = "", root: Any = None) -> None:
    schema = schema if schema is not None else RLFlowConfig()
    root = root if root is not None else schema
    if not isinstance(user, dict):
        return
    children = _schema_children(schema)
    for key, value in user.items():
        path = f"{prefix}{key}"
        if key not in children:
            raise ConfigError(f"unknown config key '{path}' (from {source}); {_suggest(path, list(children), root)}")
        if is_dataclass(children[key]):
            if value is not None and not isinstance(value, dict):
                raise ConfigError(f"config key '{path}' (from {source}) is a section; got the value {value!r}")
            check_unknown_keys(value, source, children[key], path + ".", root)


def _dotlist_to_dict(overrides: list[str]) -> list[tuple[str, dict]]:
    parsed = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. actor.optim.lr=1e-5)")
        key = item.split("=", 1)[0].lstrip("+")
        as_dict = OmegaConf.to_container(OmegaConf.from_dotlist([item.lstrip("+")]))
        parsed.append((key, as_dict))
    return parsed


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> DictConfig:
    """Defaults <- yaml file <- dotlist overrides, validated and resolved."""
    merged = OmegaConf.structured(RLFlowConfig)
    layers: list[tuple[str, Any]] = []
    if path is not None:
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise ConfigError(f"config file not found: {path}")
        try:
            file_cfg = OmegaConf.load(path)
        except Exception as err:  # yaml syntax errors
            raise ConfigError(f"cannot parse config file {path}: {err}") from err
        file_dict = OmegaConf.to_container(file_cfg) or {}
        if not isinstance(file_dict, dict):
            raise ConfigError(f"config file {path} must hold a mapping at top level")
        check_unknown_keys(file_dict, path)
        layers.append((path, file_cfg))
    for key, as_dict in _dotlist_to_dict(list(overrides or [])):
        check_unknown_keys(as_dict, f"override '{key}'")
        layers.append((f"override '{key}'", OmegaConf.create(as_dict)))
    for source, layer in layers:
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as err:
            key = getattr(err, "full_key", None) or "?"
            reason = str(getattr(err, "msg", err)).splitlines()[0]
            raise ConfigError(f"bad value for config key '{key}' (from {source}): {reason}") from err
    return resolve_config(merged)


def to_dataclass(cfg: DictConfig | RLFlowConfig | dict) -> RLFlowConfig:
    if isinstance(cfg, RLFlowConfig):
        return cfg
    if isinstance(cfg, dict):
        cfg = OmegaConf.merge(OmegaConf.structured(RLFlowConfig), cfg)
    elif OmegaConf.get_type(cfg) is not RLFlowConfig:
        cfg = OmegaConf.merge(OmegaConf.structured(RLFlowConfig), cfg)
    return OmegaConf.to_object(cfg)


def config_to_dict(cfg: DictConfig | RLFlowConfig) -> dict:
    """Plain containers (for run_config.json and the trackers)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg))


def resolve_config(cfg: DictConfig) -> DictConfig:
    """Import trainer.imports, fill inherited values, then validate. Returns a new DictConfig."""
    cfg = cfg.copy()
    _import_user_modules(cfg)  # first: what they register decides defaults (critic.enable) and validity
    actor, critic, data = cfg.actor, cfg.critic, cfg.data
    if actor.loss_scale_factor is None:
        actor.loss_scale_factor = float(data.max_response_length)
    for name in ("offload", "strategy", "dp_size", "ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "use_dynamic_bsz",
                 "ppo_max_token_len_per_gpu", "use_remove_padding", "sp_size", "ppo_epochs", "shuffle", "loss_agg_mode",
                 "loss_scale_factor"):
        if critic[name] is None:
            critic[name] = actor[name]
    for name in ("use_remove_padding", "sp_size"):
        if cfg.reference[name] is None:
            cfg.reference[name] = actor[name]
        if cfg.teacher[name] is None:
            cfg.teacher[name] = actor[name]
    if not critic.model.path:
        critic.model.path = actor.model.path
    chosen = actor.mixed_precision.param_dtype
    actor.mixed_precision.param_dtype = chosen or actor.model.dtype
    critic.mixed_precision.param_dtype = critic.mixed_precision.param_dtype or chosen or critic.model.dtype
    actor.mixed_precision.reduce_dtype = actor.mixed_precision.reduce_dtype or "float32"
    critic.mixed_precision.reduce_dtype = critic.mixed_precision.reduce_dtype or actor.mixed_precision.reduce_dtype
    if critic.enable is None:
        critic.enable = cfg.algorithm.adv_estimator in NEEDS_CRITIC
    if cfg.reference.enable is None:
        cfg.reference.enable = bool(actor.use_kl_loss or cfg.algorithm.use_kl_in_reward)
    validate_config(cfg)
    return cfg


def _need(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _import_user_modules(cfg: DictConfig) -> None:
    cfg.trainer.imports = absolute_specs(cfg.trainer.imports)
    try:
        import_modules(cfg.trainer.imports)
    except ImportError as err:
        raise ConfigError(str(err)) from err


def packs_sequences(section) -> bool:
    """Whether a role's forwards run packed micro-batches (sequence parallelism always packs)."""
    return bool(section.use_remove_padding) or section.sp_size > 1


def micro_batch_token_budget(section) -> int:
    """Tokens one micro-batch may hold under use_dynamic_bsz: the per-rank budget times sp_size
    (each of the sp ranks holds a 1/sp_size slice of the packed row)."""
    return section.ppo_max_token_len_per_gpu * section.sp_size


# ---------------------------------------------------------------------------------------------
# Numeric ranges: one table (NUMERIC_RANGES), one check (check_ranges)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Range:
    """The values a numeric key accepts: from `low` to `high`, each end closed or open, or absent
    (None: unbounded). `meaning` is a short note the error repeats ("0: off"); `null`: None is
    accepted too. A list value (optim.betas) has each element checked."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    meaning: str = ""
    null: bool = False

    def contains(self, value: Any) -> bool:
        if value is None:
            return self.null
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:  # NaN
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self) -> str:
        low = f"{'>' if self.low_open else '>='} {self.low}" if self.low is not None else ""
        if self.high is None:
            text = low or "a number"
        elif self.high == float("inf") and self.high_open:
            text = f"{low} and finite" if low else "finite"
        elif self.low is None:
            text = f"{'<' if self.high_open else '<='} {self.high}"
        else:
            text = f"in {'(' if self.low_open else '['}{self.low}, {self.high}{')' if self.high_open else ']'}"
        return f"{text} or null" if self.null else text

    def error(self, key: str, value: Any) -> str:
        """The one line naming the key: `actor.optim.lr must be > 0, got -0.0001`."""
        note = f" ({self.meaning})" if self.meaning else ""
        return f"{key} must be {self.describe()}{note}, got {'null' if value is None else value}"


def at_least(low: float, meaning: str = "", null: bool = False) -> Range:
    return Range(low=low, meaning=meaning, null=null)


def above(low: float, meaning: str = "") -> Range:
    return Range(low=low, low_open=True, meaning=meaning)


def within(low: float, high: float, ends: str = "[]", meaning: str = "") -> Range:
    """`ends`: "[]", "[)", "(]" or "()", as the interval is written."""
    return Range(low=low, high=high, low_open=ends[0] == "(", high_open=ends[1] == ")", meaning=meaning)


def seconds() -> Range:
    return Range(low=0, high=float("inf"), low_open=True, high_open=True, meaning="seconds")


def _expand_keys(table: dict[str, Range]) -> dict[str, Range]:
    """`{actor,critic}.optim.lr` -> actor.optim.lr and critic.optim.lr (one brace group per key)."""
    expanded: dict[str, Range] = {}
    for pattern, allowed in table.items():
        head, brace, rest = pattern.partition("{")
        if not brace:
            expanded[pattern] = allowed
            continue
        names, _, tail = rest.partition("}")
        for name in names.split(","):
            expanded[f"{head}{name}{tail}"] = allowed
    return expanded


# Every numeric key of the schema with a meaningful range, decided from how the code reads it
# (sizes are counts >= 1, timeouts seconds > 0, coefficients >= 0, ...). check_ranges runs it first
# in validate_config, so the checks after it can divide by sizes; checks that relate two keys
# (divisibility, rollout.n >= 2 for group estimators, low < high) stay in the section checks.
# A new int/float key goes here or in NO_RANGE (tests/test_config.py holds every key to that).
NUMERIC_RANGES: dict[str, Range] = _expand_keys({
    # data
    "data.synthetic_train_size": at_least(1),
    "data.synthetic_val_size": at_least(1),
    "data.max_prompt_length": at_least(1),
    "data.max_response_length": at_least(1),
    "data.train_batch_size": at_least(1),
    "data.val_batch_size": at_least(1),
    # the trained roles (critic's None keys are the actor's by now)
    "{actor,critic}.dp_size": at_least(1),
    "{actor,critic}.ppo_mini_batch_size": at_least(1),
    "{actor,critic}.ppo_micro_batch_size_per_gpu": at_least(1),
    "{actor,critic}.ppo_max_token_len_per_gpu": at_least(1),
    "{actor,critic}.sp_size": at_least(1, "1: no sequence parallelism"),
    "{actor,critic}.ppo_epochs": at_least(1),
    "{actor,critic}.loss_scale_factor": above(0),
    "{actor,critic}.grad_clip": above(0, "the largest gradient norm; inf: no clipping"),
    "{actor,critic}.optim.lr": above(0),
    "{actor,critic}.optim.weight_decay": at_least(0),
    "{actor,critic}.optim.betas": within(0, 1, "[)"),
    "{actor,critic}.optim.eps": at_least(0),
    "{actor,critic}.optim.warmup_steps": at_least(0, "0: no warmup"),
    "actor.lora.rank": at_least(0, "0: LoRA off"),
    "actor.lora.alpha": above(0),
    "actor.lora.dropout": within(0, 1, "[)"),
    "actor.clip_ratio_low": within(0, 1, "[)", "the ratio's clip at 1 - clip_ratio_low"),
    "actor.clip_ratio_high": at_least(0),
    "actor.clip_ratio_c": above(1.0, "the dual clip of negative advantages"),
    "actor.entropy_coeff": at_least(0, "0: no entropy bonus"),
    "actor.kl_loss_coef": at_least(0),
    "actor.distill.coef": at_least(0, "0: no distillation"),
    "actor.distill.top_k": at_least(0, "0: the reverse KL of the sampled tokens"),
    "actor.log_prob_micro_batch_size_per_gpu": at_least(1),
    "critic.cliprange_value": at_least(0),
    "critic.forward_micro_batch_size_per_gpu": at_least(1),
    "reference.dp_size": at_least(1),
    "reference.log_prob_micro_batch_size_per_gpu": at_least(1),
    "reference.sp_size": at_least(1, "1: no sequence parallelism"),
    "teacher.dp_size": at_least(1),
    "teacher.log_prob_micro_batch_size_per_gpu": at_least(1),
    "teacher.sp_size": at_least(1, "1: no sequence parallelism"),
    # rollout
    "rollout.dp_size": at_least(1),
    "rollout.n": at_least(1),
    "rollout.temperature": above(0),
    "rollout.top_p": within(0, 1, "(]"),
    "rollout.val_temperature": above(0),
    "rollout.val_top_p": within(0, 1, "(]"),
    "rollout.val_n": at_least(1),
    "rollout.micro_batch_size": at_least(1, "prompts per generate call"),
    "rollout.tensor_parallel_size": at_least(1),
    "rollout.gpu_memory_utilization": within(0, 1, "(]"),
    "rollout.weight_sync_bucket_mb": at_least(1, "MiB per broadcast"),
    "rollout.partial.chunk_tokens": at_least(1),
    "rollout.partial.max_rows": at_least(0, "0: a rank's share of one step's"),
    "rollout.agent.max_turns": at_least(1),
    "rollout.agent.num_workers": at_least(0, "0: in the driver"),
    "rollout.agent.timeout_s": seconds(),
    # rewards
    "reward.num_workers": at_least(0, "0: score in the driver process"),
    "reward.timeout_s": seconds(),
    "reward.rule_weight": at_least(0),
    "reward.overlong_buffer.len": at_least(1),  # and <= data.max_response_length: _check_dynamic_sampling
    "reward.overlong_buffer.penalty_factor": at_least(0),
    "reward.judge.max_prompt_length": at_least(1),
    "reward.judge.max_new_tokens": at_least(1),
    "reward.judge.temperature": at_least(0, "0: greedy"),
    "reward.judge.weight": at_least(0),
    "reward.judge.num_workers": at_least(1),
    "reward.judge.num_gpus": at_least(0, "0: the judge runs on CPU"),
    "reward_model.weight": at_least(0),
    "reward_model.dp_size": at_least(1),
    "reward_model.micro_batch_size": at_least(1),
    "reward_model.max_length": at_least(2),
    # algorithm
    "algorithm.gamma": within(0, 1),
    "algorithm.lam": within(0, 1),
    "algorithm.kl_ctrl.kl_coef": at_least(0),
    "algorithm.kl_ctrl.target_kl": above(0),
    "algorithm.kl_ctrl.horizon": at_least(1),
    "algorithm.rollout_correction.cap": at_least(1, "a weight above the cap is lowered to it"),
    "algorithm.rollout_correction.low": within(0, 1),  # and < high: rlflow.algos.rollout_correction
    "algorithm.rollout_correction.high": at_least(1),
    "algorithm.filter_groups.max_num_gen_batches": at_least(1),
    # trainer, ray
    "trainer.total_steps": at_least(0),
    "trainer.max_to_keep": at_least(1),
    "trainer.max_staleness": at_least(0, "0: synchronous"),
    "trainer.remote_timeout_s": above(0),
    "trainer.startup_timeout_s": above(0),
    "trainer.keep_workers_s": at_least(0, "0: stop the workers with the run"),
    "trainer.cpus_per_worker": above(0),
    "trainer.grad_probes.num_projections": at_least(0),
    "trainer.max_failures": at_least(0, "0: a lost worker stops the run"),
    "trainer.snapshot_freq": at_least(0, "0: checkpoints only"),
    "ray.num_cpus": at_least(0, "0: sized from the workers", null=True),
})

# The numeric keys every value of which is meaningful (not forgotten: tests/test_config.py checks
# that each int/float key of the schema is in NUMERIC_RANGES or here)
NO_RANGE: dict[str, str] = {
    "data.seed": "any integer seeds",
    "trainer.seed": "any integer seeds",
    "trainer.grad_probes.seed": "any integer seeds",
    "rollout.top_k": "<= 0: off (every token)",
    "trainer.test_freq": "<= 0: no validation during training",
    "trainer.save_freq": "<= 0: no checkpoints",
}


def _lookup(cfg: Any, key: str) -> Any:
    value = cfg
    for name in key.split("."):
        value = value[name] if isinstance(value, dict) else getattr(value, name)
    return value


def check_ranges(cfg: Any) -> None:
    """Every key of NUMERIC_RANGES in its range; the first that is not raises a ConfigError of one
    line naming it (a list's element as `key[i]`)."""
    for key, allowed in NUMERIC_RANGES.items():
        value = _lookup(cfg, key)
        if isinstance(value, (list, tuple, ListConfig)):
            items = [(f"{key}[{index}]", item) for index, item in enumerate(value)]
        else:
            items = [(key, value)]
        for name, item in items:
            _need(allowed.contains(item), allowed.error(name, item))


# ---------------------------------------------------------------------------------------------
# Validation: each section's checks, in the order validate_config runs them
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainedSection:
    """A config section whose role trains (controllers/roles.py declares the roles; the config
    cannot import it): whether its role trains in a run, and the loss terms its workers build."""

    enabled: Callable[[Any], bool]
    loss_terms: Callable[[Any], Any]


TRAINED_SECTIONS: dict[str, TrainedSection] = {
    "actor": TrainedSection(lambda cfg: True, actor_loss_terms),
    "critic": TrainedSection(lambda cfg: bool(cfg.critic.enable), critic_loss_terms),
}


def trained_sections(cfg) -> list[str]:
    """The sections of the roles that train in this run: the actor, and the critic when enabled."""
    return [name for name, section in TRAINED_SECTIONS.items() if section.enabled(cfg)]


def validate_config(cfg: DictConfig) -> None:
    """Every check before Ray starts; the first that fails raises a ConfigError naming its key."""
    check_ranges(cfg)  # first: the checks below divide by sizes
    for role in trained_sections(cfg):
        _check_trained_role(role, cfg)
    _check_algorithm(cfg)
    _check_actor(cfg)
    _check_loss_terms(cfg)
    _check_rollout(cfg)
    _check_reference(cfg)
    _check_distillation(cfg)
    _check_reward(cfg)
    _check_reward_model(cfg)
    _check_agent(cfg)
    _check_dynamic_sampling(cfg)
    _check_trainer(cfg)
    for role in TRAINED_SECTIONS:  # every declared one, trained in this run or not
        _check_optim(role, cfg[role])


def _sequences_per_step(cfg: DictConfig) -> int:
    return cfg.data.train_batch_size * cfg.rollout.n


def _check_trained_role(role: str, cfg: DictConfig) -> None:
    section = cfg[role]
    _check_batch_algebra(role, section, cfg)
    _check_update(role, section)
    _check_mixed_precision(role, section)


def _check_batch_algebra(role: str, section: DictConfig, cfg: DictConfig) -> None:
    mini, dp, sequences_per_step = section.ppo_mini_batch_size, section.dp_size, _sequences_per_step(cfg)
    _need(sequences_per_step % mini == 0,
          f"{role}.ppo_mini_batch_size={mini} must divide data.train_batch_size * rollout.n = "
          f"{cfg.data.train_batch_size} * {cfg.rollout.n} = {sequences_per_step} (sizes count responses)")
    _need(mini % dp == 0, f"{role}.ppo_mini_batch_size={mini} must be divisible by {role}.dp_size={dp}")
    if not section.use_dynamic_bsz:
        micro, per_rank = section.ppo_micro_batch_size_per_gpu, mini // dp
        # a micro-batch of at least the shard is the whole shard (plan_micro_batches)
        _need(micro >= per_rank or per_rank % micro == 0,
              f"{role}.ppo_micro_batch_size_per_gpu={micro} must divide the per-rank mini-batch "
              f"{role}.ppo_mini_batch_size / {role}.dp_size = {mini} / {dp} = {per_rank}, or be at least it")


def _check_update(role: str, section: DictConfig) -> None:
    _need(section.loss_agg_mode in LOSS_AGG_MODES,
          f"{role}.loss_agg_mode={section.loss_agg_mode!r} is not one of {', '.join(LOSS_AGG_MODES)}")
    _need(section.strategy in STRATEGIES, f"{role}.strategy={section.strategy!r} is not one of {', '.join(STRATEGIES)}")


def _check_optim(role: str, section: DictConfig) -> None:
    name, sched = section.optim.name, section.optim.lr_scheduler
    _need(name in OPTIMIZERS, f"{role}.optim.name={name!r} is not one of {', '.join(OPTIMIZERS)}")
    _need(sched in ("constant", "cosine"), f"{role}.optim.lr_scheduler={sched!r} is not one of constant, cosine")
    betas = list(section.optim.betas)
    _need(len(betas) == 2, f"{role}.optim.betas must hold two numbers [beta1, beta2] (AdamW's), got {betas}")


def _check_algorithm(cfg: DictConfig) -> None:
    algo, estimator = cfg.algorithm, cfg.algorithm.adv_estimator
    _need(estimator in ADV_ESTIMATORS,
          f"algorithm.adv_estimator={estimator!r} is not one of {', '.join(sorted(ADV_ESTIMATORS))}")
    if estimator in NEEDS_CRITIC:
        _need(bool(cfg.critic.enable), f"algorithm.adv_estimator={estimator} needs a critic: "
                                       "set critic.enable=true (or leave it unset)")
    if estimator in NEEDS_GROUPS:
        _need(cfg.rollout.n >= 2, f"algorithm.adv_estimator={estimator} compares responses within a group: "
                                  f"rollout.n must be >= 2, got {cfg.rollout.n}")
    _need(algo.kl_penalty in KL_PENALTY_MODES,
          f"algorithm.kl_penalty={algo.kl_penalty!r} is not one of {', '.join(KL_PENALTY_MODES)}")
    _need(algo.kl_ctrl.type in ("fixed", "adaptive"),
          f"algorithm.kl_ctrl.type={algo.kl_ctrl.type!r} is not one of fixed, adaptive")
    _check_rollout_correction(cfg)


def _check_actor(cfg: DictConfig) -> None:
    """The actor's own settings: its policy loss and that loss's options, the KL loss, LoRA."""
    actor = cfg.actor
    _need(actor.policy_loss in POLICY_LOSSES,
          f"actor.policy_loss={actor.policy_loss!r} is not one of {', '.join(sorted(POLICY_LOSSES))}")
    _need(actor.kl_loss_type in KL_PENALTY_MODES,
          f"actor.kl_loss_type={actor.kl_loss_type!r} is not one of {', '.join(KL_PENALTY_MODES)}")
    valid = option_names(POLICY_LOSSES[actor.policy_loss].options)
    for key in actor.policy_loss_options:
        _need(key in valid, f"actor.policy_loss_options.{key} is not an option of actor.policy_loss="
                            f"{actor.policy_loss!r}; valid: {', '.join(valid) or '(none)'}")
    _check_lora(cfg)


def _check_loss_terms(cfg: DictConfig) -> None:
    """Build the loss terms each trained role's workers will build, so a bad option fails before Ray starts."""
    own = cfg.actor.policy_loss_options
    for role in trained_sections(cfg):
        try:
            TRAINED_SECTIONS[role].loss_terms(cfg[role])
        except LossOptionError as err:
            key = f"actor.policy_loss_options.{err.option}" if role == "actor" and err.option in own else f"{role}.{err.option}"
            raise ConfigError(f"{key} {err.problem}") from err


def _check_rollout(cfg: DictConfig) -> None:
    rollout, data = cfg.rollout, cfg.data
    _need(rollout.name in ENGINE_MODULES or rollout.name == "auto" or ":" in rollout.name,
          f"rollout.name={rollout.name!r} is not one of auto, {', '.join(sorted(ENGINE_MODULES))} (or "
          "<module>:<RolloutEngine subclass>, or an engine registered by a module of trainer.imports)")
    _need(rollout.tensor_parallel_size == 1 or rollout.name != "hf",
          f"rollout.tensor_parallel_size={rollout.tensor_parallel_size}: the hf engine runs one model per rollout rank; "
          "use rollout.name=vllm (or rollout.dp_size for more rollout ranks)")
    _need(rollout.weight_sync in WEIGHT_SYNC_MODES,
          f"rollout.weight_sync={rollout.weight_sync!r} is not one of {', '.join(WEIGHT_SYNC_MODES)}")
    _need(data.train_batch_size % rollout.dp_size == 0,
          f"rollout.dp_size={rollout.dp_size} must divide data.train_batch_size={data.train_batch_size}")
    _need(rollout.val_n == 1 or rollout.val_do_sample,
          f"rollout.val_n={rollout.val_n} needs rollout.val_do_sample=true: greedy decoding gives {rollout.val_n} "
          "identical samples per prompt (set rollout.val_do_sample=true, or rollout.val_n=1)")
    _check_partial(cfg)


def _check_partial(cfg: DictConfig) -> None:
    partial = cfg.rollout.partial
    if not partial.enable:
        return
    _need(partial.batch_order in ("finished", "submitted"),
          f"rollout.partial.batch_order={partial.batch_order!r} is not one of finished, submitted")
    _need(partial.max_rows == 0 or partial.max_rows >= cfg.rollout.n,
          f"rollout.partial.max_rows={partial.max_rows} must hold one group of rollout.n={cfg.rollout.n} "
          "responses (or be 0: a rank's share of one step's)")
    _need(cfg.trainer.max_staleness >= 1,
          "rollout.partial.enable=true needs trainer.max_staleness >= 1: it bounds how many updates older than the "
          "actor a batch's oldest token may be (with 0 no weight sync can land while a response is generated)")
    _need(not (cfg.rollout.agent.env or cfg.rollout.agent.fn), "rollout.partial.enable=true does not run agent episodes (rollout.agent.env, fn): "
          "their turns need the environment between chunks")
    _need(not cfg.rollout.sleep, "rollout.partial.enable=true generates between the calls: rollout.sleep must be false")
    _need("reward_baselines" not in estimator_inputs(cfg.algorithm.adv_estimator),
          f"rollout.partial.enable=true does not generate the greedy baseline algorithm.adv_estimator="
          f"{cfg.algorithm.adv_estimator} needs")


def _check_reference(cfg: DictConfig) -> None:
    reference = cfg.reference
    if not reference.enable:
        return
    sequences_per_step = _sequences_per_step(cfg)
    _need(sequences_per_step % reference.dp_size == 0,
          f"reference.dp_size={reference.dp_size} must divide data.train_batch_size * rollout.n = {sequences_per_step}")


def _check_distillation(cfg: DictConfig) -> None:
    """actor.distill and its teacher: each needs the other; the teacher's folder exists."""
    from rlflow.models import MODEL_ALIASES  # a dict of names: nothing heavy

    distill, teacher = cfg.actor.distill, cfg.teacher
    _need(distill.use_policy_loss or distill.coef > 0,
          "actor.distill.use_policy_loss=false leaves the actor no loss to train on: set actor.distill.coef > 0 "
          "(pure distillation) or actor.distill.use_policy_loss=true")
    if distill.coef > 0:
        _need(bool(teacher.enable), f"actor.distill.coef={distill.coef} distils from a teacher: set teacher.enable=true "
                                    "and teacher.model.path (or actor.distill.coef=0)")
    _need(distill.top_k == 0 or distill.coef > 0,
          f"actor.distill.top_k={distill.top_k} chooses the distillation objective, which is off: set actor.distill.coef > 0")
    if not teacher.enable:
        return
    path = teacher.model.path
    _need(bool(path), "teacher.enable=true needs teacher.model.path (a HF *ForCausalLM folder with the actor's "
                      f"tokenizer, 'tiny' or one of {', '.join(sorted(MODEL_ALIASES))})")
    _need(path == "tiny" or path in MODEL_ALIASES or os.path.isdir(path),
          f"teacher.model.path={path!r} is not a folder (a HF *ForCausalLM folder, 'tiny' or one of "
          f"{', '.join(sorted(MODEL_ALIASES))})")
    _need(distill.coef > 0, "teacher.enable=true but nothing reads the teacher's log-probs: set actor.distill.coef > 0 "
                            "(or teacher.enable=false)")
    sequences_per_step = _sequences_per_step(cfg)
    _need(sequences_per_step % teacher.dp_size == 0,
          f"teacher.dp_size={teacher.dp_size} must divide data.train_batch_size * rollout.n = {sequences_per_step}")


def _check_reward(cfg: DictConfig) -> None:
    reward = cfg.reward
    _need(reward.on_error in ("raise", "zero"), f"reward.on_error={reward.on_error!r} is not one of raise, zero")
    _check_judge(cfg)


def _check_judge(cfg: DictConfig) -> None:
    """reward.judge's keys (its folder, template file and parser are checked before Ray starts:
    rlflow.rewards.judge.check_judge)."""
    judge = cfg.reward.judge
    if not judge.enable:
        return
    _need(bool(judge.model_path), "reward.judge.enable=true needs reward.judge.model_path (a HF causal LM folder "
                                  "of an instruct model, or an alias such as smollm2-135m)")
    _need(judge.engine in ("auto", "hf", "vllm"), f"reward.judge.engine={judge.engine!r} is not one of auto, hf, vllm")
    _need(judge.engine != "vllm" or importlib.util.find_spec("vllm") is not None,
          "reward.judge.engine=vllm needs the vllm package (or reward.judge.engine=hf)")
    _need(judge.dtype in ("float32", "bfloat16", "float16"),
          f"reward.judge.dtype={judge.dtype!r} is not one of float32, bfloat16, float16")
    _need(judge.template_file or not judge.template or "{response}" in judge.template,
          "reward.judge.template has no {response} placeholder: the judge would never see the response")
    _need(not (cfg.rollout.agent.env or cfg.rollout.agent.fn), "rollout.agent.env: the environment rewards the episodes; reward.judge.enable "
                                     "is not supported with it")


def _check_rollout_correction(cfg: DictConfig) -> None:
    section = cfg.algorithm.rollout_correction
    try:
        options = rollout_correction_options(section)
    except LossOptionError as err:
        raise ConfigError(f"algorithm.rollout_correction.{err.option} {err.problem}") from err
    if options.enabled and not cfg.trainer.replay_rollouts:
        _need(bool(cfg.rollout.calculate_log_probs),
              f"algorithm.rollout_correction.mode={options.mode} weights tokens by the rollout engine's "
              "log-probs: it needs rollout.calculate_log_probs=true")


def _check_lora(cfg: DictConfig) -> None:
    lora = cfg.actor.lora
    if lora.rank == 0:
        return
    _need(len(lora.target_modules) > 0 and all(isinstance(m, str) and m for m in lora.target_modules),
          f"actor.lora.target_modules must list module names (e.g. [q_proj, v_proj]), got {list(lora.target_modules)}")
    _need(importlib.util.find_spec("peft") is not None,
          f"actor.lora.rank={lora.rank} needs the peft package: pip install peft")


def _check_mixed_precision(role: str, section: DictConfig) -> None:
    mp = section.mixed_precision
    _need(mp.param_dtype in ("float32", "bfloat16", "float16"),
          f"{role}.mixed_precision.param_dtype={mp.param_dtype!r} is not one of float32, bfloat16, float16")
    _need(mp.reduce_dtype in ("float32", "bfloat16", "float16"),
          f"{role}.mixed_precision.reduce_dtype={mp.reduce_dtype!r} is not one of float32, bfloat16, float16")
    if mp.param_dtype != section.model.dtype:
        _need(section.model.dtype == "float32",
              f"{role}.mixed_precision.param_dtype={mp.param_dtype} computes below float32 master weights: "
              f"{role}.model.dtype must be float32, got {section.model.dtype} (or set "
              f"{role}.mixed_precision.param_dtype={section.model.dtype} to train in {section.model.dtype} throughout)")


def _check_reward_model(cfg: DictConfig) -> None:
    section = cfg.reward_model
    if not section.enable:
        _need(cfg.reward.rule_weight > 0 or cfg.reward.judge.enable,
              "reward.rule_weight=0 leaves no reward: enable reward_model (or reward.judge) or set it > 0")
        return
    _need(bool(section.path), "reward_model.enable=true needs reward_model.path (a *ForSequenceClassification HF folder)")
    _need(section.dtype in ("float32", "bfloat16", "float16"),
          f"reward_model.dtype={section.dtype!r} is not one of float32, bfloat16, float16")


def _check_agent(cfg: DictConfig) -> None:
    agent = cfg.rollout.agent
    _need(not (agent.env and agent.fn), f"rollout.agent.env={agent.env!r} and rollout.agent.fn={agent.fn!r} are both "
          "set: an episode is an environment class or an agent function, set one of them")
    if not (agent.env or agent.fn):
        return
    _need(agent.on_error in ("raise", "zero"), f"rollout.agent.on_error={agent.on_error!r} is not one of raise, zero")
    # the environments' rewards are the scores
    _need(not cfg.reward_model.enable, "rollout.agent.env: the environment rewards the episodes; reward_model.enable "
                                       "is not supported with it")
    _need("reward_baselines" not in estimator_inputs(cfg.algorithm.adv_estimator),
          f"rollout.agent.env: algorithm.adv_estimator={cfg.algorithm.adv_estimator} (a greedy baseline response "
          "per prompt) is not supported with it")


def _check_dynamic_sampling(cfg: DictConfig) -> None:
    fg, buffer = cfg.algorithm.filter_groups, cfg.reward.overlong_buffer
    if fg.enable:
        _need(fg.metric in ("acc", "score"), f"algorithm.filter_groups.metric={fg.metric!r} is not one of acc, score")
        _need(fg.on_cap in ("raise", "fill"), f"algorithm.filter_groups.on_cap={fg.on_cap!r} is not one of raise, fill")
        _need(cfg.rollout.n >= 2, f"algorithm.filter_groups drops groups whose responses all score alike: "
                                  f"rollout.n must be >= 2, got {cfg.rollout.n}")
        _need(not cfg.trainer.replay_rollouts, "algorithm.filter_groups generates until enough groups are kept: "
                                               "it cannot be used with trainer.replay_rollouts (replay the filtered "
                                               "recording without it)")
    if buffer.enable:
        _need(1 <= buffer.len <= cfg.data.max_response_length,
              f"reward.overlong_buffer.len must be in [1, data.max_response_length={cfg.data.max_response_length}], "
              f"got {buffer.len}")


def _check_dist_interface(value) -> None:
    """An IPv4 address or something that can be an interface name (at most 15 characters, Linux's
    limit); whether the interface exists is checked on the nodes (workers/base.py)."""
    if value is None:
        return
    text = str(value)
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        _need(0 < len(text) <= 15 and not any(c.isspace() or c in "/:" for c in text),
              f"trainer.dist_interface={text!r} is neither an IPv4 address nor a network interface name "
              "(e.g. eth0; null: the node's IP as Ray sees it)")
        return
    _need(address.version == 4, f"trainer.dist_interface={text!r}: give an IPv4 address or an interface name")




def _check_trainer(cfg: DictConfig) -> None:
    trainer = cfg.trainer
    for name in trainer.logger:
        _need(name in LOGGERS, f"trainer.logger: unknown logger {name!r}; valid: {', '.join(LOGGERS)}")
    _need(trainer.nan_policy in NAN_POLICIES, f"trainer.nan_policy={trainer.nan_policy!r} is not one of {', '.join(NAN_POLICIES)}")
    if trainer.resume_mode not in ("auto", "disable"):
        _need(os.path.isdir(trainer.resume_mode),
              f"trainer.resume_mode={trainer.resume_mode!r} is neither auto, disable nor an existing checkpoint folder")
        try:  # a step folder, or a run / checkpoints folder holding one (what the resume will read)
            resolve_checkpoint(trainer.resume_mode)
        except CheckpointError as err:
            raise ConfigError(f"trainer.resume_mode={trainer.resume_mode!r}: {err}") from err
    _check_dist_interface(trainer.dist_interface)
    _need(not (trainer.memory_metrics and trainer.max_staleness > 0),
          "trainer.memory_metrics reports the memory of each phase of a step, which overlap with trainer.max_staleness="
          f"{trainer.max_staleness} (and reading the rollout's would wait for its generation): use max_staleness=0")
    if trainer.offload_dir is not None:
        _need(os.path.isdir(trainer.offload_dir) and os.access(trainer.offload_dir, os.W_OK | os.X_OK),
              f"trainer.offload_dir={trainer.offload_dir!r} is not a writable directory")
    if trainer.replay_rollouts is not None:
        _need(os.path.isdir(trainer.replay_rollouts),
              f"trainer.replay_rollouts={trainer.replay_rollouts}: not a folder of recorded rollouts (trainer.record_rollouts writes one)")
