"""NaN out of a worker's model: NaN logits in the actor's update, NaN old / reference log-probs,
NaN values from the critic.

Injected by test-only worker subclasses (tests/fault_workers.py, actions nan_logits / nan_values):
a forward hook makes the model return NaN logits (scores, for the value model) during one call of
one method. (NaN in the loss inputs instead, and the skipped mini-batches' effect on the weights
and optimizer: test_bad_input.py.)
"""

from __future__ import annotations

import math
import os
import re

import pytest
import torch

from controllers.worker_group import WorkerError
from reliability import runs


def test_nan_logits_in_the_actor_update_abort_names_step_role_and_gradient(ray_session, tiny_model_dir, tmp_path,
                                                                           no_leftover_workers):
    with pytest.raises(WorkerError) as info:
        runs.fit(tiny_model_dir, str(tmp_path), fault_spec="actor:0:update:1:nan_logits",
                 **{**runs.CHEAP, "trainer.nan_policy": "abort"})
    message = str(info.value)
    print(f"\nnan logits, abort -> {message}")
    assert message.startswith("step 1 (of 1): actor rank 0: update raised NonFiniteError: "
                              "actor rank 0: non-finite gradient norm (nan)"), message
    assert "'actor/pg_loss': nan" in message and "trainer.nan_policy=skip" in message


def test_nan_logits_in_the_actor_update_skip_counts_and_trains_on(ray_session, tiny_model_dir, tmp_path,
                                                                  no_leftover_workers):
    """Step 1's update sees NaN logits: both its mini-batches are skipped and counted; step 2
    trains normally, and the final weights are finite and trained."""
    from safetensors.torch import load_file

    history, trainer = runs.fit(tiny_model_dir, str(tmp_path), fault_spec="actor:0:update:1:nan_logits",
                                return_trainer=True,
                                **{**runs.CHEAP, "trainer.total_steps": 2, "trainer.nan_policy": "skip"})
    print(f"\nnan logits, skip -> skipped per step: {[h['actor/skipped_minibatches'] for h in history]}")
    assert [h["step"] for h in history] == [1, 2]
    assert [h["actor/skipped_minibatches"] for h in history] == [2.0, 0.0]
    assert math.isnan(history[0]["actor/grad_norm"]) and math.isnan(history[0]["actor/pg_loss"])
    assert math.isfinite(history[1]["actor/grad_norm"]) and math.isfinite(history[1]["actor/pg_loss"])
    final = runs.final_weights(trainer)["actor"]
    initial = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    assert all(torch.isfinite(final[name]).all() for name in initial)
    assert any(not torch.equal(final[name], initial[name]) for name in initial), "step 2 did not train"


# (fault spec, config, the role and the call whose output is NaN)
NAN_FORWARDS = [
    pytest.param("actor:0:compute_log_prob:1:nan_logits", {**runs.CHEAP, "actor.skip_old_log_prob_when_on_policy": False},
                 "actor", "compute_log_prob", id="old-log-probs"),
    pytest.param("reference:0:compute_ref_log_prob:1:nan_logits", runs.WITH_REFERENCE, "reference",
                 "compute_ref_log_prob", id="reference-log-probs"),
    pytest.param("critic:0:compute_values:1:nan_values", runs.WITH_CRITIC, "critic", "compute_values", id="values"),
]


@pytest.mark.parametrize("spec, overrides, role, call", NAN_FORWARDS)
def test_nan_forward_output_stops_the_run_naming_its_role_and_call(ray_session, tiny_model_dir, tmp_path,
                                                                   no_leftover_workers, spec, overrides, role, call):
    """A no-grad forward of step 1 (the old log-probs, the reference log-probs, the values)
    returns NaN; nan_policy=abort: the run stops at that step with an error that names the role
    and the call that produced the NaN (not a later consumer of it), and says it is non-finite."""
    try:
        history = runs.fit(tiny_model_dir, str(tmp_path), fault_spec=spec, **{**overrides, "trainer.nan_policy": "abort"})
    except (WorkerError, FloatingPointError) as err:
        message = str(err)
    else:
        nan = sorted(k for h in history for k, v in h.items() if isinstance(v, float) and not math.isfinite(v))
        pytest.fail(f"nan_policy=abort, {role}.{call} returned NaN, and the run trained on through it: it finished "
                    f"{len(history)} step(s) with non-finite metrics {nan}")
    print(f"\n{spec} -> {message}")
    assert message.startswith(f"step 1 (of 1): {role}"), f"the error must be about the {role}'s {call}: {message}"
    assert call in message and re.search(r"non-finite|\bnan\b", message, re.IGNORECASE), message
