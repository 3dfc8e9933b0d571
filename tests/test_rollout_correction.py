"""The rollout correction (rlflow.algos.rollout_correction): hand computations of every mode and of
the mismatch metrics, the all-ones case bitwise equal to no correction (the pure losses and the real
actor worker), dropped tokens keeping their counts, config validation, missing rollout log-probs,
and a GRPO fit with a correction on (Ray) whose on-policy mismatch is measured.

The split invariance of the weights and metrics is in tests/test_algos_invariance.py
(test_rollout_correction_split_invariance, and the registry-wide term test draws rollout_is_weights).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from conftest import tiny_overrides
from rlflow import load_config
from rlflow.algos import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    ROLLOUT_CORRECTIONS,
    ROLLOUT_IS_WEIGHTS,
    RolloutCorrectionOptions,
    compute_rollout_correction,
    correction_modes,
    rollout_is_weights,
)
from rlflow.config import ConfigError, to_dataclass
from rlflow.metrics import Aggregation, reduce_metrics
from rlflow.protocol import BatchMeta

# the in-process actor (WorkerBase) sets threads, seeds and Ray's tensor serializer for the whole
# process: tests/conftest.py's fixture puts them back after this module
pytestmark = pytest.mark.usefixtures("restore_process_state")

F64 = torch.float64
E = math.exp

# Two responses: 3 and 2 valid tokens; the padding holds junk the correction must ignore.
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
OLD = torch.tensor([[-1.0, -2.0, -0.5, 7.0], [-0.2, -1.8, 7.0, 7.0]], dtype=F64)
ROLLOUT = torch.tensor([[-1.5, -1.0, -0.5, 0.0], [-0.1, -3.0, 0.0, 0.0]], dtype=F64)
# d = old - rollout on the valid tokens: row 0 (0.5, -1.0, 0.0), row 1 (-0.1, 1.2)
D = [[0.5, -1.0, 0.0], [-0.1, 1.2]]
OPTIONS = dict(cap=2.0, low=0.5, high=2.0)

# every weight written out: the token ratios are e^0.5 = 1.6487, e^-1 = 0.3679, 1, e^-0.1 = 0.9048,
# e^1.2 = 3.3201; the sequence ratios e^-0.5 = 0.6065 (row 0) and e^1.1 = 3.0042 (row 1)
EXPECTED_WEIGHTS = {
    # min(ratio, 2) per token: e^1.2 is truncated to 2
    "token_tis": [[E(0.5), E(-1.0), 1.0], [E(-0.1), 2.0]],
    # min(product of the row's ratios, 2) on each of its tokens: row 1's e^1.1 is truncated to 2
    "seq_tis": [[E(-0.5)] * 3, [2.0, 2.0]],
    # the ratio inside [0.5, 2], else 0: e^-1 < 0.5 and e^1.2 > 2 are dropped
    "token_mis": [[E(0.5), 0.0, 1.0], [E(-0.1), 0.0]],
    # the row's ratio product inside [0.5, 2], else 0 for the whole row: row 1 (e^1.1) is dropped
    "seq_mis": [[E(-0.5)] * 3, [0.0, 0.0]],
}
EXPECTED_TRUNCATED = {"token_tis": 1 / 5, "seq_tis": 2 / 5, "token_mis": 0.0, "seq_mis": 0.0}
EXPECTED_DROPPED = {"token_tis": 0.0, "seq_tis": 0.0, "token_mis": 2 / 5, "seq_mis": 2 / 5}


def valid_values(tensor: torch.Tensor) -> list[list[float]]:
    return [[float(v) for v, m in zip(row, mrow) if m] for row, mrow in zip(tensor, MASK)]


def close(rows: list[list[float]], expected: list[list[float]], rel: float = 1e-12) -> bool:
    return len(rows) == len(expected) and all(row == pytest.approx(e, rel=rel) for row, e in zip(rows, expected))


def test_every_registered_mode_has_a_hand_computation():
    assert set(ROLLOUT_CORRECTIONS) == set(EXPECTED_WEIGHTS)
    assert correction_modes() == ("none", *ROLLOUT_CORRECTIONS)


@pytest.mark.parametrize("mode", sorted(EXPECTED_WEIGHTS))
def test_each_mode_against_a_hand_computation(mode):
    weights, metrics = compute_rollout_correction(OLD, ROLLOUT, MASK, RolloutCorrectionOptions(mode=mode, **OPTIONS))
    assert not weights.requires_grad and weights.dtype == F64
    for row, expected_row in zip(valid_values(weights), EXPECTED_WEIGHTS[mode]):
        assert row == pytest.approx(expected_row, rel=1e-12)
    assert torch.all(weights[MASK == 0] == 1.0)  # neutral outside the mask (the loss masks it anyway)
    flat = [w for row in EXPECTED_WEIGHTS[mode] for w in row]
    assert metrics["rollout_corr/is_weight_mean"].value == pytest.approx(sum(flat) / 5, rel=1e-12)
    assert metrics["rollout_corr/truncated_frac"].value == pytest.approx(EXPECTED_TRUNCATED[mode])
    assert metrics["rollout_corr/dropped_frac"].value == pytest.approx(EXPECTED_DROPPED[mode])
    assert torch.equal(rollout_is_weights(OLD, ROLLOUT, MASK, RolloutCorrectionOptions(mode=mode, **OPTIONS)), weights)


def test_other_caps_and_bands():
    """cap 3.5 truncates nothing here; the band [0.3, 4] drops nothing; [0.95, 1.05] keeps only
    the exactly on-policy token (ratio 1; e^-0.1 = 0.905 is below 0.95)."""
    weights, metrics = compute_rollout_correction(OLD, ROLLOUT, MASK, RolloutCorrectionOptions(mode="token_tis", cap=3.5))
    assert close(valid_values(weights), [[E(0.5), E(-1.0), 1.0], [E(-0.1), E(1.2)]])
    assert metrics["rollout_corr/truncated_frac"].value == 0.0
    weights, _ = compute_rollout_correction(OLD, ROLLOUT, MASK, RolloutCorrectionOptions(mode="token_mis", low=0.3, high=4.0))
    assert close(valid_values(weights), [[E(0.5), E(-1.0), 1.0], [E(-0.1), E(1.2)]])
    weights, metrics = compute_rollout_correction(OLD, ROLLOUT, MASK, RolloutCorrectionOptions(mode="token_mis", low=0.95, high=1.05))
    assert valid_values(weights) == [[0.0, 0.0, 1.0], [0.0, 0.0]]
    assert metrics["rollout_corr/dropped_frac"].value == pytest.approx(4 / 5)
    assert metrics["rollout_corr/out_of_band_frac"].value == pytest.approx(4 / 5)  # the metric uses the same band


def test_mismatch_metrics_against_a_hand_computation_and_their_aggregations():
    _, metrics = compute_rollout_correction(OLD, ROLLOUT, MASK, RolloutCorrectionOptions(mode="none", **OPTIONS))
    d = [x for row in D for x in row]
    assert set(metrics) == {"rollout_corr/log_ratio_mean", "rollout_corr/k3_kl", "rollout_corr/abs_diff_max",
                            "rollout_corr/out_of_band_frac"}  # no weights, no weight statistics
    assert metrics["rollout_corr/log_ratio_mean"].value == pytest.approx(0.6 / 5, rel=1e-12)
    # k3 = e^d - 1 - d: 0.14872, 0.36788, 0, 0.0048374, 1.12012
    assert metrics["rollout_corr/k3_kl"].value == pytest.approx(0.3283110105288155, rel=1e-12)
    assert metrics["rollout_corr/k3_kl"].value == pytest.approx(sum(math.expm1(x) - x for x in d) / 5, rel=1e-12)
    assert metrics["rollout_corr/abs_diff_max"].value == pytest.approx(1.2, rel=1e-12)
    assert metrics["rollout_corr/out_of_band_frac"].value == pytest.approx(2 / 5)  # e^-1 and e^1.2
    # token statistics: MEAN weighted by the micro-batch's valid tokens; the largest difference: MAX
    for name in ("log_ratio_mean", "k3_kl", "out_of_band_frac"):
        assert metrics[f"rollout_corr/{name}"].aggregation is Aggregation.MEAN
        assert metrics[f"rollout_corr/{name}"].weight == 5
    assert metrics["rollout_corr/abs_diff_max"].aggregation is Aggregation.MAX


def test_metrics_of_two_micro_batches_reduce_to_the_whole():
    """One row per micro-batch (3 and 2 tokens): the driver's reduction is the whole batch's mean
    (not the mean of the two means) and max, and an empty micro-batch changes nothing."""
    options = RolloutCorrectionOptions(mode="token_mis", **OPTIONS)
    whole = compute_rollout_correction(OLD, ROLLOUT, MASK, options)[1]
    records = [compute_rollout_correction(OLD[i : i + 1], ROLLOUT[i : i + 1], MASK[i : i + 1], options)[1] for i in (0, 1)]
    empty = compute_rollout_correction(OLD[:1], ROLLOUT[:1], torch.zeros_like(MASK[:1]), options)[1]
    assert empty["rollout_corr/abs_diff_max"].value == 0.0 and empty["rollout_corr/k3_kl"].weight == 0
    reduced = reduce_metrics([*records, empty])
    for name, metric in whole.items():
        assert reduced[name] == pytest.approx(metric.value, rel=1e-12, abs=1e-15), name
    # the mean of the two micro-batch means would be (−0.5/3 + 1.1/2) / 2, not 0.12
    assert reduced["rollout_corr/log_ratio_mean"] == pytest.approx(0.12, rel=1e-12)
    assert reduced["rollout_corr/abs_diff_max"] == pytest.approx(1.2, rel=1e-12)


# ------------------------------------------------------------------------- the loss, by hand

ADV = torch.tensor([[1.0, 2.0, -1.0, 9.0], [0.5, -2.0, 9.0, 9.0]], dtype=F64)


def policy_loss(name: str, mode: str, log_probs, weights=None, old=OLD, meta=None, **loss_options):
    spec = POLICY_LOSSES[name]
    options = spec.options(loss_agg_mode=mode, loss_scale_factor=4.0, **loss_options)
    batch = {"log_probs": log_probs, "old_log_probs": old, "advantages": ADV, "response_mask": MASK}
    if weights is not None:
        batch[ROLLOUT_IS_WEIGHTS] = weights
    return spec.fn(batch, meta, options)


@pytest.mark.parametrize("mode", sorted(EXPECTED_WEIGHTS))
def test_weighted_policy_loss_and_gradient_by_hand(mode):
    """REINFORCE at the proximal policy (log_probs == old: ratio 1): the per-token loss is -A, so
    the token-mean loss is -sum(A * w) / 5 and d loss / d log_prob = -A * w / 5: a dropped token
    has no gradient but still counts in the 5 (its sequence, in seq-mean-*, in the 2)."""
    weights = rollout_is_weights(OLD, ROLLOUT, MASK, RolloutCorrectionOptions(mode=mode, **OPTIONS))
    w = EXPECTED_WEIGHTS[mode]
    a = [[1.0, 2.0, -1.0], [0.5, -2.0]]
    weighted = [[-a[r][t] * w[r][t] for t in range(len(a[r]))] for r in range(2)]
    log_probs = OLD.clone().requires_grad_(True)
    loss, metrics = policy_loss("reinforce", "token-mean", log_probs, weights)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(sum(map(sum, weighted)) / 5, rel=1e-12)
    assert close(valid_values(log_probs.grad), [[x / 5 for x in row] for row in weighted])
    assert torch.all(log_probs.grad[MASK == 0] == 0)
    # seq-mean-token-mean: each row's weighted token mean, over the 2 sequences (row 1 of seq_mis
    # is all dropped: it still counts as a sequence)
    loss, _ = policy_loss("reinforce", "seq-mean-token-mean", OLD, weights)
    assert float(loss) == pytest.approx((sum(weighted[0]) / 3 + sum(weighted[1]) / 2) / 2, rel=1e-12)
    # the driver's BatchMeta is computed from response_mask alone: dropped tokens leave it unchanged
    meta = BatchMeta(dp_size=2, batch_num_tokens=5 + 7, global_batch_size=2 + 3, loss_scale_factor=4.0)
    loss, _ = policy_loss("reinforce", "token-mean", OLD, weights, meta=meta)
    assert float(loss) == pytest.approx(2 * sum(map(sum, weighted)) / 12, rel=1e-12)


def test_decoupled_objective_ratio_against_the_proximal_policy():
    """The PPO ratio is pi_theta / pi_old, the IS weight pi_old / pi_rollout: with the current
    policy at the proximal one, nothing is clipped however far the rollout is; the weight
    multiplies the unclipped -A."""
    options = RolloutCorrectionOptions(mode="token_tis", **OPTIONS)
    weights = rollout_is_weights(OLD, ROLLOUT, MASK, options)
    log_probs = OLD.clone().requires_grad_(True)
    loss, metrics = policy_loss("vanilla", "token-mean", log_probs, weights, clip_ratio_low=0.2, clip_ratio_high=0.2)
    assert metrics["pg_clipfrac"].value == 0.0 and metrics["ppo_kl"].value == 0.0
    w = EXPECTED_WEIGHTS["token_tis"]
    expected = -(1.0 * w[0][0] + 2.0 * w[0][1] - 1.0 * w[0][2] + 0.5 * w[1][0] - 2.0 * w[1][1]) / 5
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-12)
    # a current policy 0.5 above the proximal on token (0, 0), A = 1 > 0: PPO clips the ratio at 1.2
    # (zero gradient there), and the weight e^0.5 still multiplies the clipped loss
    moved = OLD.clone()
    moved[0, 0] += 0.5
    moved.requires_grad_(True)
    loss, _ = policy_loss("vanilla", "token-mean", moved, weights, clip_ratio_low=0.2, clip_ratio_high=0.2)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(expected + (1.0 * w[0][0] - 1.2 * w[0][0]) / 5, rel=1e-12)
    assert float(moved.grad[0, 0]) == 0.0


@pytest.mark.parametrize("correction", sorted(ROLLOUT_CORRECTIONS))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_all_ones_weights_are_bitwise_the_uncorrected_loss(name, mode, correction):
    """rollout == old: every weight is exactly 1, and the loss, its gradient and every policy
    metric are bitwise those of the run without the correction (float32, the workers' dtype)."""
    gen = torch.Generator().manual_seed(11)
    shape = (6, 9)
    mask = (torch.arange(9) < torch.tensor([9, 1, 0, 5, 7, 3]).unsqueeze(1)).long()
    old = (torch.randn(shape, generator=gen) * 0.5 - 1.0)
    log_probs = old + torch.randn(shape, generator=gen) * 0.3
    advantages = torch.randn(shape, generator=gen)
    weights = rollout_is_weights(old, old.clone(), mask, RolloutCorrectionOptions(mode=correction, **OPTIONS))
    assert weights.dtype == torch.float32 and torch.all(weights == 1.0)
    spec = POLICY_LOSSES[name]
    options = spec.options(loss_agg_mode=mode, loss_scale_factor=9.0)
    meta = BatchMeta(dp_size=2, batch_num_tokens=40, global_batch_size=8, loss_scale_factor=9.0)
    results = []
    for extra in ({}, {ROLLOUT_IS_WEIGHTS: weights}):
        leaf = log_probs.clone().requires_grad_(True)
        batch = {"log_probs": leaf, "old_log_probs": old, "advantages": advantages, "response_mask": mask, **extra}
        loss, metrics = spec.fn(batch, meta, options)
        loss.backward()
        results.append((loss.detach(), leaf.grad, metrics))
    (loss_a, grad_a, metrics_a), (loss_b, grad_b, metrics_b) = results
    assert torch.equal(loss_a, loss_b) and torch.equal(grad_a, grad_b)
    assert metrics_a == metrics_b


# -------------------------------------------------------------------------------- config


@pytest.mark.parametrize("overrides, pattern", [
    ({"algorithm.rollout_correction.mode": "tis"}, r"algorithm\.rollout_correction\.mode must be one of none, token_tis"),
    ({"algorithm.rollout_correction.cap": 0.0}, r"algorithm\.rollout_correction\.cap must be >= 1"),
    ({"algorithm.rollout_correction.cap": -2.0}, r"algorithm\.rollout_correction\.cap must be >= 1"),
    ({"algorithm.rollout_correction.cap": 0.5}, r"algorithm\.rollout_correction\.cap must be >= 1"),
    ({"algorithm.rollout_correction.low": 1.0, "algorithm.rollout_correction.high": 1.0},
     r"algorithm\.rollout_correction\.low must be < high \(1\.0\), got 1\.0"),
    ({"algorithm.rollout_correction.low": 1.5, "algorithm.rollout_correction.high": 3.0},
     r"algorithm\.rollout_correction\.low must be in \[0, 1\]"),
    ({"algorithm.rollout_correction.high": 0.8}, r"algorithm\.rollout_correction\.high must be >= 1"),
    ({"algorithm.rollout_correction.mode": "token_tis", "rollout.calculate_log_probs": False},
     r"algorithm\.rollout_correction\.mode=token_tis .* needs rollout\.calculate_log_probs=true"),
    ({"algorithm.rollout_correction.mdoe": "token_tis"}, r"did you mean 'algorithm\.rollout_correction\.mode'"),
])
def test_bad_rollout_correction_configs_name_the_key(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, [f"{k}={v}" for k, v in overrides.items()])


def test_rollout_correction_config_defaults_and_values():
    cfg = load_config(None, ["algorithm.rollout_correction.mode=seq_mis", "algorithm.rollout_correction.low=0.25",
                             "algorithm.rollout_correction.high=4"])
    section = to_dataclass(cfg).algorithm.rollout_correction
    assert (section.mode, section.cap, section.low, section.high) == ("seq_mis", 2.0, 0.25, 4.0)
    assert load_config().algorithm.rollout_correction.mode == "none"


def test_a_batch_without_rollout_log_probs_is_refused_by_the_driver_when_correcting(tmp_path):
    """A recording made without the engine's log-probs: mode none trains on it (no metrics), a
    correction stops before any forward naming the key. No Ray: the check runs on the driver."""
    from tensordict import TensorDict

    from controllers.ppo import PPOTrainer

    batch = TensorDict({"response_mask": torch.ones(2, 3)}, batch_size=[2])
    PPOTrainer(load_config())._check_rollout_log_probs(batch, 0)
    trainer = PPOTrainer(load_config(None, ["algorithm.rollout_correction.mode=token_mis"]))
    with pytest.raises(ValueError, match="rollout_correction.mode=token_mis needs rollout_log_probs, which the batch of step 4"):
        trainer._check_rollout_log_probs(batch, 3)
    batch["rollout_log_probs"] = torch.zeros(2, 3)
    trainer._check_rollout_log_probs(batch, 3)


def test_a_replayed_recording_without_rollout_log_probs_is_refused_before_ray_starts(tiny_model_dir, tmp_path,
                                                                                      monkeypatch):
    from controllers import cluster
    from controllers.ppo import PPOTrainer
    from controllers.rollout_source import step_file

    record = tmp_path / "rollouts"
    record.mkdir()
    batch = {"responses": torch.ones(2, 3, dtype=torch.long), "response_mask": torch.ones(2, 3, dtype=torch.long)}
    torch.save({"batch": batch, "weight_version": 0, "extras": {}}, step_file(str(record), 0))

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray would start")

    monkeypatch.setattr(cluster, "ensure_ray", no_ray)
    cfg = load_config(None, tiny_overrides(tiny_model_dir, **{
        "trainer.total_steps": 1, "trainer.replay_rollouts": str(record), "algorithm.adv_estimator": "grpo",
        "algorithm.rollout_correction.mode": "seq_tis", "trainer.default_local_dir": str(tmp_path)}))
    with pytest.raises(ValueError, match="rollout_correction.mode=seq_tis needs rollout_log_probs, which the batch of step 1"):
        PPOTrainer(cfg).setup()


class _RecordingGroup:
    """A worker group that records the shards the driver's update sends (no Ray)."""

    def __init__(self):
        self.sent = []

    def call_per_dp_rank_async(self, method, per_rank_args):
        self.sent.append([args[0] for args in per_rank_args])
        return per_rank_args

    def call_all_async(self, method, *args):
        assert method == "set_threads"  # the driver's share of the cores for the update
        return []

    def gather(self, futures, method):
        return [[[] for _ in shards] for (shards,) in futures]


@pytest.mark.parametrize("with_rollout_log_probs", [True, False])
def test_the_actor_receives_rollout_log_probs_only_when_the_batch_has_them(with_rollout_log_probs):
    """Role.optional_update_keys: sent when the step's batch carries the key; a batch without it
    (rollout.calculate_log_probs=false, an old recording) is trained on without it, no KeyError."""
    from tensordict import TensorDict

    from controllers.ppo import PPOTrainer
    from controllers.roles import ACTOR, MODEL_INPUT_KEYS
    from controllers.setup import CoreShare

    assert "rollout_log_probs" in ACTOR.optional_update_keys
    assert "rollout_log_probs" not in ACTOR.update_keys(to_dataclass(load_config()), True)
    trainer = PPOTrainer(load_config(None, ["algorithm.adv_estimator=grpo", "actor.ppo_mini_batch_size=8",
                                            "data.train_batch_size=4", "rollout.n=4", "actor.ppo_micro_batch_size_per_gpu=4"]))
    rows, width = 16, 3
    batch = TensorDict({key: torch.ones(rows, width, dtype=torch.long) for key in MODEL_INPUT_KEYS}, batch_size=[rows])
    batch["advantages"] = torch.zeros(rows, width)
    if with_rollout_log_probs:
        batch["rollout_log_probs"] = -torch.ones(rows, width)
    trainer.active_roles = {"actor": ACTOR}
    trainer.groups = {"actor": _RecordingGroup()}
    trainer.cores = CoreShare(num_cores=1, processes={"actor": 1}, trained=("actor",), generates_ahead=False)
    trainer._update(batch, step=0, on_policy=True)
    (per_rank,) = trainer.groups["actor"].sent
    shards = per_rank[0]
    assert len(shards) == 2  # two mini-batches of 8
    for shard in shards:
        assert ("rollout_log_probs" in shard.keys()) == with_rollout_log_probs
        assert "old_log_probs" not in shard.keys()


# ------------------------------------------------------------------ the real actor, in process


@pytest.fixture(scope="module")
def actor_setup(tiny_model_dir):
    """The tiny model's actor (rank 0 of 1, in this process, float64) and a micro-batch with old
    log-probs from the same model, advantages and a BatchMeta of a bigger mini-batch."""
    import test_loss_composition as composition

    def worker(mode: str):
        cfg = to_dataclass(load_config(None, tiny_overrides(tiny_model_dir, **{
            "algorithm.adv_estimator": "grpo", "actor.entropy_coeff": 0.01,
            "algorithm.rollout_correction.mode": mode})))
        return composition.actor_worker(tiny_model_dir, cfg)

    none_worker = worker("none")
    config = none_worker.model.config
    micro = composition.base_micro_batch(config.pad_token_id, config.vocab_size)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        from workers.forward import response_log_probs

        log_probs, _ = response_log_probs(none_worker.model, micro, none_worker.cfg.rollout.temperature)
    shape = micro["response_mask"].shape
    micro["old_log_probs"] = (log_probs + 0.1 * torch.randn(shape, generator=gen, dtype=log_probs.dtype)).float()
    micro["advantages"] = torch.randn(shape, generator=gen)
    meta = composition.meta_for(micro, 2)
    return worker, none_worker, micro, meta


def run_micro(worker, micro, meta):
    worker.model.zero_grad(set_to_none=True)
    loss, metrics = worker.micro_loss(micro, meta)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in worker.model.named_parameters()}
    return loss.detach(), grads, metrics


