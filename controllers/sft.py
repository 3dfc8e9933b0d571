"""Supervised fine-tuning on the actor's worker group: `rlflow sft [CONFIG.yaml] [key=value ...]`,
`SFT(config).fit()`.

The same config, data formats, worker group, checkpoints, recovery and logging as an RL run; only
the step differs. A row is a prompt (data.prompt_key: a string or chat messages, templated as for
RL) and its target response (data.response_key: a column, or a dotted path into the row such as
reward_model.ground_truth; the synthetic tasks' rows carry one, rlflow/data/synthetic.py); the response's tokens, then EOS, are the response of a batch laid out
as a rollout's (docs/CONVENTIONS.md), so every micro-batch layout of the actor (micro-batches,
token budgets, packing, sequence and data parallelism) trains on it unchanged.

The loss is the actor's policy loss `nll` (rlflow/algos/losses.py: -log pi per response token)
aggregated by actor.loss_agg_mode with the BatchMeta the driver computes for each whole
mini-batch: with token-mean, the sum over the mini-batch's tokens divided by its token count,
however it is split. The per-micro-batch mean instead is the 2024 gradient-accumulation bug of
transformers (tests/test_sft.py's negative control). Log-probs are at temperature 1.
"""

from __future__ import annotations

import os

import torch
from omegaconf import OmegaConf
from tensordict import TensorDict

from controllers.ppo import PPOTrainer, Timer
from controllers.setup import core_share, load_tokenizer, make_data, resolve_model_path, start_ray
from rlflow.config import ConfigError, RLFlowConfig, load_config, to_dataclass
from rlflow.data.dataset import StatefulDataLoader, collate
from rlflow.metrics import mean_over_minibatches, reduce_metrics
from rlflow.protocol import assemble_rollout

# what an SFT run sets whatever the recipe says: the objective and the log-probs it reads
SFT_SETTINGS = {"actor.policy_loss": "nll", "actor.use_kl_loss": False, "actor.entropy_coeff": 0.0,
                "actor.policy_loss_options": {}, "rollout.temperature": 1.0, "rollout.n": 1,
                "algorithm.use_kl_in_reward": False, "algorithm.adv_estimator": "reinforce_plus_plus",
                "critic.enable": False, "reference.enable": False, "reward_model.enable": False}
# the batch keys the actor's nll update reads
SFT_KEYS = ("prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids")


def sft_config(path=None, overrides: list[str] | None = None):
    """load_config with SFT_SETTINGS on top (every check of load_config runs on the result). Unless
    the recipe or an override sets actor.ppo_mini_batch_size, it is data.train_batch_size: one
    optimizer step per step (the RL default counts rollout.n responses per prompt)."""
    overrides = list(overrides or [])
    settings = [f"{key}={value}" if not isinstance(value, dict) else f"{key}={{}}" for key, value in SFT_SETTINGS.items()]
    if not _sets(path, overrides, "actor.ppo_mini_batch_size"):
        settings.append("actor.ppo_mini_batch_size=${data.train_batch_size}")
    return load_config(path, [*overrides, *settings])


def _sets(path, overrides: list[str], key: str) -> bool:
    """Whether the recipe at `path` or an override sets `key`."""
    if any(item.split("=", 1)[0].strip().lstrip("+") == key for item in overrides):
        return True
    return bool(path) and os.path.isfile(path) and OmegaConf.select(OmegaConf.load(path), key) is not None


