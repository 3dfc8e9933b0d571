"""Experiment trackers: console progress, metrics.jsonl, TensorBoard, wandb (offline), MLflow (local).

    trackers = make_trackers(["console", "jsonl"], run_dir, total_steps=100,
                             project="rlflow", experiment="gsm8k-ppo", config=cfg_dict)
    trackers.log({"critic/score/mean": 0.3, "actor/pg_loss": -0.01}, step=1)
    trackers.close()

Nothing here contacts a server: wandb runs in offline mode (``wandb sync <dir>`` uploads later),
MLflow writes a local file store under ``run_dir/mlruns`` (``mlflow ui --backend-store-uri
<run_dir>/mlruns`` shows it, with the full ``mlflow`` package installed). tensorboard, wandb and
MLflow's tracking client (mlflow-skinny) come with ``pip install 'rlflow[loggers]'``; console and
jsonl need nothing extra.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging as _pylogging
import math
import numbers
import os
import sys
import time
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "Tracker",
    "ConsoleTracker",
    "JsonlTracker",
    "TensorBoardTracker",
    "WandbTracker",
    "MlflowTracker",
    "MultiTracker",
    "make_trackers",
    "TRACKERS",
    "sanitize_metrics",
    "flatten_config",
]

logger = _pylogging.getLogger(__name__)

PIP_EXTRA = "pip install 'rlflow[loggers]'"


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _to_float(v: Any) -> float | None:
    if isinstance(v, numbers.Real):
        return float(v)
    if hasattr(v, "item") and getattr(v, "shape", None) in ((), (1,)):
        try:
            x = v.item()
        except Exception:
            return None
        return float(x) if isinstance(x, numbers.Real) else None
    return None


def sanitize_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """{name: float}; python/numpy/torch scalars are converted, anything else is dropped."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        f = _to_float(v)
        if f is not None:
            out[str(k)] = f
    return out


def _config_dict(config: Any) -> dict:
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return dict(config)
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    if "omegaconf" in sys.modules:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(config, DictConfig):
            return OmegaConf.to_container(config, resolve=True)
    return {"config": str(config)}


