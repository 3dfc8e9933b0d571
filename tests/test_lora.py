"""LoRA on the actor (actor.lora, peft): what trains, what the rollout receives, what a checkpoint
holds, and the exactness family with LoRA.

One generating fit (dp=1, LoRA rank 4 on every linear layer of the decoder, plain SGD, token-mean
actor and critic, a checkpoint after each step) records its rollout and is then the reference of:
- the exactness family: FSDP2 and DDP fits at dp=2 with 2 micro-batches per rank replay its
  recording and must take the same gradient at every optimizer step (the gradient probes, which
  cover the adapters only: every base weight's gradient norm is exactly 0), end at the same
  (merged) weights and log the same metrics, within tests/exactness_helpers' tolerances;
- the weight sync: the HF rollout engine's weights after the last step are, bitwise, the base model
  with the saved adapters merged in by peft itself (merge_and_unload), and the rollout's log-probs
  agree with the actor's (unmerged) ones while differing from the base model's;
- the checkpoint: adapters in peft's folder layout (no full weights), an optimizer over the adapters
  only, and a new fit resumed from the step-1 checkpoint ends bitwise where the uninterrupted one did.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import pytest
import ray.cloudpickle
import torch

import exactness_workers
from exactness_helpers import FP32_EPS, PARAM_ULPS, build_varied_length_model, compare_fits, recorded_batches, run_fit
from workers.rollout.worker import RolloutWorker

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

STEPS = 2
LORA = {"actor.lora.rank": 4, "actor.lora.alpha": 16}  # every linear layer of the decoder (the default targets)
FAMILY = {**LORA, "actor.loss_agg_mode": "token-mean", "critic.loss_agg_mode": "token-mean",
          "actor.optim.name": "sgd", "critic.optim.name": "sgd", "actor.optim.lr": 0.05, "critic.optim.lr": 0.005,
          "trainer.total_steps": STEPS}
LAYOUTS = {
    "whole": {"actor.ppo_micro_batch_size_per_gpu": 8},
    "fsdp2-mb2": {"actor.dp_size": 2, "actor.ppo_micro_batch_size_per_gpu": 2},
    "ddp-mb2": {"actor.dp_size": 2, "actor.strategy": "ddp", "critic.strategy": "ddp",
                "actor.ppo_micro_batch_size_per_gpu": 2},
}
ROLLOUT_WEIGHTS = "rollout_weights.pt"
NUM_ADAPTED_LAYERS = 4 * 7  # 4 decoder layers x (q, k, v, o, gate, up, down)


class SavingRollout(RolloutWorker):
    """Writes the HF engine's weights next to the run after every sync (the last one stays)."""

    def _save_engine_weights(self) -> None:
        state = {k: v.detach().cpu().clone() for k, v in self.engine.model.state_dict().items()}
        torch.save(state, os.path.join(self.cfg.trainer.default_local_dir, ROLLOUT_WEIGHTS))

    def load_weights(self, state_dict):
        super().load_weights(state_dict)
        self._save_engine_weights()

    def load_shared_weights(self, published):
        super().load_shared_weights(published)
        self._save_engine_weights()


WORKERS = {**exactness_workers.RECORDING, "rollout": SavingRollout}


def checkpoints(run_dir: str) -> str:
    return os.path.join(run_dir, "rlflow", "default", "checkpoints")


