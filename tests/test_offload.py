"""workers/offload.py: a trainer's parameters, gradients and optimizer state leave memory and come
back bit for bit, on a single rank, under DDP and under FSDP2 (dp=2 on gloo, spawned processes).

Each scenario trains two identical copies of a small Qwen2 (loaded from safetensors, as the actor
loads its model): copy A is offloaded and reloaded between two optimizer steps, copy B is not, and
the two must end bitwise equal. While A is offloaded its storages are empty, the process's resident
memory has dropped by most of the bytes held, and the holding directory shows no file.
"""

from __future__ import annotations

import copy
import ctypes
import datetime
import json
import os
import resource
import signal
import traceback

import psutil
import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch.distributed.tensor import DTensor

from workers.offload import TrainerStateOffloader, _local, _state_tensors, trainer_state_bytes, trainer_storages

# 4.3M parameters: 17 MB of float32 weights, 69 MB with gradients and Adam's two moments
MODEL = dict(vocab_size=260, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
STRATEGIES = ("ddp", "ddp-bucket-view", "fsdp2")
MIN_RSS_FRACTION = 0.8  # of the bytes held; measured: 0.99 and more on every rank


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("offload_model"))
    Qwen2ForCausalLM(Qwen2Config(**MODEL)).save_pretrained(path)
    return path


# -- shared by the in-process and the spawned scenarios --------------------------------------------
def _load(model_dir: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)


def _wrap(model: torch.nn.Module, strategy: str) -> torch.nn.Module:
    """As workers/base.py wrap_for_training does."""
    if strategy.startswith("ddp"):  # with bucket views the gradients live in DDP's buckets
        return torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=strategy == "ddp-bucket-view")
    if strategy == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for module in model.modules():
            if type(module).__name__.endswith("DecoderLayer"):
                fully_shard(module)
        fully_shard(model)
    return model


def _optimizer(model: torch.nn.Module, name: str) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def _step(model, optimizer, ids: torch.Tensor) -> None:
    """One optimizer step; the gradients stay (no zero_grad after it)."""
    optimizer.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()


def _tensors(model, optimizer) -> list[torch.Tensor]:
    return [_local(tensor) for tensor in _state_tensors(model, optimizer)]


def _trim_heap() -> None:
    ctypes.CDLL(None).malloc_trim(0)


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _round_trip(model, optimizer, holding_dir: str, probe_ids: torch.Tensor) -> dict:
    """Offload and reload `model`'s state; check it was freed, then restored bitwise, in place."""
    with torch.no_grad():
        before = [tensor.clone() for tensor in _tensors(model, optimizer)]
    identities = [id(tensor) for tensor in _state_tensors(model, optimizer)]
    expected = trainer_state_bytes(model, optimizer)
    with torch.no_grad():  # FSDP2 leaves the root's parameters unsharded after it: offload reshards
        model(input_ids=probe_ids)
    offloader = TrainerStateOffloader(model, optimizer, holding_dir=holding_dir)
    _trim_heap()  # what was freed before (activations) must not count as dropped by the offload
    rss_before = _rss()
    held = offloader.offload()
    rss_offloaded = _rss()
    assert offloader.offloaded and held == offloader.held_bytes >= expected > 0
    assert all(tensor.untyped_storage().nbytes() == 0 for tensor in _tensors(model, optimizer))
    if isinstance(next(model.parameters()), DTensor):  # FSDP2: only the sharded parameters are registered
        assert all(isinstance(param, DTensor) for param in model.parameters())
    assert trainer_storages(model, optimizer) == []
    assert os.listdir(holding_dir) == []  # the holding file has no name
    dropped = rss_before - rss_offloaded
    assert dropped >= MIN_RSS_FRACTION * held, f"resident memory dropped {dropped} B, {held} B offloaded"
    offloader.reload()
    assert not offloader.offloaded and offloader.held_bytes == 0
    assert [id(tensor) for tensor in _state_tensors(model, optimizer)] == identities
    after = _tensors(model, optimizer)
    assert len(after) == len(before)
    for old, new in zip(before, after):
        assert old.dtype == new.dtype and old.shape == new.shape and torch.equal(old, new)
    assert os.listdir(holding_dir) == []
    return {"held_bytes": held, "rss_drop_bytes": dropped, "rss_before": rss_before,
            "param_bytes": sum(param.numel() * param.element_size() for param in model.parameters())}