class SFTTrainer(PPOTrainer):
    """PPOTrainer's fit (resume, checkpoints, recovery, preemption, logging) with the actor alone
    and a supervised step. train_dataset / val_dataset: rows in memory, with data.response_key."""

    def __init__(self, config, worker_classes: dict[str, type] | None = None, *, train_dataset=None,
                 val_dataset=None):
        config = to_dataclass(config)
        wrong = {key: value for key, value in SFT_SETTINGS.items() if _get(config, key) != value}
        if wrong:
            raise ConfigError(f"an SFT config must have {', '.join(f'{k}={v}' for k, v in wrong.items())}: build it "
                              "with controllers.sft.sft_config (what `rlflow sft` does)")
        super().__init__(config, worker_classes=worker_classes, train_dataset=train_dataset, val_dataset=val_dataset)

    def setup(self) -> None:
        cfg: RLFlowConfig = self.cfg
        torch.manual_seed(cfg.trainer.seed)
        self.model_path = resolve_model_path(cfg)
        self.critic_path = self.model_path
        self.tokenizer = load_tokenizer(self.model_path)
        self.train_dataset, self.val_dataset, self.loader = self._sft_data()
        self.active_roles = {"actor": self.roles["actor"]}
        self.cores = core_share(cfg, self.active_roles, self.model_path)
        start_ray(cfg, self.active_roles)
        self.start_workers()

    def _sft_data(self):
        """make_data's datasets, each item with its target response's token ids; the loader's
        batches laid out as a rollout's."""
        cfg = self.cfg
        train, val, _ = make_data(cfg, self.tokenizer, self.train_rows, self.val_rows,
                                  target_key=cfg.data.response_key)
        for dataset in (train, val):
            for item in dataset.items if dataset is not None else ():
                item["response_ids"] = list(self.tokenizer(item["target"], add_special_tokens=False)["input_ids"])
        return train, val, StatefulDataLoader(train, cfg.data.train_batch_size, shuffle=cfg.data.shuffle,
                                              seed=cfg.data.seed, collate_fn=self._collate)

    def _collate(self, items: list[dict]) -> TensorDict:
        prompts = collate(items, self.tokenizer.pad_token_id)
        eos = self.tokenizer.eos_token_id
        responses = [item["response_ids"] + [eos] for item in items]
        batch = assemble_rollout(prompts["input_ids"], prompts["attention_mask"], responses, 1,
                                 self.cfg.data.max_response_length, self.tokenizer.pad_token_id, eos)
        batch["truncated"] = torch.tensor([len(r) > self.cfg.data.max_response_length for r in responses])
        return batch

    def start_workers(self, kept: dict | None = None, stopped: dict | None = None) -> None:
        self.start_groups(kept, stopped)  # the actor alone: nothing of a rollout to wire

    # -- the step ---------------------------------------------------------------------------------
    def train_step(self, step: int) -> dict:
        timer = Timer()
        with timer("step"):
            batch = next(self.loader)
            truncated = batch["truncated"].float().mean().item()
            with timer("update"):
                shards = self.plan_minibatches(batch.select(*SFT_KEYS), "actor", step)
                per_rank = self.groups["actor"].gather(
                    self.groups["actor"].call_per_dp_rank_async("update", [(s,) for s in shards]), "update")
        num_minibatches = len(per_rank[0])
        per_minibatch = [reduce_metrics(rec for rank in per_rank for rec in rank[j]) for j in range(num_minibatches)]
        metrics = mean_over_minibatches(per_minibatch)
        lengths = batch["response_mask"].float().sum(-1)
        metrics.update({"response/length_mean": lengths.mean().item(), "response/truncated_frac": truncated,
                        "sft/num_tokens": float(lengths.sum().item())})
        metrics.update({f"timing/{k}": v for k, v in timer.seconds.items()})
        self.weight_version = step + 1
        return metrics

    def validate(self) -> dict:
        """The mean negative log-likelihood per token of the validation targets (no update)."""
        items = list(self.val_dataset)
        nll, tokens = 0.0, 0
        for start in range(0, len(items), self.cfg.data.val_batch_size):
            batch = self._collate(items[start : start + self.cfg.data.val_batch_size])
            dp = self.cfg.actor.dp_size
            rows = batch.batch_size[0]
            padded = batch.select(*SFT_KEYS)
            if rows % dp:
                padded = torch.cat([padded, padded[: dp - rows % dp]], dim=0)
            out = self.groups["actor"].dispatch_dp("compute_log_prob", padded)[:rows]
            mask = batch["response_mask"].bool()
            nll -= float(out["old_log_probs"][mask].double().sum())
            tokens += int(mask.sum())
        return {"val/nll_mean": nll / tokens}

    def driver_state(self) -> dict:
        return {"dataloader": self.loader.state_dict(), "history": list(self.history),
                "model_path": str(self.model_path), "in_flight": []}

    def load_driver_state(self, state: dict, step: int) -> None:
        self.loader.load_state_dict(state["dataloader"])
        self.history = list(state["history"])
        self.weight_version = step

    def sync_weights(self) -> None:  # no rollout group
        return


def _get(cfg, dotted: str):
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


class SFT:
    """The Python API: `SFT(config).fit()` returns the per-step metrics history (config: from
    controllers.sft.sft_config, or None for the embedded default)."""

    def __init__(self, config=None, worker_classes: dict[str, type] | None = None, *, train_dataset=None,
                 val_dataset=None):
        self.config = sft_config() if config is None else config
        self.trainer = SFTTrainer(self.config, worker_classes=worker_classes, train_dataset=train_dataset,
                                  val_dataset=val_dataset)

    def fit(self) -> list[dict]:
        return self.trainer.fit()
