"""The environment pool (rlflow/agents/pool.py): environments in Ray processes, a timeout per reset
or step call, a hung or crashing call that ends only its episode while the other episodes of its
process are restored by replay, and outcomes equal to the serial LocalEnvPool's. Real Ray (the
session's); the environments are tests/agent_envs.py, loaded by file path as a user's would be."""

from __future__ import annotations

import os
import re
import time
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from rlflow.agents.pool import EnvError, EnvOutcome, EnvPool, LocalEnvPool, make_env_pool

TESTS = os.path.dirname(os.path.abspath(__file__))
SPEC = os.path.join(TESTS, "agent_envs.py") + ":Recorder"


def _rows(n: int, resets: dict[int, str] | None = None) -> list[dict]:
    resets = resets or {}
    return [{"data_source": "ab"[i % 2], "ground_truth": str(i), "raw_prompt": "", "source_prompt": "",
             "extra_info": {"name": f"e{i}", **({"reset": resets[i]} if i in resets else {})}} for i in range(n)]


def _pool(spec: str = SPEC, **kwargs) -> EnvPool:
    options = {"env_kwargs": {"scale": 0.5}, "num_workers": 2, "timeout_s": 2.0, "on_error": "zero", **kwargs}
    return EnvPool(spec, options.pop("env_kwargs"), **options)


def _play(pool, rows: list[dict], turns: list[dict[int, str]]) -> list[list[EnvOutcome]]:
    """reset(rows), then one step per {episode: turn}: every call's outcomes."""
    played = [pool.reset(rows)]
    for turn in turns:
        played.append(pool.step(list(turn), list(turn.values())))
    return played


def _ended(outcome: EnvOutcome, pattern: str) -> None:
    """The call failed under on_error=zero: a terminal 0-reward outcome whose error matches."""
    assert (outcome.reward, outcome.done, outcome.observation) == (0.0, True, ""), outcome
    assert outcome.error is not None and re.search(pattern, outcome.error), outcome.error


def test_outcomes_equal_the_serial_pool(ray_session, monkeypatch):
    monkeypatch.chdir(TESTS)  # a relative file spec, resolved against the driver's folder
    rows = _rows(8, resets={5: "raise", 3: "none"})
    turns = [{0: "a", 1: "b", 2: "raise", 3: "c", 4: "nan", 6: "text", 7: "d"},
             {0: "done", 1: "b", 3: "c", 7: "d"},
             {1: "x", 3: "y", 7: "z"}]
    serial = _play(LocalEnvPool(SPEC, {"scale": 0.5}, "zero"), rows, turns)
    pool = _pool("agent_envs.py:Recorder")
    try:
        assert _play(pool, rows, turns) == serial
        assert serial[3][2] == EnvOutcome("e7:3:d|d|z", 1.5, False, {"turns": 3})
        assert serial[1][0].observation == "e0:1:a" and serial[0][3].observation == ""
        _ended(serial[0][5], r"^environment reset on episode 5 \(data_source='b'\) raised KeyError: 'no such key'$")
        _ended(serial[1][2], r"^environment step of turn 1 on episode 2 \(data_source='a'\) raised ValueError")
        _ended(serial[1][4], r"step of turn 1 on episode 4 .* returned reward nan; the reward must be a finite number")
        _ended(serial[1][5], r"step of turn 1 on episode 6 .* returned str; step must return an rlflow.agents.StepResult")
        assert serial[2][0].done and serial[2][0].error is None  # "done" ends episode 0 normally
        with pytest.raises(ValueError, match="episode 0 is not live"):
            pool.step([0], ["a"])
        # a second batch discards the first; the calls ran in the pool's processes, one per process here
        assert [o.observation for o in pool.reset(_rows(2))] == ["e0:", "e1:"]
        pids = {int(o.observation) for o in pool.step([0, 1], ["pid", "pid"])}
        assert len(pids) == 2 and os.getpid() not in pids
        with pytest.raises(ValueError, match="episode 5 is not live"):
            pool.step([5], ["a"])
        assert pool.num_replaced == 0
    finally:
        pool.close()


