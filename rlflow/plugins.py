"""User code that extends rlflow: the modules of `trainer.imports`, and the rollout engines' names.

`trainer.imports` lists modules that register losses, estimators, engines, ... (`@register_*`).
`import_modules` imports them on the driver (before the config is validated: rlflow.config) and in
every role's worker process (workers/base.py, before the worker builds anything), so a name
registered there can be used in the config from the CLI and reaches the processes that build the
pieces. (The reward and environment pools' processes load their own files, reward.custom_function
and rollout.agent.env, and read no registry.) An entry ending in `.py` is a file (made absolute on
the driver, so it must exist at that path on every node); anything else is a dotted module name,
imported with the current directory on sys.path (Ray's workers have the driver's) or installed.

`load_file` runs a Python file given by path as a module: the one loader behind trainer.imports,
reward.custom_function.path and rollout.agent.env.

ENGINE_MODULES is validation's view of the engine registry (workers/rollout/engine.py), which
rlflow cannot import (layers: controllers -> workers -> rlflow): the built-in engines' names, and
each `@register_engine` adds its own. Standard library only, so anything may import it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from types import ModuleType

IMPORTS_KEY = "trainer.imports"
_IMPORTS_PREFIX = "rlflow_imports_"  # the module names of its files (load_file)

# {engine name: the module that registers it}; the built-ins are imported on first use (vllm is optional)
ENGINE_MODULES: dict[str, str] = {"hf": "workers.rollout.hf", "vllm": "workers.rollout.vllm"}

# the files load_file(once=True) ran in this process, by (prefix, absolute path)
_FILES: dict[tuple[str, str], ModuleType] = {}


def is_file_spec(spec: str) -> bool:
    return str(spec).endswith(".py")


def absolute_specs(specs) -> list[str]:
    """File entries made absolute (the workers' working directory is not the driver's)."""
    return [os.path.abspath(s) if is_file_spec(s) else str(s) for s in specs or ()]


def import_modules(specs) -> list[ModuleType]:
    """Import each entry of trainer.imports once per process; an ImportError names the key and entry."""
    return [_import_file(s) if is_file_spec(s) else _import_dotted(s) for s in specs or ()]


def _import_dotted(name: str) -> ModuleType:
    if not name or name.startswith(".") or not all(part.isidentifier() for part in name.split(".")):
        raise ImportError(f"{IMPORTS_KEY}: {name!r} is neither a file.py nor a dotted module name")
    if name in sys.modules:
        return sys.modules[name]
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:  # `rlflow` (a console script) runs without it
        sys.path.append(cwd)
    try:
        return importlib.import_module(name)
    except Exception as err:
        raise ImportError(f"{IMPORTS_KEY}: cannot import {name!r}: {type(err).__name__}: {err}") from err


def _import_file(path: str) -> ModuleType:
    path = os.path.abspath(path)
    if (_IMPORTS_PREFIX, path) not in _FILES and not os.path.isfile(path):
        raise ImportError(f"{IMPORTS_KEY}: no file {path}")
    try:
        return load_file(path, _IMPORTS_PREFIX, once=True)
    except Exception as err:
        raise ImportError(f"{IMPORTS_KEY}: {path} failed to import: {type(err).__name__}: {err}") from err


class NotAPythonFile(ImportError):
    """`load_file` was given a file Python cannot import as a module (not a .py file)."""


def load_file(path: str | os.PathLike, prefix: str, once: bool) -> ModuleType:
    """The Python file at `path` run as a new module named `prefix` + a hash of its absolute path:
    the one loader of user files by path (trainer.imports, reward.custom_function.path,
    rollout.agent.env). It is in sys.modules only while it runs (dataclasses defined there need
    that); left out afterwards, so cloudpickle ships what the file defines by value to processes
    that cannot import it by that name. once=True: the first successful run's module is returned by
    every later call in this process (a file that registers names must not register twice);
    False: the file runs again on every call. What the file raises propagates unchanged: callers
    name their config key in the error."""
    path = os.fspath(path)
    absolute = os.path.abspath(path)
    if once and (prefix, absolute) in _FILES:
        return _FILES[prefix, absolute]
    name = prefix + hashlib.sha1(absolute.encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise NotAPythonFile(f"cannot import {path} as a python module (is it a .py file?)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(name, None)
    if once:
        _FILES[prefix, absolute] = module
    return module


def load_named(spec: str, key: str, kind: str, prefix: str):
    """What `key`=`spec` names: `path/to/file.py:Name` (the file run once per process, load_file
    with `prefix`) or `package.module:Name`. `kind` ("Class", "function") is the word the errors
    use for Name; every error names `key`."""
    module_name, sep, name = str(spec).rpartition(":")
    if not sep or not module_name or not name:
        raise ValueError(f"{key}={spec!r}: expected 'file.py:{kind}' or 'package.module:{kind}'")
    if module_name.endswith(".py"):
        path = os.path.abspath(module_name)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{key}={spec!r}: no file {path}")
        try:  # once per process: every later call returns the same object
            module = load_file(path, prefix, once=True)
        except Exception as err:
            raise ImportError(f"{key}={spec!r}: {path} failed to load: {type(err).__name__}: {err}") from err
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise ImportError(f"{key}={spec!r}: cannot import {module_name}: {err}") from err
    value = getattr(module, name, None)
    if value is None:
        raise AttributeError(f"{key}={spec!r}: {module_name} has no {name}")
    return value