@pytest.mark.parametrize("mode", sorted(ROLLOUT_CORRECTIONS))
def test_actor_with_all_ones_weights_is_bitwise_the_uncorrected_actor(actor_setup, mode):
    """ActorWorker.micro_loss, rollout_log_probs == old_log_probs: the loss and every parameter's
    gradient equal mode none's bitwise; the mismatch metrics are all 0, the weights' mean 1."""
    worker, none_worker, micro, meta = actor_setup
    corrected = worker(mode)
    on_policy = micro.clone()
    on_policy["rollout_log_probs"] = micro["old_log_probs"].clone()
    loss_a, grads_a, metrics_a = run_micro(none_worker, on_policy, meta)
    loss_b, grads_b, metrics_b = run_micro(corrected, on_policy, meta)
    assert torch.equal(loss_a, loss_b)
    for name, grad in grads_a.items():
        assert torch.equal(grad, grads_b[name]), name
    for name, metric in metrics_a.items():
        assert metric == metrics_b[name], name
    assert metrics_b["rollout_corr/is_weight_mean"].value == 1.0 and metrics_b["rollout_corr/dropped_frac"].value == 0.0
    for name in ("log_ratio_mean", "k3_kl", "abs_diff_max", "out_of_band_frac"):
        assert metrics_a[f"rollout_corr/{name}"].value == 0.0, name
    # a real mismatch changes the loss (the weights are applied)
    shifted = micro.clone()
    shifted["rollout_log_probs"] = micro["old_log_probs"] - 0.3 * torch.sign(micro["advantages"])
    assert not torch.equal(run_micro(corrected, shifted, meta)[0], loss_a)