class Fits:
    def __init__(self, tmp_factory):
        self.tmp = tmp_factory
        self.model_dir = build_varied_length_model(str(tmp_factory.mktemp("lora_model")))
        self.record = str(tmp_factory.mktemp("lora_rollouts") / "record")
        self.run_dirs: dict[str, str] = {}
        self.cache: dict = {}

    def fit(self, name: str, **overrides):
        if name not in self.cache:
            self.run_dirs[name] = str(self.tmp.mktemp("lora_run"))
            self.cache[name] = run_fit(self.model_dir, self.run_dirs[name], workers=WORKERS, **FAMILY, **overrides)
            print(f"fit {name}: {self.cache[name].seconds:.1f} s")
        return self.cache[name]

    @property
    def generating(self):
        """dp=1, the whole mini-batch in one micro-batch, generating; a checkpoint after each step."""
        return self.fit("whole", **LAYOUTS["whole"], **{"trainer.record_rollouts": self.record, "trainer.save_freq": 1})

    def replaying(self, layout: str):
        """Replays the generating fit's rollouts; a checkpoint after each step."""
        self.generating  # noqa: B018 - the recording
        return self.fit(layout, **LAYOUTS[layout], **{"trainer.replay_rollouts": self.record, "trainer.save_freq": 1})

    def straight(self, layout: str):
        return self.generating if layout == "whole" else self.replaying(layout)

    def resumed(self, layout: str):
        """A new fit of `layout`'s, resumed from that fit's step-1 checkpoint."""
        self.straight(layout)  # its checkpoint
        step1 = os.path.join(checkpoints(self.run_dirs[layout]), "step_1")
        rollouts = {} if layout == "whole" else {"trainer.replay_rollouts": self.record}
        return self.fit(f"{layout}-resumed", **LAYOUTS[layout], **rollouts,
                        **{"trainer.resume_mode": step1, "trainer.save_freq": 1})


@pytest.fixture(scope="module")
def fits(ray_session, tmp_path_factory):
    return Fits(tmp_path_factory)


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


# ------------------------------------------------------------------------------------ the family


@pytest.mark.parametrize("layout", ["fsdp2-mb2", "ddp-mb2"])
def test_lora_family_layouts_take_the_same_gradient(fits, layout):
    whole, other = fits.generating, fits.replaying(layout)
    diff = compare_fits(whole, other)
    print(f"LoRA whole vs {layout}: {diff.line()}")
    assert diff.num_probes > 0
    assert not diff.failures, diff.failures[:10]
    assert [h["actor/num_micro_batches"] for h in other.steps()] == [2.0] * STEPS


def test_only_the_adapters_get_gradients(fits):
    """Every base weight's gradient norm is exactly 0 at every optimizer step; at the first, lora_A's
    is 0 too (lora_B starts at 0, so nothing flows back to A) and lora_B's is not."""
    steps = fits.generating.steps()
    norms = {k.split("/norm/", 1)[1]: [] for k in steps[0] if k.startswith("actor/grad_probe/mb0/norm/")}
    assert sum(map(is_adapter, norms)) == 2 * NUM_ADAPTED_LAYERS and len(norms) > 2 * NUM_ADAPTED_LAYERS
    for step in steps:
        for key, value in step.items():
            if key.startswith("actor/grad_probe/") and "/norm/" in key:
                norms[key.split("/norm/", 1)[1]].append(value)
    assert all(v == 0.0 for name, values in norms.items() if not is_adapter(name) for v in values)
    first = {name: values[0] for name, values in norms.items()}
    assert all(first[n] == 0.0 for n in first if ".lora_A." in n)
    assert all(first[n] > 0 for n in first if ".lora_B." in n)
    assert all(max(values) > 0 for name, values in norms.items() if is_adapter(name))


def test_the_merged_weights_moved_far_above_rounding(fits):
    """The family's parameter tolerance is a fraction of each tensor's movement: the adapted
    weights (merged) must move far above float32 rounding, the others not at all."""
    fit = fits.generating
    moved_layers = 0
    for name, start in fit.initial["actor"].items():
        end = fit.weights["actor"][name]
        moved = float((end - start).abs().max())
        if name.endswith(("proj.weight",)):
            assert moved > 100 * PARAM_ULPS * FP32_EPS * float(end.abs().max()), (name, moved)
            moved_layers += 1
        else:
            assert moved == 0.0, f"{name} is not adapted but moved {moved}"
    assert moved_layers == NUM_ADAPTED_LAYERS


# ------------------------------------------------------------------------------- the weight sync