def flatten_config(config: Any, prefix: str = "", sep: str = ".") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1} (lists are kept as values)."""
    out: dict[str, Any] = {}
    for k, v in _config_dict(config).items():
        key = f"{prefix}{sep}{k}" if prefix else str(k)
        if isinstance(v, Mapping) or (dataclasses.is_dataclass(v) and not isinstance(v, type)):
            out.update(flatten_config(v, key, sep))
        else:
            out[key] = v
    return out


def _json_default(o):
    try:
        return str(o)
    except Exception:
        return repr(o)


# --------------------------------------------------------------------------------------------
# trackers
# --------------------------------------------------------------------------------------------


class Tracker:
    """Base class: ``log(metrics, step)`` once per step, ``close()`` once at the end."""

    name = "base"

    def log(self, metrics: Mapping[str, float], step: int) -> None:  # pragma: no cover
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


#: substrings of the metric names the console line shows by default (in this order)
CONSOLE_PATTERNS = (
    "score", "reward", "acc", "loss", "kl", "entropy", "clipfrac", "grad_norm",
    "response_length", "timing",
)
#: candidates for the progress bar's reward postfix, first match wins
REWARD_KEYS = (
    "critic/score/mean", "critic/rewards/mean", "reward/mean", "reward_mean", "score/mean",
    "reward", "score",
)


class ConsoleTracker(Tracker):
    """A tqdm progress bar over ``total_steps`` (ETA; postfix = reward mean) and a compact line
    of selected metrics every ``print_every`` steps.

    ``keys``: the metric names to print (default: up to ``max_keys`` names containing one of
    CONSOLE_PATTERNS, leaving out /min, /max and /std variants). ``progress_bar=None`` shows the
    bar in a terminal or notebook (tqdm.auto) and hides it when stderr is not a terminal.
    """

    name = "console"

    def __init__(
        self,
        total_steps: int | None = None,
        keys: Iterable[str] | None = None,
        print_every: int = 1,
        reward_key: str | None = None,
        max_keys: int = 10,
        progress_bar: bool | None = None,
        initial_step: int = 0,
        file=None,
    ):
        from tqdm.auto import tqdm

        self.total_steps = total_steps
        self.keys = list(keys) if keys is not None else None
        self.print_every = max(1, int(print_every))
        self.reward_key = reward_key
        self.max_keys = max_keys
        self.file = file
        disable = None if progress_bar is None else not progress_bar
        self.bar = tqdm(
            total=total_steps, initial=initial_step, desc="rlflow", unit="step",
            dynamic_ncols=True, disable=disable, file=file if file is not None else sys.stderr,
        )
        self._last_time = time.perf_counter()
        self._closed = False

    def _select(self, metrics: Mapping[str, float]) -> list[str]:
        if self.keys is not None:
            return [k for k in self.keys if k in metrics]
        chosen: list[str] = []
        for pat in CONSOLE_PATTERNS:
            for k in metrics:
                if pat in k and k not in chosen and not k.endswith(("/min", "/max", "/std")):
                    chosen.append(k)
        return chosen[: self.max_keys]

    def _reward(self, metrics: Mapping[str, float]) -> tuple[str, float] | None:
        if self.reward_key is not None:
            return (self.reward_key, metrics[self.reward_key]) if self.reward_key in metrics else None
        for k in REWARD_KEYS:
            if k in metrics:
                return k, metrics[k]
        for k, v in metrics.items():
            if ("reward" in k or "score" in k) and k.endswith("mean"):
                return k, v
        return None

    def format_line(self, metrics: Mapping[str, float], step: int) -> str:
        total = f"/{self.total_steps}" if self.total_steps else ""
        parts = [f"step {step}{total}"]
        parts += [f"{k} {metrics[k]:.4g}" for k in self._select(metrics)]
        return " | ".join(parts)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        metrics = sanitize_metrics(metrics)
        if step > self.bar.n:
            self.bar.update(step - self.bar.n)
        r = self._reward(metrics)
        if r is not None:
            self.bar.set_postfix({"reward": f"{r[1]:.4g}"}, refresh=True)
        if step % self.print_every == 0 or (self.total_steps and step >= self.total_steps):
            line = self.format_line(metrics, step)
            if self.bar.disable:
                print(line, file=self.file if self.file is not None else sys.stdout, flush=True)
            else:
                self.bar.write(line, file=self.file)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.bar.close()


class JsonlTracker(Tracker):
    """``run_dir/metrics.jsonl``: one JSON object per ``log`` call, {"step": step, **metrics},
    flushed each time; appended to (a resumed run continues the same file). Non-finite values
    are written as null (strict JSON)."""

    name = "jsonl"
    FILENAME = "metrics.jsonl"

    def __init__(self, run_dir: str | os.PathLike):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(os.fspath(run_dir), self.FILENAME)
        self._f = open(self.path, "a", encoding="utf-8")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        rec: dict[str, Any] = {"step": int(step)}
        for k, v in sanitize_metrics(metrics).items():
            if k == "step":
                continue
            rec[k] = v if math.isfinite(v) else None
        self._f.write(json.dumps(rec, allow_nan=False) + "\n")
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


class TensorBoardTracker(Tracker):
    """Scalars into ``run_dir/tensorboard`` (torch.utils.tensorboard.SummaryWriter); the config
    as a text summary. ``tensorboard --logdir <run_dir>/tensorboard`` shows it."""

    name = "tensorboard"

    def __init__(self, run_dir: str | os.PathLike, config: Any = None):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = os.path.join(os.fspath(run_dir), "tensorboard")
        self.writer = SummaryWriter(log_dir=self.log_dir)
        cfg = _config_dict(config)
        if cfg:
            text = json.dumps(cfg, indent=2, default=_json_default)
            # indented = a code block in TensorBoard's markdown text view
            self.writer.add_text("config", "\n".join("    " + ln for ln in text.splitlines()), 0)
        self._closed = False

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for k, v in sanitize_metrics(metrics).items():
            self.writer.add_scalar(k, v, global_step=int(step))
        self.writer.flush()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.writer.close()


class WandbTracker(Tracker):
    """wandb in offline mode (``WANDB_MODE=offline`` is set for the process): the run is written
    under ``run_dir/wandb/offline-run-*`` and nothing is sent; upload later with
    ``wandb sync <that dir>``."""

    name = "wandb"

    def __init__(self, run_dir: str | os.PathLike, project: str, experiment: str, config: Any = None):
        os.environ["WANDB_MODE"] = "offline"
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        self._wandb = wandb
        run_dir = os.fspath(run_dir)
        os.makedirs(run_dir, exist_ok=True)
        try:
            settings = wandb.Settings(
                console="off", save_code=False, disable_git=True, x_disable_stats=True, silent=True
            )
        except Exception:  # older / newer wandb without some of these fields
            settings = wandb.Settings(console="off")
        kwargs = dict(
            project=project, name=experiment, dir=run_dir, config=_config_dict(config),
            mode="offline", settings=settings,
        )
        try:
            self.run = wandb.init(reinit="create_new", **kwargs)
        except TypeError:  # wandb without string reinit modes
            self.run = wandb.init(reinit=True, **kwargs)
        # run.dir is <offline-run-...>/files
        self.run_path = os.path.dirname(self.run.dir)
        self._closed = False

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(sanitize_metrics(metrics), step=int(step))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.run.finish()
            _wait_for_wandb_run_file(self.run_path)
            logger.info("wandb offline run in %s; upload with: wandb sync %s", self.run_path, self.run_path)


def _wait_for_wandb_run_file(run_path: str, timeout_s: float = 10.0) -> None:
    """Wait until wandb's service has written the offline run's transaction log.

    run.finish() can return before it does (seen with wandb 0.31: the file still held only its
    7-byte header after finish): a process that exits, or a reader, would see an empty run.
    The rest arrives in one write, so: wait for more than the header, then for the size to settle.
    wandb.teardown() would flush too, but it also ends every other wandb run of the process.
    """
    import glob

    header_bytes = 7
    deadline = time.monotonic() + timeout_s
    last = -1
    while time.monotonic() < deadline:
        files = glob.glob(os.path.join(run_path, "run-*.wandb"))
        size = os.path.getsize(files[0]) if files else 0
        if size > header_bytes and size == last:
            return
        last = size
        time.sleep(0.1)
    logger.warning("wandb: the offline run file in %s was not complete after %.0f s", run_path, timeout_s)


class MlflowTracker(Tracker):
    """MLflow with a local file store under ``run_dir/mlruns`` (no server). MLflow 3.x refuses
    file stores unless ``MLFLOW_ALLOW_FILE_STORE=true``, which is set if unset. The config is
    logged as flattened params (``a.b.c``). Pass ``tracking_uri`` (e.g. ``sqlite:///x.db``) to
    write elsewhere."""

    name = "mlflow"
    _PARAM_MAX_LEN = 6000  # MLflow's limit on a param value
    _BATCH = 100  # MLflow's limit on params per log_batch (metrics: 1000)

    def __init__(
        self,
        run_dir: str | os.PathLike,
        project: str,
        experiment: str,
        config: Any = None,
        tracking_uri: str | None = None,
    ):
        if tracking_uri is None:
            store = os.path.abspath(os.path.join(os.fspath(run_dir), "mlruns"))
            os.makedirs(store, exist_ok=True)
            tracking_uri = "file://" + store
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.tracking_uri = tracking_uri
        self.client = MlflowClient(tracking_uri=tracking_uri)
        exp = self.client.get_experiment_by_name(project)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(project)
        self.experiment_id = exp_id
        self.run_id = self.client.create_run(exp_id, run_name=experiment).info.run_id
        params = [
            Param(k, str(v)[: self._PARAM_MAX_LEN]) for k, v in flatten_config(config).items()
        ]
        for i in range(0, len(params), self._BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + self._BATCH])
        self._closed = False

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        ms = [
            Metric(k, v, ts, int(step)) for k, v in sanitize_metrics(metrics).items()
            if math.isfinite(v)
        ]
        for i in range(0, len(ms), 1000):
            self.client.log_batch(self.run_id, metrics=ms[i : i + 1000])

    def close(self, status: str = "FINISHED") -> None:
        if not self._closed:
            self._closed = True
            self.client.set_terminated(self.run_id, status=status)


class MultiTracker(Tracker):
    """Fans ``log``/``close`` out to several trackers; ``trackers[name]`` gets one by name."""

    name = "multi"

    def __init__(self, trackers: Mapping[str, Tracker] | Iterable[Tracker]):
        if isinstance(trackers, Mapping):
            self.trackers = dict(trackers)
        else:
            self.trackers = {t.name: t for t in trackers}

    def __getitem__(self, name: str) -> Tracker:
        return self.trackers[name]

    def __contains__(self, name: str) -> bool:
        return name in self.trackers

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        clean = sanitize_metrics(metrics)
        for t in self.trackers.values():
            t.log(clean, step)

    def close(self) -> None:
        errors = []
        for name, t in self.trackers.items():
            try:
                t.close()
            except Exception as e:  # close the others anyway
                errors.append(f"{name}: {type(e).__name__}: {e}")
        if errors:
            raise RuntimeError("closing trackers failed: " + "; ".join(errors))


#: logger name -> (tracker class, python package it needs or None)
TRACKERS: dict[str, tuple[type[Tracker], str | None]] = {
    "console": (ConsoleTracker, None),
    "jsonl": (JsonlTracker, None),
    "tensorboard": (TensorBoardTracker, "tensorboard"),
    "wandb": (WandbTracker, "wandb"),
    "mlflow": (MlflowTracker, "mlflow"),
}


def _require(name: str, package: str) -> None:
    try:
        importlib.import_module(package)
    except ImportError as e:
        raise ImportError(
            f"logger {name!r} needs the {package!r} package, which is not installed: "
            f"{PIP_EXTRA}  (or pip install {package})"
        ) from e


def make_trackers(
    names: str | Iterable[str],
    run_dir: str | os.PathLike,
    total_steps: int | None = None,
    project: str = "rlflow",
    experiment: str = "run",
    config: Any = None,
    console_keys: Iterable[str] | None = None,
) -> MultiTracker:
    """Build the named trackers ("console", "jsonl", "tensorboard", "wandb", "mlflow"; a string
    may list several, comma-separated). Every name and package is checked before any tracker is
    created, so a typo does not leave half-opened runs behind."""
    if isinstance(names, str):
        names = [n for n in names.replace(" ", "").split(",") if n]
    wanted: list[str] = []
    for n in names:
        n = str(n).strip().lower()
        if n not in wanted:
            wanted.append(n)
    unknown = [n for n in wanted if n not in TRACKERS]
    if unknown:
        raise ValueError(f"unknown logger(s) {unknown}; valid: {sorted(TRACKERS)}")
    for n in wanted:
        pkg = TRACKERS[n][1]
        if pkg is not None:
            _require(n, pkg)
    run_dir = os.fspath(run_dir)
    os.makedirs(run_dir, exist_ok=True)
    built: dict[str, Tracker] = {}
    try:
        for n in wanted:
            if n == "console":
                built[n] = ConsoleTracker(total_steps=total_steps, keys=console_keys)
            elif n == "jsonl":
                built[n] = JsonlTracker(run_dir)
            elif n == "tensorboard":
                built[n] = TensorBoardTracker(run_dir, config=config)
            elif n == "wandb":
                built[n] = WandbTracker(run_dir, project, experiment, config=config)
            elif n == "mlflow":
                built[n] = MlflowTracker(run_dir, project, experiment, config=config)
    except BaseException:
        for t in built.values():
            try:
                t.close()
            except Exception:
                pass
        raise
    return MultiTracker(built)
