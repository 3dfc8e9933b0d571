"""LoRA adapters on the policy (actor.lora, through peft).

Only the adapters train: the base weights are frozen, get no gradient and no optimizer state.
Everything outside the actor sees the policy as one model under the base model's parameter
names, with the adapters merged in (W + alpha / rank * B @ A): the rollout engines (HF's
load_state_dict, vLLM's load_weights), the weights gathered at the end of a run and an HF export.
A checkpoint holds the adapters only, as peft's adapter folder (adapter_model.safetensors +
adapter_config.json), so `PeftModel.from_pretrained(base, "<checkpoint>/actor")` loads it too.
"""

from __future__ import annotations

import re

import torch

ADAPTER_NAME = "default"  # peft's name for a model's one adapter
_PEFT_ROOT = "base_model.model."  # what peft puts in front of the base model's parameter names
# an adapter tensor, live (with the adapter's name) or as peft saves it (without)
_ADAPTER_TENSOR = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(?:\." + ADAPTER_NAME + r")?\.weight$")


def add_adapters(model: torch.nn.Module, lora, seed: int) -> torch.nn.Module:
    """`model` (a causal LM) with LoRA adapters on `lora.target_modules` and every base weight
    frozen (peft's get_peft_model); `lora` is the actor.lora config section.

    lora_A's random initialisation is drawn from `seed`, the same on every rank: FSDP2 keeps each
    rank's shard of the rank's own initial tensor, so ranks that drew differently would start
    from a mixture (and a dp=2 run from other adapters than a dp=1 run)."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    config = LoraConfig(r=int(lora.rank), lora_alpha=float(lora.alpha), lora_dropout=float(lora.dropout),
                        target_modules=list(lora.target_modules), bias="none", task_type="CAUSAL_LM")
    try:
        with torch.random.fork_rng(devices=[]):  # the adapters are created on the CPU
            torch.manual_seed(seed)
            peft_model = get_peft_model(model, config)
    except ValueError as err:  # peft: "Target modules {...} not found in the base model"
        raise ValueError(f"actor.lora.target_modules={list(lora.target_modules)}: {err}") from err
    for name, module in peft_model.named_modules():
        # the merge for the rollout (merge_adapters) is the one of a plain nn.Linear's weight
        if isinstance(module, LoraLayer) and (type(module) is not LoraLinear or module.fan_in_fan_out):
            raise ValueError(f"actor.lora.target_modules: {name.removeprefix(_PEFT_ROOT)} is not a linear layer "
                             f"({type(module.get_base_layer()).__name__}); LoRA here adapts nn.Linear layers only "
                             "(e.g. q_proj, v_proj, down_proj)")
    return peft_model


def scaling(alpha: float, rank: int) -> float:
    """The factor of B @ A in the merged weight: peft's lora_alpha / r (rslora is not used)."""
    return float(alpha) / int(rank)


def is_adapter_tensor(name: str) -> bool:
    return _ADAPTER_TENSOR.match(name) is not None


Adapters = dict[str, dict[str, torch.Tensor]]  # {base module name: {"A": lora_A, "B": lora_B}}


def split_adapters(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Adapters]:
    """A state dict of a peft model, live or as peft saves its adapters, as (the base model's
    tensors under the base model's names, the adapters)."""
    base: dict[str, torch.Tensor] = {}
    adapters: Adapters = {}
    for name, tensor in state.items():
        match = _ADAPTER_TENSOR.match(name)
        if match:
            module = match["module"].removeprefix(_PEFT_ROOT)
            adapters.setdefault(module, {})[match["which"]] = tensor
            continue
        # a layer with adapters keeps its own weight and bias under <layer>.base_layer
        base[name.removeprefix(_PEFT_ROOT).replace(".base_layer.", ".")] = tensor
    incomplete = sorted(module for module, pair in adapters.items() if set(pair) != {"A", "B"})
    if incomplete:
        raise ValueError(f"LoRA adapters without both lora_A and lora_B: {incomplete[:3]}")
    return base, adapters


def merge_adapters(base: dict[str, torch.Tensor], adapters: Adapters, factor: float) -> dict[str, torch.Tensor]:
    """The base weights with each adapter merged into its layer's weight: W + factor * (B @ A),
    computed as peft's merge is (in float32 for half-precision weights); `base` is not modified."""
    merged = dict(base)
    for module, pair in adapters.items():
        name = f"{module}.weight"
        if name not in merged:
            raise ValueError(f"LoRA adapter of {module}: the base model has no {name}")
        weight = merged[name]
        delta = (pair["B"].float() @ pair["A"].float()) * factor
        merged[name] = weight + delta.to(weight.dtype)
    return merged


def merged_weights(state: dict[str, torch.Tensor], factor: float) -> dict[str, torch.Tensor]:
    """The full state dict of a peft model as the merged base model's state dict ({} stays {}:
    FSDP2's ranks other than 0 hold no full state)."""
    return merge_adapters(*split_adapters(state), factor)


def saved_adapter_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors of a live peft model's state dict, named as peft saves them (the
    adapter's name left out): adapter_model.safetensors' keys."""
    saved = {}
    for name, tensor in state.items():
        match = _ADAPTER_TENSOR.match(name)
        if match:
            saved[f"{match['module']}.lora_{match['which']}.weight"] = tensor
    return saved


def live_adapter_names(saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of saved_adapter_names: the live model's names of saved adapter tensors."""
    live = {}
    for name, tensor in saved.items():
        match = _ADAPTER_TENSOR.match(name)
        if match is None:
            raise ValueError(f"{name} is not a LoRA adapter tensor (<module>.lora_A.weight / <module>.lora_B.weight)")
        live[f"{match['module']}.lora_{match['which']}.{ADAPTER_NAME}.weight"] = tensor
    return live


def adapter_config(peft_model: torch.nn.Module) -> dict:
    """The adapter's peft config as JSON-able data (adapter_config.json, as peft writes it)."""
    config = peft_model.peft_config[ADAPTER_NAME].to_dict()
    return {key: sorted(value) if isinstance(value, set) else value for key, value in config.items()}