def _scenario(rank: int, world_size: int, strategy: str, model_dir: str, work_dir: str,
              optimizer_name: str = "adamw", dtype: torch.dtype = torch.float32) -> dict:
    if world_size > 1:
        dist.init_process_group("gloo", init_method=f"file://{work_dir}/rendezvous", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=60))
    holding_dir = os.path.join(work_dir, f"holding-{rank}")
    os.makedirs(holding_dir)
    try:
        torch.manual_seed(1 + rank)
        first, second = (torch.randint(0, MODEL["vocab_size"], (2, 16)) for _ in range(2))
        offloaded = _wrap(_load(model_dir, dtype), strategy)
        plain = _wrap(_load(model_dir, dtype), strategy)
        optimizers = [_optimizer(offloaded, optimizer_name), _optimizer(plain, optimizer_name)]
        for model, optimizer in zip((offloaded, plain), optimizers):
            _step(model, optimizer, first)
        result = _round_trip(offloaded, optimizers[0], holding_dir, probe_ids=second)
        for model, optimizer in zip((offloaded, plain), optimizers):
            _step(model, optimizer, second)
        for a, b in zip(offloaded.parameters(), plain.parameters()):
            assert torch.equal(_local(a), _local(b))
        return result
    finally:
        if world_size > 1:
            dist.destroy_process_group()


SINGLE_RANK = {"adamw-float32": ("adamw", torch.float32), "sgd-bfloat16": ("sgd", torch.bfloat16)}


def _spawned_scenarios(rank: int, world_size: int, model_dir: str, work_dir: str) -> None:
    """Every scenario in one pair of fresh processes (starting one costs seconds; a fresh heap is
    what makes the resident-memory drop measurable: in the pytest process, earlier tests'
    allocations keep freed blocks from returning to the OS). Each process first runs one
    single-rank scenario alone (rank 0 of 1, no process group), then both run the dp=2 ones. Each
    rank writes its result, or its error, per scenario."""
    torch.set_num_threads(1)
    single = {name: (0, 1, "none", *spec) for name, spec in list(SINGLE_RANK.items())[rank::world_size]}
    dp2 = {strategy: (rank, world_size, strategy, "adamw", torch.float32) for strategy in STRATEGIES}
    for name, (scenario_rank, size, strategy, optimizer_name, dtype) in {**single, **dp2}.items():
        os.makedirs(os.path.join(work_dir, name), exist_ok=True)
        try:
            result = _scenario(scenario_rank, size, strategy, model_dir, os.path.join(work_dir, name), optimizer_name,
                               dtype)
        except BaseException:
            result = {"error": traceback.format_exc()}
        with open(os.path.join(work_dir, name, f"result-{scenario_rank}.json"), "w") as f:
            json.dump(result, f)


# -- the tests --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def spawned_dir(model_dir, tmp_path_factory):
    import torch.multiprocessing as mp

    assert len(SINGLE_RANK) == 2  # one per spawned process
    work_dir = tmp_path_factory.mktemp("offload_spawned")
    mp.spawn(_spawned_scenarios, args=(2, model_dir, str(work_dir)), nprocs=2, join=True)
    return work_dir


@pytest.fixture(scope="module")
def single_rank_results(spawned_dir) -> dict[str, dict]:
    return {name: json.loads((spawned_dir / name / "result-0.json").read_text()) for name in SINGLE_RANK}


@pytest.mark.parametrize("scenario", SINGLE_RANK)
def test_single_rank_round_trip(single_rank_results, scenario):
    result = single_rank_results[scenario]
    print(f"single rank {scenario}: {result}")
    assert "error" not in result, result.get("error")


@pytest.fixture(scope="module")
def dp2_results(spawned_dir) -> dict[str, list[dict]]:
    return {strategy: [json.loads((spawned_dir / strategy / f"result-{rank}.json").read_text()) for rank in range(2)]
            for strategy in STRATEGIES}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_dp2_round_trip(dp2_results, strategy):
    results = dp2_results[strategy]
    print(f"{strategy} dp=2: {results}")
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank}: {result.get('error')}"
        # weights, gradients, two Adam moments: all of them (DDP) or about half (FSDP2)
        share = 4 * result["param_bytes"] / (2 if strategy == "fsdp2" else 1)
        assert share <= result["held_bytes"] < share * 1.1


@pytest.fixture(scope="module")
def trained_once(model_dir):
    torch.manual_seed(0)
    model = _load(model_dir)
    optimizer = _optimizer(model, "adamw")
    _step(model, optimizer, torch.randint(0, MODEL["vocab_size"], (2, 16)))
    return model, optimizer


@pytest.fixture
def trained(trained_once):
    """A model and optimizer after one step, a copy per test (the tests offload and damage it)."""
    model, optimizer = copy.deepcopy(trained_once)
    with torch.no_grad():
        snapshot = [tensor.clone() for tensor in _tensors(model, optimizer)]
    return model, optimizer, snapshot


def _assert_intact(model, optimizer, snapshot) -> None:
    now = _tensors(model, optimizer)
    assert len(now) == len(snapshot) and all(torch.equal(a, b) for a, b in zip(snapshot, now))


def test_unusable_holding_dir_is_named_and_changes_nothing(trained, tmp_path):
    model, optimizer, snapshot = trained
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("")
    for where in (tmp_path / "missing", not_a_dir):
        offloader = TrainerStateOffloader(model, optimizer, holding_dir=str(where))
        with pytest.raises(OSError, match=f"holding_dir '{where}'"):
            offloader.offload()
        assert not offloader.offloaded
        _assert_intact(model, optimizer, snapshot)
    assert sorted(os.listdir(tmp_path)) == ["a-file"]


def test_disk_full_midway_frees_nothing_and_leaves_no_file(trained, tmp_path):
    """The file may grow to 1 MB only (RLIMIT_FSIZE): the write fails after a few storages."""
    model, optimizer, snapshot = trained
    offloader = TrainerStateOffloader(model, optimizer, holding_dir=str(tmp_path))
    fds = psutil.Process().num_fds()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, hard))
    try:
        with pytest.raises(OSError, match="nothing was offloaded") as info:
            offloader.offload()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous_handler)
    assert "File too large" in str(info.value)
    assert not offloader.offloaded and psutil.Process().num_fds() == fds  # the file is closed
    assert os.listdir(tmp_path) == []
    _assert_intact(model, optimizer, snapshot)
    offloader.offload()  # with room, it works
    offloader.reload()
    _assert_intact(model, optimizer, snapshot)


def test_a_damaged_holding_file_fails_the_reload_cleanly(trained, tmp_path):
    """A reload that fails partway (here: the file lost its tail) leaves no half-restored state:
    every storage is empty again, the state still counts as offloaded, and the error names the
    directory."""
    model, optimizer, _ = trained
    offloader = TrainerStateOffloader(model, optimizer, holding_dir=str(tmp_path))
    held = offloader.offload()
    os.ftruncate(offloader._file.fileno(), held // 2)
    with pytest.raises(OSError, match=f"holding file under '{tmp_path}' ended early"):
        offloader.reload()
    assert offloader.offloaded and offloader.held_bytes == held
    assert trainer_storages(model, optimizer) == []
    assert os.listdir(tmp_path) == []


def test_offload_twice_is_refused_and_reload_without_offload_does_nothing(trained, tmp_path):
    model, optimizer, snapshot = trained
    offloader = TrainerStateOffloader(model, optimizer, holding_dir=str(tmp_path))
    offloader.reload()
    offloader.offload()
    with pytest.raises(RuntimeError, match="already offloaded"):
        offloader.offload()
    offloader.reload()
    _assert_intact(model, optimizer, snapshot)


# -- rollout engines: sleep / wake_up (workers/rollout/engine.py) ----------------------------------
def _prompts(model_dir: str) -> tuple[TensorDict, dict]:
    """Two prompts, and the token ids an engine needs."""
    from transformers import AutoTokenizer

    from rlflow.protocol import left_pad

    tok = AutoTokenizer.from_pretrained(model_dir)
    input_ids, mask = left_pad([tok.encode(text, add_special_tokens=False) for text in ("1+2=", "abc")],
                               tok.pad_token_id)
    batch = TensorDict({"input_ids": input_ids, "attention_mask": mask}, batch_size=[2])
    return batch, {"pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id}


def _sleep_round_trip(call, get, batch: TensorDict) -> None:
    """Generate, sleep (generating and loading weights are refused), wake up: the same samples.
    `call(method, ...)` and `get(attribute)` reach the engine, here or in its Ray actor."""
    before = call("generate", batch, n=2, do_sample=True, seed=7, return_log_probs=True)
    call("sleep")
    call("sleep")  # twice is once
    assert get("sleeping")
    with pytest.raises(RuntimeError, match="generate while asleep"):
        call("generate", batch, n=1, do_sample=False)
    with pytest.raises(RuntimeError, match="load_weights while asleep"):
        call("load_weights", {})
    call("wake_up")
    call("wake_up")
    assert not get("sleeping")
    after = call("generate", batch, n=2, do_sample=True, seed=7, return_log_probs=True)
    assert torch.equal(before["responses"], after["responses"])
    assert torch.equal(before["rollout_log_probs"], after["rollout_log_probs"])


def test_hf_engine_sleeps_and_wakes(tiny_model_dir):
    from workers.rollout.hf import HFRollout

    batch, ids = _prompts(tiny_model_dir)
    engine = HFRollout(tiny_model_dir, max_prompt_length=8, max_response_length=4, seed=3, **ids)
    _sleep_round_trip(lambda name, *a, **k: getattr(engine, name)(*a, **k), lambda name: getattr(engine, name), batch)
    assert engine.frees_memory_when_sleeping == (engine.device.type != "cpu")  # on CPU: nowhere better


# ------------------------------------------------------------------ in a run: <role>.offload


FIT = {"actor.ppo_micro_batch_size_per_gpu": 2, "trainer.total_steps": 2, "trainer.save_freq": 1,
       "trainer.memory_metrics": True}
OFFLOADED = {"actor.offload": True, "rollout.sleep": True}  # the critic inherits actor.offload
PHASES = ("gen", "forward", "update", "sync")


@pytest.fixture(scope="module")
def fits(ray_session, tmp_path_factory):
    """PPO with a critic at dp=1 (FSDP2 at dp=2 is the spawned round trip above), deterministic, a
    checkpoint after each step: resident, offloaded (trainers offloaded, rollout asleep between
    calls), and offloaded resumed from the offloaded run's step-1 checkpoint (whose optimizer
    state arrives through Ray, in buffers that cannot be resized: the offloader copies them)."""
    from exactness_helpers import build_varied_length_model, run_fit

    from controllers.worker_group import IDLE_WORKERS

    model_dir = build_varied_length_model(str(tmp_path_factory.mktemp("offload_model")))
    runs, dirs = {}, {}
    for name, overrides in (("resident", FIT), ("offloaded", {**FIT, **OFFLOADED})):
        # the memory compared is resident memory, which depends on what a process ran before (freed
        # tensors stay in the allocator's heap): each measured run starts on new processes
        IDLE_WORKERS.stop()
        dirs[name] = str(tmp_path_factory.mktemp(f"offload_{name}"))
        runs[name] = run_fit(model_dir, dirs[name], **overrides)
    step1 = os.path.join(dirs["offloaded"], "rlflow", "default", "checkpoints", "step_1")
    runs["resumed"] = run_fit(model_dir, str(tmp_path_factory.mktemp("offload_resumed")),
                              **{**FIT, **OFFLOADED, "trainer.resume_mode": step1})
    return runs


def test_an_offloaded_run_equals_a_resident_one_bitwise(fits):
    """Offloading between calls (and saving checkpoints while offloaded) changes nothing: the same
    weights, gradients and metrics, bit for bit; so does resuming an offloaded run."""
    from exactness_helpers import compare_fits

    for other in ("offloaded", "resumed"):
        diff = compare_fits(fits["resident"], fits[other], bitwise=True)
        assert not diff.failures, (other, diff.failures[:10])
        assert diff.num_probes > 0


def test_offloading_lowers_the_trainers_memory_outside_their_phases(fits):
    """trainer.memory_metrics: each phase's peak resident memory per role. While the rollout
    generates, an offloaded actor rank holds less than a resident one by most of its share of the
    parameters, gradients and Adam moments (16 bytes per parameter)."""
    steps = {name: fits[name].steps() for name in ("resident", "offloaded")}
    for name, history in steps.items():
        for phase in PHASES:
            for role in ("actor", "critic", "rollout", "all_workers"):
                assert all(h[f"memory/{phase}/{role}_gb"] > 0.1 for h in history), (name, phase, role)
    num_params = sum(t.numel() for t in fits["resident"].initial["actor"].values())
    state_gb = 16 * num_params / 2**30
    last = {name: history[-1] for name, history in steps.items()}
    for role in ("actor", "critic"):
        saved = last["resident"][f"memory/gen/{role}_gb"] - last["offloaded"][f"memory/gen/{role}_gb"]
        print(f"{role}: gen-phase peak {last['resident'][f'memory/gen/{role}_gb']:.3f} GB resident, "
              f"{last['offloaded'][f'memory/gen/{role}_gb']:.3f} GB offloaded (state {state_gb:.3f} GB)")
        assert saved > 0.5 * state_gb