def peft_merged(model_dir: str, adapter_dir: str) -> dict[str, torch.Tensor]:
    """The base model with the saved adapters merged in, by peft (independent of workers/lora.py)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().state_dict()


def test_the_rollout_receives_the_merged_weights(fits):
    fit = fits.generating
    run_dir = fits.run_dirs["whole"]
    want = peft_merged(fits.model_dir, os.path.join(checkpoints(run_dir), f"step_{STEPS}", "actor"))
    engine = torch.load(os.path.join(run_dir, ROLLOUT_WEIGHTS), weights_only=True)
    assert set(engine) == set(want)
    differing = [name for name in want if not torch.equal(engine[name], want[name])]
    assert not differing, differing[:5]
    # the weights gathered at the end of the run are the merged policy as well
    assert set(fit.weights["actor"]) <= set(want)
    assert all(torch.equal(tensor, want[name]) for name, tensor in fit.weights["actor"].items())


def test_rollout_and_actor_log_probs_agree(fits):
    """Steps after the first are generated by the merged weights after an update: their log-probs
    (the rollout's) match the actor's own forward with unmerged adapters (rollout_corr/abs_diff_max:
    float rounding of W x + s B A x vs (W + s B A) x), and differ from the base model's."""
    from async_helpers import _actor_log_probs

    fit = fits.generating
    mismatch = [h["rollout_corr/abs_diff_max"] for h in fit.steps()]
    batch = recorded_batches(fits.record)[1]
    mask = batch["response_mask"].bool()
    base = _actor_log_probs(fits.model_dir, fit.initial["actor"], batch)[mask]
    lag = float((batch["rollout_log_probs"][mask] - base).abs().max())
    print(f"LoRA: rollout vs actor log-probs, max |d| per step {mismatch}; rollout vs base model at step 2: {lag:.3g}")
    assert max(mismatch) < 1e-4
    assert lag > 100 * max(mismatch)


# -------------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("layout", ["whole", "fsdp2-mb2"])
def test_checkpoint_holds_the_adapters_and_their_optimizer_only(fits, layout):
    fits.straight(layout)
    step_dir = os.path.join(checkpoints(fits.run_dirs[layout]), f"step_{STEPS}")
    actor_files = sorted(os.listdir(os.path.join(step_dir, "actor")))
    assert actor_files == ["adapter_config.json", "adapter_model.safetensors", "optimizer.pt", "rng.pt"]
    assert "model.safetensors" in os.listdir(os.path.join(step_dir, "critic"))  # the critic trains whole
    from safetensors import safe_open

    with safe_open(os.path.join(step_dir, "actor", "adapter_model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    assert len(names) == 2 * NUM_ADAPTED_LAYERS and all(is_adapter(n) and ".default." not in n for n in names)
    with open(os.path.join(step_dir, "actor", "adapter_config.json"), encoding="utf-8") as f:
        config = json.load(f)
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (4, 16.0, 0.0)
    optimizer = torch.load(os.path.join(step_dir, "actor", "optimizer.pt"), weights_only=True)["optimizer"]
    params = [p for group in optimizer["param_groups"] for p in group["params"]]
    assert len(params) == 2 * NUM_ADAPTED_LAYERS and all(is_adapter(p) for p in params)


@pytest.mark.parametrize("layout", ["whole", "fsdp2-mb2"])
def test_resume_from_an_adapter_checkpoint_is_bitwise(fits, layout):
    """A new fit (new workers) resumed from the step-1 checkpoint of a fit trains step 2 exactly as
    the uninterrupted fit did: dp=1 generating (the rollout gets the restored adapters, merged),
    and FSDP2 at dp=2 replaying (every rank loads the adapters into its shards)."""
    straight, resumed = fits.straight(layout), fits.resumed(layout)
    assert [h["step"] for h in resumed.steps()] == [1, 2]
    diff = compare_fits(straight, resumed, bitwise=True)
    print(f"LoRA {layout} resumed from step 1 vs straight (bitwise): {diff.line()}")
    assert not diff.failures, diff.failures[:10]
    a, b = (os.path.join(checkpoints(fits.run_dirs[n]), f"step_{STEPS}", "actor", "adapter_model.safetensors")
            for n in (layout, f"{layout}-resumed"))
    from safetensors.torch import load_file

    x, y = load_file(a), load_file(b)
    assert len(x) == 2 * NUM_ADAPTED_LAYERS and x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_export_merges_the_adapters(fits, tmp_path):
    from transformers import AutoModelForCausalLM

    from controllers import checkpoint as ckpt

    fit = fits.generating
    out = ckpt.export_hf(os.path.join(checkpoints(fits.run_dirs["whole"]), f"step_{STEPS}"), str(tmp_path / "hf"))
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert all(torch.equal(exported[name], tensor) for name, tensor in fit.weights["actor"].items())


# ------------------------------------------------------------------- in process: AdamW, errors


def _actor(model_dir: str, **overrides):
    """An actor worker on one rank in this process (no Ray; WorkerBase.__init__ would seed)."""
    from conftest import tiny_overrides
    from rlflow import load_config
    from workers.actor import ActorWorker

    worker = object.__new__(ActorWorker)
    worker.cfg = load_config(None, tiny_overrides(model_dir, **overrides))
    worker.rank, worker.world_size, worker.device = 0, 1, torch.device("cpu")
    worker.init_model(model_dir, 10)
    return worker


def _adam_step(worker, seed: int) -> None:
    ids = torch.randint(0, 100, (2, 6), generator=torch.Generator().manual_seed(seed))
    worker.optimizer.zero_grad()
    worker.model(input_ids=ids).logits.float().pow(2).mean().backward()
    worker.optimizer.step()
    worker.scheduler.step()


def test_adamw_state_is_the_adapters_and_round_trips(tiny_model_dir):
    torch.manual_seed(0)
    lora = {**LORA, "actor.lora.target_modules": "[q_proj,v_proj]"}
    worker = _actor(tiny_model_dir, **lora)
    for seed in range(2):
        _adam_step(worker, seed)
    # a copy: on one CPU rank the optimizer state returned shares the live tensors (a checkpoint
    # file or Ray would copy them)
    saved = copy.deepcopy(worker.state_for_checkpoint())
    state = saved["optimizer"]["state"]
    assert len(state) == 2 * 2 * 4 and all(is_adapter(name) for name in state)
    assert all(set(slots) == {"step", "exp_avg", "exp_avg_sq"} for slots in state.values())

    fresh = _actor(tiny_model_dir, **lora)
    fresh.load_checkpoint_state(saved)
    for seed in (5, 6):  # the same next steps from the loaded state: bitwise the same weights
        _adam_step(worker, seed)
        _adam_step(fresh, seed)
    a, b = worker.get_weights(), fresh.get_weights()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    with pytest.raises(ValueError, match=r"checkpoint's adapters have r=4, this run has actor\.lora\.rank=8"):
        _actor(tiny_model_dir, **{**lora, "actor.lora.rank": 8}).load_checkpoint_state(saved)
    with pytest.raises(ValueError, match=r"not this model's .*actor\.lora\.target_modules"):
        _actor(tiny_model_dir, **LORA, **{"actor.lora.target_modules": "[q_proj]"}).load_checkpoint_state(saved)
    with pytest.raises(ValueError, match=r"holds the whole model, not LoRA adapters"):
        worker.load_checkpoint_state({**saved, "adapter_config": None})
    with pytest.raises(ValueError, match=r"holds LoRA adapters, not the whole model"):
        _actor(tiny_model_dir).load_checkpoint_state(saved)


def test_unknown_target_module_names_the_key(tiny_model_dir):
    with pytest.raises(ValueError, match=r"actor\.lora\.target_modules=\['qkv'\]"):
        _actor(tiny_model_dir, **LORA, **{"actor.lora.target_modules": "[qkv]"})
    not_linear = r"actor\.lora\.target_modules: model\.embed_tokens is not a linear layer \(Embedding\)"
    with pytest.raises(ValueError, match=not_linear):
        _actor(tiny_model_dir, **LORA, **{"actor.lora.target_modules": "[embed_tokens]"})


@pytest.mark.parametrize("overrides, pattern", [
    ({"actor.lora.rank": -1}, r"actor\.lora\.rank must be >= 0 \(0: LoRA off\)"),
    ({"actor.lora.rank": 4, "actor.lora.alpha": 0}, r"actor\.lora\.alpha must be > 0"),
    ({"actor.lora.rank": 4, "actor.lora.dropout": 1.0}, r"actor\.lora\.dropout must be in \[0, 1\)"),
    ({"actor.lora.rank": 4, "actor.lora.target_modules": "[]"}, r"actor\.lora\.target_modules must list module names"),
    ({"actor.lora.rnk": 4}, r"did you mean 'actor\.lora\.rank'"),
])
def test_bad_lora_config_names_the_key(overrides, pattern):
    from rlflow import load_config
    from rlflow.config import ConfigError

    with pytest.raises(ConfigError, match=pattern):
        load_config(None, [f"{k}={v}" for k, v in overrides.items()])
