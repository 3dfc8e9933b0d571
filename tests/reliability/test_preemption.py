"""Preemption: SIGTERM / SIGINT to the driver (what a scheduler, Ctrl-C or `ray job stop` sends)
stops `rlflow train` at the next step boundary with a checkpoint of that step and exit status 0;
the same command then goes on from it. A second signal stops at once.

The signal is sent by the run itself, from its reward function (scored in the driver,
reward.num_workers=0) at the step's first scoring: the same point of the step every time.
`rlflow.cli.main` runs in this process, on the session's Ray.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from conftest import tiny_overrides
from controllers import checkpoint as ckpt
from rlflow.cli import main

REWARD = '''
import os, signal
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    marker = {marker!r}
    if not os.path.exists(marker):
        open(marker, "w").close()
        for sig in {signals!r}:
            os.kill(os.getpid(), sig)
    return (sum(map(ord, solution_str)) % 7) / 3.0 - 1.0
'''


def _args(tiny_model_dir, tmp_path, signals, **extra):
    reward = tmp_path / "signalling_reward.py"
    reward.write_text(REWARD.format(marker=str(tmp_path / "signalled"), signals=[int(s) for s in signals]))
    return tiny_overrides(tiny_model_dir, **{
        "trainer.total_steps": 3, "trainer.default_local_dir": str(tmp_path / "out"), "trainer.experiment_name": "pre",
        "reward.custom_function.path": str(reward), "trainer.deterministic": True, **extra})


def _steps_logged(tmp_path) -> list[int]:
    path = tmp_path / "out" / "rlflow" / "pre" / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_preempt_sigterm_checkpoints_the_step_exits_0_and_the_same_command_goes_on(ray_session, tiny_model_dir,
                                                                                     tmp_path, capsys):
    args = _args(tiny_model_dir, tmp_path, [signal.SIGTERM])
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    assert main(["train", *args]) == 0
    err = capsys.readouterr().err
    root = os.path.join(str(tmp_path / "out"), "rlflow", "pre", "checkpoints")
    print(err)
    assert "rlflow: SIGTERM: the run stops after this step" in err
    assert f"rlflow: stopped by SIGTERM after step 1 of 3 (checkpoint {os.path.join(root, 'step_1')}); run the same " \
           "command again to go on" in err
    assert [name for _, name in ckpt.list_checkpoints(root)] == ["step_1"]
    ckpt.verify(ckpt.find_latest(root))
    assert _steps_logged(tmp_path) == [1]
    # the handlers are the test process's own again
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers

    assert main(["train", *args]) == 0  # the marker exists: no signal this time
    err = capsys.readouterr().err
    assert f"rlflow: resumed from {os.path.join(root, 'step_1')} (step 1)" in err
    assert _steps_logged(tmp_path) == [1, 2, 3]


def test_preempt_second_signal_stops_at_once_without_a_checkpoint(ray_session, tiny_model_dir, tmp_path, capsys):
    args = _args(tiny_model_dir, tmp_path, [signal.SIGINT, signal.SIGINT], **{"trainer.save_freq": 1})
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    clock = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        main(["train", *args])
    print(f"stopped {time.monotonic() - clock:.1f} s after the start")
    err = capsys.readouterr().err
    assert "rlflow: SIGINT again: stopping now, without a checkpoint" in err
    root = os.path.join(str(tmp_path / "out"), "rlflow", "pre", "checkpoints")
    assert ckpt.list_checkpoints(root) == []  # it stopped inside step 1, before step 1's own checkpoint
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers
