"""The reward pool (rlflow/rewards/pool.py): reward functions in Ray processes, a timeout per
sample, a process that dies or hangs stopped and replaced while the driver carries on, and scores
equal to the serial RewardManager's. Real Ray (the session's), real reward files."""

from __future__ import annotations

import math
import os
import textwrap
import time

import pytest

from conftest import tiny_overrides
from rlflow.config import ConfigError, load_config, to_dataclass
from rlflow.rewards import RewardError, RewardManager, load_custom_reward_fn

# one file, one behaviour per response text; the rest is an exact-match reward with extras
REWARD = textwrap.dedent('''
    import asyncio
    import os
    import re
    import time

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "hang":
            while True:
                time.sleep(1)
        if solution_str == "gil":  # catastrophic backtracking: one C call that holds the GIL
            return float(re.match(r"(a+)+$", "a" * 64 + "b") is not None)
        if solution_str.startswith("slow"):
            time.sleep(float(solution_str[4:]))
            return 1.0
        if solution_str == "exit":
            os._exit(3)
        if solution_str == "raise":
            raise KeyError("no such key")
        if solution_str == "nan":
            return float("nan")
        if solution_str.startswith("d"):  # a dict: the score, a numeric extra, a string (not reported)
            return {"score": len(solution_str) / 4, "acc": float(solution_str == ground_truth), "pred": solution_str}
        return float(solution_str == ground_truth) - 0.25 * (data_source == "b")

    def where(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": 0.0, "pid": os.getpid()}

    async def async_score(data_source, solution_str, ground_truth, extra_info=None):
        await asyncio.sleep(0.01)
        return {"score": float(solution_str == ground_truth), "acc": float(len(solution_str) > 1)}
''')

MIXED = ["x", "dx", "y", "raise", "nan", "dxyz", "x", "z", "dy", "x"] * 5


@pytest.fixture
def reward_file(tmp_path) -> str:
    path = tmp_path / "reward.py"
    path.write_text(REWARD)
    return str(path)


def _batch(texts: list[str]):
    return texts, [("a", "b")[i % 2] for i in range(len(texts))], ["x" if i % 3 else "dx" for i in range(len(texts))]


def _serial(reward_file, texts, zeroed=()):
    """The serial RewardManager's result for texts, with the samples in zeroed scored 0 and counted."""
    scores, extras, _ = RewardManager(load_custom_reward_fn(reward_file)).score_batch(
        *_batch(["x" if i in zeroed else t for i, t in enumerate(texts)]))
    zero = lambda values: [0.0 if i in zeroed else v for i, v in enumerate(values)]  # noqa: E731
    return zero(scores), {k: zero(v) for k, v in extras.items()}, len(zeroed)


def _pool(path, **kwargs):
    from rlflow.rewards.pool import RewardPool

    return RewardPool(path, **{"num_workers": 2, "timeout_s": 2.0, "on_error": "zero", **kwargs})


def _pool_pids() -> set[int]:
    """The processes of the pool actors alive in this session's Ray."""
    from ray._private.state import actors

    return {info.get("Pid") for info in actors().values()
            if info.get("ActorClassName", "").endswith("RewardWorker") and info.get("State") != "DEAD"}


def test_scores_equal_the_serial_run(ray_session, reward_file):
    serial = RewardManager(load_custom_reward_fn(reward_file), on_error="zero")
    pool = _pool(reward_file)
    try:
        for texts in (MIXED, MIXED[:7], ["x"]):  # the first batch starts the processes
            expected = serial.score_batch(*_batch(texts), [None] * len(texts))
            assert pool.score_batch(*_batch(texts), [None] * len(texts)) == expected
        scores, extras, errors = pool.score_batch(*_batch(MIXED))
        assert errors == 10 and set(extras) == {"acc"} and scores[:2] == [0.0, 0.5] and scores[5] == 1.0
        assert math.isnan(extras["acc"][0]) and extras["acc"][1] == 0.0 and extras["acc"][3] == 0.0  # a number; "dx"; zeroed
        # the functions ran in the pool's processes, not in the driver
        where = _pool(reward_file, name="where")
        try:
            _, extras, _ = where.score_batch(*_batch(["x"] * 16))
            pids = {int(p) for p in extras["pid"]}
            assert os.getpid() not in pids and pids <= _pool_pids()
        finally:
            where.close()
    finally:
        pool.close()
    # under on_error=raise both raise the first error, naming the sample
    for manager in (RewardManager(load_custom_reward_fn(reward_file)), _pool(reward_file, on_error="raise")):
        try:
            with pytest.raises(RewardError, match=r"failed on sample 3 \(data_source='b'\): KeyError") as err:
                manager.score_batch(*_batch(MIXED))
            assert isinstance(err.value.__cause__, KeyError)
        finally:
            manager.close()


def test_async_reward_function(ray_session, reward_file):
    texts = ["x", "xy", "x", "q"] * 4
    expected = ([1.0 if t == "x" else 0.0 for t in texts], {"acc": [float(len(t) > 1) for t in texts]}, 0)
    truths = ["x"] * len(texts)
    assert RewardManager(load_custom_reward_fn(reward_file, "async_score")).score_batch(texts, ["d"] * 16, truths) == expected
    pool = _pool(reward_file, name="async_score")
    try:
        assert pool.score_batch(texts, ["d"] * 16, truths) == expected
    finally:
        pool.close()


def test_a_hung_sample_is_stopped_after_timeout_s_and_the_batch_goes_on(ray_session, reward_file):
    pool = _pool(reward_file)
    try:
        pool.score_batch(*_batch(["x"] * 6))  # processes started, a chunk size measured
        timings = []
        for texts, hung in ((["x", "hang", "x", "dx", "y", "x"], [1]),
                            (["x", "hang", "hang", "x", "dx", "x"], [1, 2])):
            start = time.monotonic()
            result = pool.score_batch(*_batch(texts))
            elapsed = time.monotonic() - start
            timings.append(elapsed / len(hung))
            assert result == _serial(reward_file, texts, zeroed=hung)
            # stopped once its 2 s were up, plus the overhead: poll (<= 0.1 s), kill and a new process
            assert elapsed < len(hung) * (2.0 + 5.0), elapsed
            assert elapsed >= 2.0  # and not before
        print(f"\nseconds per hung sample (timeout_s=2): {', '.join(f'{t:.2f}' for t in timings)}")
        # the killed processes were replaced: the pool still scores, with as many processes
        assert pool.score_batch(*_batch(["x", "dx", "y"])) == _serial(reward_file, ["x", "dx", "y"])
        assert pool.num_replaced == 3 and len(pool.slots) == 2
    finally:
        pool.close()


def test_the_clock_is_per_sample_not_per_chunk(ray_session, reward_file):
    """Two 1.2 s samples in one chunk take 2.4 s together: more than timeout_s=2, but each is within it."""
    pool = _pool(reward_file, num_workers=1)
    try:
        assert pool.score_batch(["slow1.2", "slow1.2", "slow1.2"], ["d"] * 3, ["x"] * 3) == ([1.0] * 3, {}, 0)
        assert pool.num_replaced == 0
    finally:
        pool.close()


def test_a_hang_under_raise_names_the_sample_the_source_and_the_timeout(ray_session, reward_file):
    pool = _pool(reward_file, on_error="raise")
    try:
        start = time.monotonic()
        with pytest.raises(RewardError, match=r"did not return within reward\.timeout_s=2 s on sample 3 "
                                              r"\(data_source='b'\) and was stopped"):
            pool.score_batch(*_batch(["x", "y", "x", "hang", "x", "hang"]))
        assert time.monotonic() - start < 2.0 + 5.0 + 10.0  # + the processes' start
        assert pool.score_batch(*_batch(["x", "x"])) == _serial(reward_file, ["x", "x"])
    finally:
        pool.close()


def test_a_hang_that_holds_the_gil_is_found_by_a_rerun(ray_session, reward_file):
    """The process cannot even say which sample it is on: the chunk's samples are rerun one per call."""
    pool = _pool(reward_file, num_workers=1)
    try:
        texts = ["x", "gil", "y", "dx"]  # the first batch goes in chunks of 2: [x, gil], [y, dx]
        start = time.monotonic()
        assert pool.score_batch(*_batch(texts)) == _serial(reward_file, texts, zeroed=[1])
        elapsed = time.monotonic() - start
        assert pool.num_replaced == 2  # killed unnamed in its chunk, then named when alone
        assert elapsed < 2 * (2.0 + 5.0), elapsed  # its timeout twice (+ the first process's start)
        print(f"\na GIL-holding hang took {elapsed:.2f} s (timeout_s=2)")
    finally:
        pool.close()


def test_a_reward_that_kills_its_process(ray_session, reward_file):
    pool = _pool(reward_file)
    try:
        texts = ["x", "dx", "y", "exit", "x", "dxy", "x", "z"]
        assert pool.score_batch(*_batch(texts)) == _serial(reward_file, texts, zeroed=[3])
        # the driver is up, and the dead process was replaced: the pool scores on
        assert pool.num_replaced >= 1 and len(pool.slots) == 2
        assert pool.score_batch(*_batch(["x", "y", "dx"])) == _serial(reward_file, ["x", "y", "dx"])
    finally:
        pool.close()
    pool = _pool(reward_file, on_error="raise")
    try:
        with pytest.raises(RewardError, match=r"the reward process died on sample 2 \(data_source='a'\): exit code"):
            pool.score_batch(*_batch(["x", "y", "exit", "x"]))
    finally:
        pool.close()


def test_a_reward_file_that_does_not_load(ray_session, tmp_path):
    syntax = tmp_path / "syntax.py"
    syntax.write_text("def compute_score(:\n")
    other = tmp_path / "other.py"
    other.write_text("def score_fn(*args):\n    return 1.0\n")
    cases = [(tmp_path / "missing.py", "compute_score"), (syntax, "compute_score"), (other, "compute_score")]
    for path, name in cases:
        with pytest.raises(Exception) as in_driver:
            load_custom_reward_fn(path, name)
        pool = _pool(path, name=name)
        try:
            with pytest.raises(type(in_driver.value)) as in_pool:
                pool.score_batch(["x"], ["d"], ["x"])
            assert str(in_pool.value) == str(in_driver.value)  # the same error, naming the file
        finally:
            pool.close()


def test_config_keys_and_the_trainer_setup(tmp_path, reward_file):
    from controllers.setup import make_reward_manager
    from rlflow.rewards.pool import RewardPool

    cfg = load_config(None)
    assert (cfg.reward.num_workers, cfg.reward.timeout_s) == (2, 30.0)
    for override, key in (("reward.num_workers=-1", r"reward\.num_workers must be >= 0"),
                          ("reward.timeout_s=0", r"reward\.timeout_s must be"),
                          ("reward.timeout_s=-3", r"reward\.timeout_s must be"),
                          ("reward.timeout_s=inf", r"reward\.timeout_s must be")):
        with pytest.raises(ConfigError, match=key):
            load_config(None, [override])
    manager = make_reward_manager(to_dataclass(load_config(None, [f"reward.custom_function.path={reward_file}",
                                                                  "reward.timeout_s=5"])))
    assert isinstance(manager, RewardPool) and manager.timeout_s == 5.0
    assert manager.slots == []  # the processes start with the first batch
    manager = make_reward_manager(to_dataclass(load_config(None, ["reward.num_workers=0"])))
    assert type(manager) is RewardManager  # in the driver, as before
    # a file that does not load stops the setup before anything starts, with the driver's error
    with pytest.raises(FileNotFoundError, match="nope.py"):
        make_reward_manager(to_dataclass(load_config(None, [f"reward.custom_function.path={tmp_path / 'nope.py'}"])))


E2E_REWARD = '''
import os
import time

MARKERS = {markers!r}


def _role(index):
    """The first prompt this run's reward sees hangs, the second kills its process, on every call
    (a rerun too): the marker files hold their indices."""
    for role in ("hang", "exit"):
        path = os.path.join(MARKERS, role)
        if not os.path.exists(path):
            mine = f"{{path}}.{{os.getpid()}}"
            with open(mine, "w") as f:
                f.write(str(index))
            try:
                os.link(mine, path)  # the first to claim it wins
            except FileExistsError:
                pass
            os.unlink(mine)
        with open(path) as f:
            if int(f.read()) == index:
                return role
    return None


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    role = _role(extra_info["index"])
    if role == "hang":
        while True:
            time.sleep(1)
    if role == "exit":
        os._exit(3)
    return (sum(map(ord, solution_str)) % 7) / 3.0 - 1.0
'''


def test_fit_with_a_hanging_and_a_crashing_reward(ray_session, tiny_model_dir, tmp_path):
    from reliability.runs import assert_no_new_workers, live_workers
    from rlflow import RLFlow

    markers = tmp_path / "markers"
    markers.mkdir()
    reward = tmp_path / "reward.py"
    reward.write_text(E2E_REWARD.format(markers=str(markers)))
    cfg = load_config(None, tiny_overrides(tiny_model_dir, **{
        "algorithm.adv_estimator": "grpo", "reward.custom_function.path": str(reward), "reward.on_error": "zero",
        "reward.timeout_s": 2, "reward.num_workers": 2, "trainer.default_local_dir": str(tmp_path)}))
    before = live_workers()
    start = time.monotonic()
    history = RLFlow(cfg).fit()
    print(f"\nfit with 2 hung and 2 crashing samples (timeout_s=2): {time.monotonic() - start:.1f} s; "
          f"step timing/reward {[round(h['timing/reward'], 2) for h in history]}")
    assert [h["step"] for h in history] == [1, 2]
    # both samples (rollout.n=2) of the first prompt hung, both of the second killed their process
    assert history[0]["reward/num_errors"] == 4 and "reward/num_errors" not in history[1]
    assert sorted(os.listdir(markers)) == ["exit", "hang"]
    assert_no_new_workers(before)  # the pool's processes, like the trainer's, are gone
    assert not _pool_pids()