def test_a_hung_or_crashing_step_ends_only_its_episode(ray_session, tmp_path):
    """Episode i lives in process i % 2. A hang, a GIL-holding hang and an os._exit each end their
    episode; the other episodes of the killed processes are replayed and go on where they were."""
    (tmp_path / "pool").mkdir()
    (tmp_path / "serial").mkdir()
    rows = _rows(8)
    pool = _pool(env_kwargs={"scale": 0.5, "marker_dir": str(tmp_path / "pool")})
    try:
        played = _play(pool, rows, [{i: "once" if i == 4 else "a" for i in range(8)}])
        start = time.monotonic()
        hung = pool.step(list(range(8)), ["b"] * 6 + ["hang", "gil"])  # the last call of each process
        stop_s = time.monotonic() - start
        print(f"\na hung call (timeout_s=2) was stopped after {stop_s:.2f} s")
        assert 2.0 <= stop_s < 6.0
        for i, source in ((6, "a"), (7, "b")):
            _ended(hung[i], rf"^environment step of turn 2 on episode {i} \(data_source='{source}'\) did not return "
                            r"within rollout\.agent\.timeout_s=2 s and was stopped \(its process was killed\)$")
        # process 0 (replaced): episode 0 is replayed, then 2 kills it; 4 goes on a third process, where
        # its replay fails ("once" works once). Process 1 (replaced): 1 and 3 are replayed, 3 hangs, and
        # 5 goes on a third process, where it is replayed and steps.
        crashed = pool.step([0, 1, 2, 3, 4, 5], ["c", "c", "exit", "hang", "c", "c"])
        _ended(crashed[2], r"^environment step of turn 3 on episode 2 \(data_source='a'\) killed its process "
                           r"\(exit code ")  # Ray reports 3, or "unknown" when it sees the socket close first
        _ended(crashed[3], r"^environment step of turn 3 on episode 3 \(data_source='b'\) did not return within")
        _ended(crashed[4], r"^environment step of turn 1 \(replayed to restore the episode after its process was "
                           r"replaced\) on episode 4 \(data_source='a'\) raised RuntimeError: 'once' ran a second time")
        last = pool.step([0, 1, 5], ["d"] * 3)
        # the hang and the GIL hang; "exit" twice: it died with episode 4's call in flight behind it, so
        # its calls were rerun one at a time, to name it; the second hang
        assert pool.num_replaced == 5
    finally:
        pool.close()
    serial = _play(LocalEnvPool(SPEC, {"scale": 0.5, "marker_dir": str(tmp_path / "serial")}), rows,
                   [{i: "once" if i == 4 else "a" for i in range(8)}, {i: "b" for i in range(6)},
                    {i: "c" for i in (0, 1, 5)}, {i: "d" for i in (0, 1, 5)}])
    assert played == serial[:2] and hung[:6] == serial[2]
    assert [crashed[i] for i in (0, 1, 5)] == serial[3] and last == serial[4]
    assert last[0] == EnvOutcome("e0:4:a|b|c|d", 2.0, False, {"turns": 4})


def test_on_error_raise_names_the_episode_its_source_the_call_and_the_cause(ray_session):
    pool = _pool(on_error="raise", timeout_s=1.0)
    local = LocalEnvPool(SPEC, {}, "raise")
    try:
        # the first failing call by position is raised, though process 0 may fail first
        for envs in (local, pool):
            with pytest.raises(EnvError, match=r"^environment reset on episode 1 \(data_source='b'\) raised "
                                               r"KeyError: 'no such key'") as err:
                envs.reset(_rows(4, resets={1: "raise", 2: "raise"}))
            assert isinstance(err.value.__cause__, KeyError)
        start = time.monotonic()
        with pytest.raises(EnvError, match=r"^environment reset on episode 2 \(data_source='a'\) did not return "
                                           r"within rollout\.agent\.timeout_s=1 s"):
            pool.reset(_rows(4, resets={2: "hang"}))
        assert time.monotonic() - start < 1.0 + 5.0 + 5.0  # + the processes' start (a raise closes the pool)
        pool.reset(_rows(3))
        with pytest.raises(EnvError, match=r"^environment step of turn 1 on episode 1 \(data_source='b'\) killed "
                                           r"its process \(exit code "):
            pool.step([0, 1, 2], ["a", "exit", "a"])
        assert [o.observation for o in pool.reset(_rows(2))] == ["e0:", "e1:"]  # usable after a raise
    finally:
        pool.close()


def test_a_bad_spec_fails_before_any_process_starts(tmp_path):
    syntax = tmp_path / "broken.py"
    syntax.write_text("class Env(:\n")
    env_file = os.path.join(TESTS, "agent_envs.py")
    for spec in ("no_colon", f"{tmp_path}/missing.py:Env", f"{syntax}:Env", f"{env_file}:Nope",
                 f"{env_file}:NotAnEnvironment", "no_such_module_xyz:Env"):
        for make in (lambda: EnvPool(spec, {}, 2, 5.0, "zero"), lambda: LocalEnvPool(spec, {}, "zero")):
            with pytest.raises(Exception, match=r"rollout\.agent\.env="):
                make()
    agent = SimpleNamespace(env=SPEC, env_kwargs={"scale": 2}, max_turns=4, num_workers=0, timeout_s=5.0,
                            on_error="zero")
    local = make_env_pool(OmegaConf.create(vars(agent)))  # as the trainer passes rollout.agent
    assert isinstance(local, LocalEnvPool) and type(local.env_kwargs) is dict
    local.reset(_rows(1))
    assert local.step([0], ["a"]) == [EnvOutcome("e0:1:a", 2.0, False, {"turns": 1})]
    assert isinstance(make_env_pool(SimpleNamespace(**{**vars(agent), "num_workers": 3}), 60.0), EnvPool)
    with pytest.raises(ValueError, match=r"rollout\.agent\.on_error='skip'"):
        make_env_pool(SimpleNamespace(**{**vars(agent), "on_error": "skip"}))
    with pytest.raises(ValueError, match=r"rollout\.agent\.timeout_s must be"):
        EnvPool(SPEC, {}, 2, 0.0, "zero")
    with pytest.raises(ValueError, match=r"rollout\.agent\.env is not set"):
        make_env_pool(SimpleNamespace(**{**vars(agent), "env": None}))
