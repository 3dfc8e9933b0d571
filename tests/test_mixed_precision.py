"""Mixed precision (actor/critic.mixed_precision, workers/precision.py): float32 master weights and
optimizer state, forwards and backwards in bfloat16, and the exactness family in bfloat16.

One generating fit (dp=1; FSDP2's MixedPrecisionPolicy on a one-rank group, token-mean actor and
critic, KL in the loss, plain SGD, one optimizer step per training step, a checkpoint after each
step) records its rollouts; the others replay them:
- FSDP2 at dp=2 with 2 micro-batches per rank must take the same gradient as dp=1 whole, and DDP
  (autocast) at dp=2 the same as DDP at dp=1, within the bfloat16 tolerance below;
- the bug this project exists for (every micro-batch normalised by its own counts, at dp=2) must
  fail that same comparison: the tolerance is measured to be tight enough;
- resuming the step-1 checkpoint is bitwise; float16 scales its loss.

The tolerance. bfloat16 keeps 8 significant bits: a unit roundoff of u = 2**-8. A layout changes
how a mini-batch is cut, so which partial gradients are rounded to bfloat16 (FSDP2's unsharded
gradient per micro-batch, autocast's matmul outputs) before they are summed in float32, and the
matmul shapes of the forward. Each partial is rounded relative to its own size, and a tensor's
gradient is a sum of per-token parts that cancel, so the error is bounded relative to the parts,
not to the (possibly much smaller) sum: every probe is compared relative to the norm of the whole
gradient of its role and optimizer step, with BF16_RTOL = 12u (4.7%; 8u until 2026-12-07, when a new
recording put FSDP2's pair at 1.08-1.28 of it: 3.4-4.4% of the whole gradient), and parameters relative to
the largest movement of any tensor of the role. One optimizer step per
training step keeps the PPO ratio at exactly 1 (no clipping, whose on/off switch at the clip
boundary a bfloat16 difference can flip); later steps start from weights that already differ by
bfloat16 noise.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

import exactness_workers
from exactness_helpers import build_varied_length_model, compare_fits, required_metrics, run_fit

BF16_U = 2.0**-8
BF16_RTOL = 12 * BF16_U
STEPS = 2
FAMILY = {"actor.loss_agg_mode": "token-mean", "critic.loss_agg_mode": "token-mean", "actor.use_kl_loss": True,
          "actor.optim.name": "sgd", "critic.optim.name": "sgd", "actor.optim.lr": 0.05, "critic.optim.lr": 0.005,
          "actor.ppo_epochs": 1, "actor.ppo_mini_batch_size": 16,  # one on-policy optimizer step
          "trainer.total_steps": STEPS, "actor.mixed_precision.param_dtype": "bfloat16"}
LAYOUTS = {
    "fsdp2-whole": {"actor.ppo_micro_batch_size_per_gpu": 16},
    "fsdp2-dp2-mb2": {"actor.dp_size": 2, "actor.ppo_micro_batch_size_per_gpu": 2},  # 4 micro-batches per rank
    "ddp-whole": {"actor.strategy": "ddp", "actor.ppo_micro_batch_size_per_gpu": 16},
    "ddp-dp2-mb2": {"actor.dp_size": 2, "actor.strategy": "ddp", "actor.ppo_micro_batch_size_per_gpu": 2},
}


def checkpoints(run_dir: str) -> str:
    return os.path.join(run_dir, "rlflow", "default", "checkpoints")


class Fits:
    def __init__(self, tmp_factory):
        self.tmp = tmp_factory
        self.model_dir = build_varied_length_model(str(tmp_factory.mktemp("mp_model")))
        self.record = str(tmp_factory.mktemp("mp_rollouts") / "record")
        self.run_dirs: dict[str, str] = {}
        self.cache: dict = {}

    def fit(self, name: str, workers: dict | None = None, **overrides):
        if name not in self.cache:
            self.run_dirs[name] = str(self.tmp.mktemp("mp_run"))
            self.cache[name] = run_fit(self.model_dir, self.run_dirs[name], workers=workers, **{**FAMILY, **overrides})
            print(f"fit {name}: {self.cache[name].seconds:.1f} s")
        return self.cache[name]

    @property
    def generating(self):
        return self.fit("fsdp2-whole", **LAYOUTS["fsdp2-whole"],
                        **{"trainer.record_rollouts": self.record, "trainer.save_freq": 1,
                           "trainer.max_to_keep": STEPS})

    def replaying(self, layout: str, workers: dict | None = None, **extra):
        self.generating  # noqa: B018 - the recording
        name = layout + ("-localnorm" if workers else "") + "".join(f",{k}={v}" for k, v in extra.items())
        return self.fit(name, workers=workers, **LAYOUTS[layout], **{"trainer.replay_rollouts": self.record, **extra})


@pytest.fixture(scope="module")
def fits(ray_session, tmp_path_factory):
    return Fits(tmp_path_factory)


def bf16_compare(a, b):
    return compare_fits(a, b, metrics=required_metrics(FAMILY), param_rtol=BF16_RTOL, probe_rtol=BF16_RTOL,
                        metric_rtol=BF16_RTOL, metric_atol=1e-4, relative_to_whole=True)


@pytest.mark.parametrize("whole, split", [("fsdp2-whole", "fsdp2-dp2-mb2"), ("ddp-whole", "ddp-dp2-mb2")])
def test_bf16_layouts_take_the_same_gradient(fits, whole, split):
    a = fits.generating if whole == "fsdp2-whole" else fits.replaying(whole)
    b = fits.replaying(split)
    diff = bf16_compare(a, b)
    print(f"bf16 {whole} vs {split}: {diff.line()}")
    assert diff.num_probes > 0
    assert not diff.failures, diff.failures[:10]
    assert [h["actor/num_micro_batches"] for h in b.steps()] == [4.0] * STEPS


def test_bf16_tolerance_catches_per_micro_batch_normalisation(fits):
    """The negative control: dp=2, 4 micro-batches per rank, each normalised by its own counts
    (tests/exactness_workers.py) fails the bfloat16 comparison by far."""
    right = bf16_compare(fits.generating, fits.replaying("fsdp2-dp2-mb2"))
    local = bf16_compare(fits.generating, fits.replaying("fsdp2-dp2-mb2", workers=exactness_workers.LOCAL_NORMALISATION))
    print(f"bf16 local normalisation: probes {local.probe_excess:.1f} of tol; the right layout {right.probe_excess:.3f}")
    assert local.failures and local.probe_excess > 10 and local.probe_excess > 30 * right.probe_excess


@pytest.fixture
def in_process_group():
    """A worker wrapped with FSDP2 at dp=1 forms a one-rank process group in this process: end it."""
    import torch.distributed as dist

    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _trainer(role: str, model_dir: str, **overrides):
    """An actor or critic worker on one rank in this process (no Ray; WorkerBase.__init__ would seed)."""
    from conftest import tiny_overrides
    from rlflow import load_config
    from workers.actor import ActorWorker
    from workers.critic import CriticWorker

    worker = object.__new__(ActorWorker if role == "actor" else CriticWorker)
    worker.cfg = load_config(None, tiny_overrides(model_dir, **{"algorithm.adv_estimator": "gae", **overrides}))
    worker.rank, worker.world_size, worker.device = 0, 1, torch.device("cpu")
    worker.init_model(model_dir, 10)
    return worker


@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_bf16_computes_in_bf16_over_float32_masters(tiny_model_dir, in_process_group, strategy, role):
    """What runs: the forward's outputs are bfloat16 (FSDP2's policy casts the parameters; autocast
    under DDP), while the parameters, their gradients and the optimizer state stay float32."""
    worker = _trainer(role, tiny_model_dir, **{f"{role}.strategy": strategy, "actor.strategy": strategy,
                                                "actor.mixed_precision.param_dtype": "bfloat16"})
    assert worker.is_sharded(worker.model) == (strategy == "fsdp2")
    ids = torch.randint(0, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    with worker.forward_context():
        logits = worker.model(input_ids=ids).logits
    assert logits.dtype == torch.bfloat16
    logits.float().pow(2).mean().backward()
    worker.optimizer.step()
    params = list(worker.model.parameters())
    assert {p.dtype for p in params} == {torch.float32}
    assert {p.grad.dtype for p in params if p.grad is not None} == {torch.float32}
    state = [t for slots in worker.optimizer.state.values() for t in slots.values() if t.numel() > 1]
    assert state and {t.dtype for t in state} == {torch.float32}


def _update_batch(vocab: int, rows: int, seed: int = 0):
    """One on-policy mini-batch of `rows` sequences (every response token valid), BatchMeta attached."""
    from tensordict import TensorDict

    from rlflow.protocol import attach_meta, compute_batch_meta

    gen = torch.Generator().manual_seed(seed)
    prompts, responses = torch.randint(0, vocab, (rows, 4), generator=gen), torch.randint(0, vocab, (rows, 6), generator=gen)
    input_ids = torch.cat([prompts, responses], dim=1)
    batch = TensorDict({
        "prompts": prompts, "responses": responses, "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids), "position_ids": torch.arange(10).expand(rows, -1).clone(),
        "response_mask": torch.ones(rows, 6, dtype=torch.long), "advantages": torch.randn(rows, 6, generator=gen),
    }, batch_size=[rows])
    attach_meta(batch, compute_batch_meta(batch, dp_size=1, loss_scale_factor=1.0))
    return batch


def test_bf16_one_rank_accumulates_over_one_cast(tiny_model_dir, in_process_group):
    """FSDP2 on one rank keeps each layer's bfloat16 copy for the whole update and accumulates the
    micro-batches' gradients unsharded in float32 (workers/trainable.py, _one_cast_per_update).
    The SGD step equals the whole mini-batch's within the bfloat16 tolerance, and no copy survives
    the step: the next forward computes with the new weights."""
    from workers.offload import reshard_fsdp

    overrides = {"actor.mixed_precision.param_dtype": "bfloat16", "actor.optim.name": "sgd", "actor.optim.lr": 0.5,
                 "actor.ppo_mini_batch_size": 16, "data.train_batch_size": 8, "rollout.n": 2, "actor.ppo_epochs": 1,
                 "algorithm.adv_estimator": "grpo", "algorithm.rollout_correction.mode": "none"}
    whole = _trainer("actor", tiny_model_dir, **overrides, **{"actor.ppo_micro_batch_size_per_gpu": 16})
    split = _trainer("actor", tiny_model_dir, **overrides, **{"actor.ppo_micro_batch_size_per_gpu": 4})
    before = {k: v.full_tensor().clone() for k, v in whole.model.state_dict().items()}
    batch = _update_batch(whole.model.config.vocab_size, 16)
    whole.update([batch.clone()])
    records = split.update([batch.clone()])
    assert records[0][-1]["actor/num_micro_batches"].value == 4.0
    ids = batch["input_ids"][:2]
    with torch.no_grad():  # first: reading a state dict would reshard, hiding a stale copy
        after_update = split.model(input_ids=ids).logits
        reshard_fsdp(split.model)  # a forward from freshly cast weights
        fresh = split.model(input_ids=ids).logits
    torch.testing.assert_close(after_update, fresh, rtol=0, atol=0)
    moved = {k: whole.model.state_dict()[k].full_tensor() - before[k] for k in before}
    largest = max(float(d.abs().max()) for d in moved.values())
    assert largest > 0
    for name, delta in moved.items():
        other = split.model.state_dict()[name].full_tensor() - before[name]
        assert float((other - delta).abs().max()) <= BF16_RTOL * largest, name


def test_bf16_resume_is_bitwise(fits):
    fits.generating  # noqa: B018 - its step-1 checkpoint
    step1 = os.path.join(checkpoints(fits.run_dirs["fsdp2-whole"]), "step_1")
    resumed = fits.fit("fsdp2-whole-resumed", **LAYOUTS["fsdp2-whole"], **{"trainer.resume_mode": step1})
    assert [h["step"] for h in resumed.steps()] == list(range(1, STEPS + 1))
    diff = compare_fits(fits.generating, resumed, metrics=required_metrics(FAMILY), bitwise=True)
    assert not diff.failures, diff.failures[:10]


def test_float16_scales_the_loss(fits):
    """float16 (FSDP2's policy): the loss scale starts at 2**16 and halves after every mini-batch
    whose gradient overflowed (that mini-batch skipped); the run ends finite."""
    # no KL term (no reference process): the loss scaling is what is checked here
    fit = fits.replaying("fsdp2-whole", **{"actor.mixed_precision.param_dtype": "float16", "actor.use_kl_loss": False})
    for role in ("actor", "critic"):
        scales = [h[f"{role}/loss_scale"] for h in fit.steps()]
        skipped = [h[f"{role}/skipped_minibatches"] for h in fit.steps()]
        print(f"float16 {role}: loss scale per step {scales}, skipped {skipped}")
        assert scales[0] == 2.0**16
        for step, (scale, skip) in enumerate(zip(scales, skipped)):  # one optimizer step per training step
            if step + 1 < len(scales):
                assert scales[step + 1] == (scale / 2 if skip else scale)
    for name, tensor in fit.weights["actor"].items():
        assert torch.isfinite(tensor).all(), name


@pytest.mark.parametrize("overrides, pattern", [
    ({"actor.mixed_precision.param_dtype": "int8"},
     r"actor\.mixed_precision\.param_dtype='int8' is not one of float32, bfloat16, float16"),
    ({"actor.mixed_precision.param_dtype": "bfloat16", "actor.mixed_precision.reduce_dtype": "float64"},
     r"actor\.mixed_precision\.reduce_dtype='float64' is not one of"),
    ({"actor.model.dtype": "bfloat16", "actor.mixed_precision.param_dtype": "float16"},
     r"actor\.mixed_precision\.param_dtype=float16 computes below float32 master weights: actor\.model\.dtype must be float32"),
    ({"critic.model.dtype": "float16", "actor.mixed_precision.param_dtype": "bfloat16"},
     r"critic\.mixed_precision\.param_dtype=bfloat16 .* critic\.model\.dtype must be float32"),
])
def test_bad_mixed_precision_config_names_the_key(overrides, pattern):
    from conftest import tiny_overrides
    from rlflow import load_config
    from rlflow.config import ConfigError

    with pytest.raises(ConfigError, match=pattern):
        load_config(None, tiny_overrides("unused", **{"algorithm.adv_estimator": "gae", **overrides}))


def test_the_critic_inherits_the_actors_mixed_precision():
    from conftest import tiny_overrides
    from rlflow import load_config

    cfg = load_config(None, tiny_overrides("unused", **{"algorithm.adv_estimator": "gae",
                                                         "actor.mixed_precision.param_dtype": "bfloat16",
                                                         "actor.mixed_precision.reduce_dtype": "bfloat16"}))
    assert (cfg.critic.mixed_precision.param_dtype, cfg.critic.mixed_precision.reduce_dtype) == ("bfloat16", "bfloat16")
    cfg = load_config(None, tiny_overrides("unused", **{"algorithm.adv_estimator": "gae",
                                                         "actor.mixed_precision.param_dtype": "bfloat16",
                                                         "critic.mixed_precision.param_dtype": "float32"}))
    assert cfg.critic.mixed_precision.param_dtype == "float32"  # the critic alone trains in float32
    default = load_config(None, tiny_overrides("unused"))
    assert default.actor.mixed_precision.param_dtype == "float32"  # off: the model's dtype