def test_actor_mismatch_metrics_without_a_correction_and_a_missing_key(actor_setup):
    worker, none_worker, micro, meta = actor_setup
    # no rollout_log_probs (an engine without them, an old recording): no metrics, no correction
    _, _, metrics = run_micro(none_worker, micro, meta)
    assert not any(name.startswith("rollout_corr/") for name in metrics)
    with pytest.raises(ValueError, match="rollout_correction.mode=token_tis needs rollout_log_probs"):
        worker("token_tis").micro_loss(micro, meta)
    # on-policy (no old_log_probs): the update's own detached log-probs are the proximal policy
    on_policy = micro.exclude("old_log_probs")
    on_policy["rollout_log_probs"] = micro["old_log_probs"]
    _, _, metrics = run_micro(none_worker, on_policy, meta)
    assert 0.01 < metrics["rollout_corr/abs_diff_max"].value < 1.0  # the 0.1 * randn offset above
    assert metrics["rollout_corr/abs_diff_max"].aggregation is Aggregation.MAX


# ---------------------------------------------------------------------------- end to end (Ray)


@pytest.mark.parametrize("mini_batch", [16, 8])
def test_grpo_fit_with_rollout_correction_measures_a_tiny_on_policy_mismatch(ray_session, tiny_model_dir, tmp_path,
                                                                             mini_batch, capsys):
    """Two GRPO steps with token-level TIS. mini_batch 16: one on-policy optimizer step (the
    proximal log-probs are the update's own); 8: two mini-batches, the driver recomputes old
    log-probs. The rollout engine (HF generate, float32) and the actor hold the same weights (the
    sync after every step), so the measured mismatch is float rounding only."""
    from controllers.ppo import PPOTrainer

    cfg = load_config(None, tiny_overrides(tiny_model_dir, **{
        "algorithm.adv_estimator": "grpo", "algorithm.rollout_correction.mode": "token_tis",
        "actor.ppo_mini_batch_size": mini_batch, "rollout.name": "hf", "trainer.total_steps": 2,
        "trainer.default_local_dir": str(tmp_path)}))
    trainer = PPOTrainer(cfg)
    assert trainer.update_is_on_policy(16) == (mini_batch == 16)
    history = trainer.fit()
    steps = [h for h in history if "actor/pg_loss" in h]
    assert len(steps) == 2
    names = ("log_ratio_mean", "k3_kl", "abs_diff_max", "out_of_band_frac", "is_weight_mean", "truncated_frac",
             "dropped_frac")
    for step in steps:
        for name in names:
            value = step[f"rollout_corr/{name}"]
            assert math.isfinite(value), (name, value)
        assert step["rollout_corr/abs_diff_max"] < 1e-4
        assert abs(step["rollout_corr/log_ratio_mean"]) < 1e-5 and abs(step["rollout_corr/k3_kl"]) < 1e-9
        assert step["rollout_corr/out_of_band_frac"] == 0.0 and step["rollout_corr/dropped_frac"] == 0.0
        assert step["rollout_corr/truncated_frac"] == 0.0
        assert step["rollout_corr/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    with capsys.disabled():
        print(f"\n[on-policy mismatch, mini-batch {mini_batch}] " + "; ".join(
            f"step {h['step']}: log_ratio_mean {h['rollout_corr/log_ratio_mean']:.3e}, "
            f"abs_diff_max {h['rollout_corr/abs_diff_max']:.3e}, k3 {h['rollout_corr/k3_kl']:.3e}" for h in steps))
