"""Prompt datasets in verl's column layout, tokenised once, batched into TensorDicts.

Row layout (one dict per prompt, the same columns verl's parquet files have)::

    prompt        list of chat messages [{"role": ..., "content": ...}] or a plain string
    data_source   str, selects the reward function (rlflow.rewards.compute_score)
    ability       str (optional; informational)
    reward_model  {"style": "rule", "ground_truth": ...}
    extra_info    dict (optional; passed to the reward function)

``load_rows`` reads .parquet / .jsonl files into such dicts, ``PromptDataset`` tokenises them and
drops over-long prompts, ``collate`` builds a left-padded TensorDict batch, and
``StatefulDataLoader`` iterates over epochs forever with a resumable position.

Per-row non-tensor data (strings, dicts) is stored with ``set_row_data`` as a
``tensordict.NonTensorStack``; that is the form that follows indexing, ``split``, ``torch.cat``,
``repeat_interleave``, pickling and Ray. ``td.set_non_tensor(key, a_list)`` is NOT: it stores the
whole list as one value that every row shares, so ``td[[0, 2]][key]`` still returns the full list.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Callable

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

__all__ = [
    "REQUIRED_COLUMNS",
    "ROW_DATA_KEYS",
    "load_rows",
    "rows_from",
    "PromptDataset",
    "collate",
    "set_row_data",
    "get_row_data",
    "StatefulDataLoader",
]

logger = logging.getLogger(__name__)

#: columns every row must have (the prompt column's name is configurable, default "prompt")
REQUIRED_COLUMNS = ("data_source", "reward_model")
#: the per-row non-tensor keys ``collate`` stores
ROW_DATA_KEYS = ("data_source", "ground_truth", "extra_info", "raw_prompt", "source_prompt")

_SUPPORTED_EXTENSIONS = (".parquet", ".jsonl")


# --------------------------------------------------------------------------------------------
# reading files
# --------------------------------------------------------------------------------------------


def _as_file_list(files: str | os.PathLike | Iterable[str | os.PathLike]) -> list[str]:
    if isinstance(files, (str, os.PathLike)):
        return [os.fspath(files)]
    out = [os.fspath(f) for f in files]
    if not out:
        raise ValueError("load_rows: no data files given (an empty list)")
    return out


def _read_parquet(path: str) -> tuple[list[dict], list[str]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises ArrowInvalid & co. for a broken file
        raise ValueError(f"{path}: cannot be read as parquet: {e}") from e
    return table.to_pylist(), list(table.column_names)


def _read_jsonl(path: str) -> tuple[list[dict], list[str]]:
    rows: list[dict] = []
    columns: dict[str, None] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}, line {lineno}: not valid JSON ({e.msg})") from e
            if not isinstance(obj, dict):
                raise ValueError(
                    f"{path}, line {lineno}: expected a JSON object (one row), got "
                    f"{type(obj).__name__}"
                )
            for k in obj:
                columns.setdefault(k, None)
            rows.append(obj)
    return rows, list(columns)


def _check_prompt(prompt: Any) -> str | None:
    """None when ``prompt`` is a str or a list of {"role": str, "content": str}; else why not."""
    if isinstance(prompt, str):
        return None
    if isinstance(prompt, (list, tuple)):
        if not prompt:
            return "an empty list of messages"
        for j, m in enumerate(prompt):
            if not isinstance(m, Mapping):
                return f"message {j} is a {type(m).__name__}, not a dict with 'role' and 'content'"
            for k in ("role", "content"):
                if not isinstance(m.get(k), str):
                    return f"message {j} has no string {k!r} (keys: {sorted(m)})"
        return None
    return f"a {type(prompt).__name__}"


def load_rows(
    files: str | os.PathLike | Iterable[str | os.PathLike], *, prompt_key: str = "prompt"
) -> list[dict]:
    """Read prompt rows from .parquet (pyarrow) or .jsonl files, in order.

    Every row must have ``prompt_key``, ``data_source`` and ``reward_model`` (a dict with
    ``ground_truth``); ``ability`` defaults to "" and ``extra_info`` to {}. Errors name the file
    (and the row, 0-based within its file, for per-row problems).
    """
    out: list[dict] = []
    for path in _as_file_list(files):
        if not os.path.exists(path):
            raise FileNotFoundError(f"data file not found: {path}")
        if os.path.isdir(path):
            raise IsADirectoryError(f"data file is a directory, not a file: {path}")
        ext = os.path.splitext(path)[1].lower()
        if ext == ".parquet":
            rows, columns = _read_parquet(path)
        elif ext == ".jsonl":
            rows, columns = _read_jsonl(path)
        else:
            raise ValueError(
                f"{path}: unsupported file type {ext or '(no extension)'!r}; "
                f"use one of {', '.join(_SUPPORTED_EXTENSIONS)}"
            )
        if not rows:
            raise ValueError(f"{path}: the file has no rows")
        out.extend(_validate_rows(rows, path, prompt_key, columns))
    return out


def _validate_rows(
    rows: list[dict], where: str, prompt_key: str, columns: Sequence[str] | None = None
) -> list[dict]:
    """Check the layout of ``rows`` (from ``where``: a file, or in-memory rows) and fill the
    optional columns: ``ability`` "" and ``extra_info`` {}. ``columns``: the table's columns, when
    the rows come from a table (a missing column is then named once, for the whole table)."""
    if columns is not None:
        for col in (prompt_key, *REQUIRED_COLUMNS):
            if col not in columns:
                raise ValueError(
                    f"{where}: missing required column {col!r}; columns found: {list(columns)}"
                )
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ValueError(
                f"{where}, row {i}: expected a dict (one row), got {type(row).__name__}"
            )
        for col in (prompt_key, *REQUIRED_COLUMNS):
            if row.get(col) is None:
                raise ValueError(
                    f"{where}, row {i}: column {col!r} is missing or null (columns: {sorted(row)})"
                )
        why = _check_prompt(row[prompt_key])
        if why is not None:
            raise ValueError(
                f"{where}, row {i}: column {prompt_key!r} must be a string or a list of "
                f"chat messages [{{'role': ..., 'content': ...}}], got {why}"
            )
        rm = row["reward_model"]
        if not isinstance(rm, Mapping) or "ground_truth" not in rm:
            raise ValueError(
                f"{where}, row {i}: column 'reward_model' must be a dict with a "
                f"'ground_truth' key, got {rm!r:.200}"
            )
        if row.get("extra_info") is None:
            row["extra_info"] = {}
        elif not isinstance(row["extra_info"], Mapping):
            raise ValueError(
                f"{where}, row {i}: column 'extra_info' must be a dict, got "
                f"{type(row['extra_info']).__name__}"
            )
        if row.get("ability") is None:
            row["ability"] = ""
    return rows


def _to_python(value: Any) -> Any:
    """numpy arrays and scalars (pandas and datasets cells) as plain lists and numbers; a float
    NaN (pandas' missing value) as None."""
    if isinstance(value, (str, bytes)):
        return value
    if isinstance(value, Mapping):
        return {k: _to_python(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_python(v) for v in value]
    if hasattr(value, "tolist") and type(value).__module__.split(".")[0] == "numpy":
        return _to_python(value.tolist())
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def rows_from(data: Any, *, prompt_key: str = "prompt", name: str = "rows") -> list[dict]:
    """Prompt rows given in memory, checked as ``load_rows`` checks a file's: a list of dicts, a
    ``pandas.DataFrame`` (``to_dict("records")``), a ``datasets.Dataset`` or a ``pyarrow.Table``
    (any object with ``to_list()`` / ``to_pylist()``), or any iterable of dict rows. ``name`` (e.g.
    "train_dataset") names the argument in errors, with the row index (0-based). Returns new dicts:
    the caller's rows are not modified."""
    where = f"{name} (rows given in memory)"
    if data is None or isinstance(data, (str, bytes, os.PathLike)):
        raise TypeError(
            f"{name}: expected rows in memory (a list of dicts, a pandas DataFrame or a "
            f"datasets.Dataset), got {data!r:.200}; for data files set data.train_files / "
            f"data.val_files"
        )
    if isinstance(data, Mapping):
        raise TypeError(
            f"{name}: got one dict (keys: {sorted(data)[:10]}); pass a list of row dicts, "
            f"one per prompt"
        )
    columns = None
    if type(data).__module__.split(".")[0] == "pandas" and hasattr(data, "to_dict"):
        columns = [str(c) for c in data.columns]
        rows = data.to_dict("records")
    elif callable(getattr(data, "to_list", None)) and hasattr(data, "column_names"):
        columns, rows = list(data.column_names), data.to_list()  # datasets.Dataset
    elif callable(getattr(data, "to_pylist", None)) and hasattr(data, "column_names"):
        columns, rows = list(data.column_names), data.to_pylist()  # pyarrow.Table
    else:
        try:
            rows = list(data)
        except TypeError:
            raise TypeError(
                f"{name}: expected rows in memory (a list of dicts, a pandas DataFrame or a "
                f"datasets.Dataset), got a {type(data).__name__}"
            ) from None
    if not rows:
        raise ValueError(f"{where}: no rows")
    rows = [
        {str(k): _to_python(v) for k, v in row.items()} if isinstance(row, Mapping) else row
        for row in rows
    ]
    return _validate_rows(rows, where, prompt_key, columns)


# --------------------------------------------------------------------------------------------
# tokenised dataset
# --------------------------------------------------------------------------------------------


def _has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _resolve_pad_token_id(tokenizer) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", None)
    if pad is None:
        raise ValueError(
            "the tokenizer has neither a pad_token_id nor an eos_token_id; set "
            "tokenizer.pad_token before building the dataset"
        )
    return int(pad)


def _source_prompt(prompt) -> dict:
    """{"prompt": the string, or the chat messages as plain dicts}: wrapped in a dict because
    set_row_data would turn a list value into a nested stack."""
    if isinstance(prompt, str):
        return {"prompt": prompt}
    return {"prompt": [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]}


def _target_of(row: Mapping, key: str, index: int, source: str) -> str:
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            raise ValueError(f"{source}, row {index}: no {key!r} (data.response_key: the SFT target response); "
                             f"columns: {sorted(row)}")
        value = value[part]
    if not isinstance(value, str) or not value:
        raise ValueError(f"{source}, row {index}: {key!r} (data.response_key) holds {value!r}, not a non-empty string")
    return value


class PromptDataset(Sequence):
    """Tokenised prompts; ``dataset[i]`` is a dict with ``input_ids`` (list[int]),
    ``data_source``, ``ground_truth``, ``extra_info``, ``raw_prompt`` (the exact text that was
    tokenised: the chat-templated string for message lists, the string itself otherwise) and
    ``source_prompt`` ({"prompt": the row's prompt as given, a string or the chat messages as
    plain dicts}; a reward model formats it with its own template).

    apply_chat_template:
      "auto"  message lists go through ``tokenizer.apply_chat_template(...,
              add_generation_prompt=True)`` (error if the tokenizer has no chat template),
              plain strings are encoded as they are (with the tokenizer's special tokens, e.g. BOS);
      True    also wraps plain strings as one user message and templates them;
      False   plain strings only; a message list is an error.
    Templated text is encoded with ``add_special_tokens=False`` (the template has them already).

    Prompts longer than ``max_prompt_length`` tokens are dropped when ``filter_overlong`` (counted
    in ``num_dropped``, with a warning), otherwise they are an error.

    ``target_key`` (SFT, controllers/sft.py): each item also holds ``target``, the row's target
    response, from that column or dotted path (``reward_model.ground_truth``); a row without a
    non-empty string there is an error naming the row.
    """

    def __init__(
        self,
        rows: Sequence[Mapping],
        tokenizer,
        max_prompt_length: int,
        prompt_key: str = "prompt",
        apply_chat_template: bool | str = "auto",
        filter_overlong: bool = True,
        source: str | Sequence[str] | None = None,
        target_key: str | None = None,
    ):
        if apply_chat_template not in ("auto", True, False):
            raise ValueError(
                f"apply_chat_template must be 'auto', True or False, got {apply_chat_template!r}"
            )
        if int(max_prompt_length) <= 0:
            raise ValueError(f"max_prompt_length must be positive, got {max_prompt_length}")
        self.tokenizer = tokenizer
        self.max_prompt_length = int(max_prompt_length)
        self.prompt_key = prompt_key
        self.apply_chat_template = apply_chat_template
        if source is None:
            self.source = "(rows given in memory)"
        elif isinstance(source, str):
            self.source = source
        else:
            self.source = ", ".join(map(str, source))
        self.pad_token_id = _resolve_pad_token_id(tokenizer)
        if len(rows) == 0:
            raise ValueError(f"PromptDataset: no rows ({self.source})")

        items: list[dict] = []
        lengths: list[int] = []
        self.dropped_indices: list[int] = []
        for i, row in enumerate(rows):
            if prompt_key not in row:
                raise ValueError(
                    f"{self.source}, row {i}: no column {prompt_key!r} (columns: {sorted(row)})"
                )
            text, ids = self._tokenize(row[prompt_key], i)
            lengths.append(len(ids))
            if len(ids) > self.max_prompt_length:
                if not filter_overlong:
                    raise ValueError(
                        f"{self.source}, row {i}: prompt is {len(ids)} tokens, longer than "
                        f"max_prompt_length={self.max_prompt_length} (filter_overlong=False)"
                    )
                self.dropped_indices.append(i)
                continue
            rm = row.get("reward_model") or {}
            if target_key is not None:
                extra = {"target": _target_of(row, target_key, i, self.source)}
            else:
                extra = {}
            items.append(
                {
                    **extra,
                    "input_ids": ids,
                    "data_source": row.get("data_source"),
                    "ground_truth": rm.get("ground_truth") if isinstance(rm, Mapping) else None,
                    "extra_info": dict(row.get("extra_info") or {}),
                    "raw_prompt": text,
                    "source_prompt": _source_prompt(row[prompt_key]),
                }
            )
        self.num_dropped = len(self.dropped_indices)
        self.prompt_lengths = lengths  # of all rows, kept or not
        if not items:
            raise ValueError(
                f"all {len(rows)} prompts are longer than max_prompt_length="
                f"{self.max_prompt_length} tokens (longest {max(lengths)}, shortest "
                f"{min(lengths)}) in {self.source}; raise data.max_prompt_length or shorten "
                f"the prompts"
            )
        if self.num_dropped:
            logger.warning(
                "dropped %d of %d prompts longer than max_prompt_length=%d tokens (longest %d) "
                "from %s",
                self.num_dropped,
                len(rows),
                self.max_prompt_length,
                max(lengths),
                self.source,
            )
        self.items = items

    @classmethod
    def from_files(cls, files, tokenizer, max_prompt_length: int, **kwargs) -> "PromptDataset":
        """``load_rows(files)`` then ``PromptDataset(rows, ...)``, naming the files in errors."""
        flist = _as_file_list(files)
        rows = load_rows(flist, prompt_key=kwargs.get("prompt_key", "prompt"))
        return cls(rows, tokenizer, max_prompt_length, source=flist, **kwargs)

    def _tokenize(self, prompt, i: int) -> tuple[str, list[int]]:
        why = _check_prompt(prompt)
        if why is not None:
            raise ValueError(
                f"{self.source}, row {i}: prompt must be a string or a list of chat messages, "
                f"got {why}"
            )
        mode = self.apply_chat_template
        if isinstance(prompt, str) and mode is not True:
            text = prompt
            return text, list(self.tokenizer(text)["input_ids"])
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        else:
            if mode is False:
                raise ValueError(
                    f"{self.source}, row {i}: the prompt is a list of chat messages but "
                    f"apply_chat_template=False; use 'auto' or True"
                )
            messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
        if not _has_chat_template(self.tokenizer):
            raise ValueError(
                f"{self.source}, row {i}: the prompt is a list of chat messages but the "
                f"tokenizer ({type(self.tokenizer).__name__}) has no chat template; set "
                f"tokenizer.chat_template, or store prompts as plain strings"
            )
        # tokenize=False then encode: transformers 5 returns a BatchEncoding (not a list of ids)
        # from apply_chat_template(tokenize=True).
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return text, ids

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return [self.items[i] for i in range(*idx.indices(len(self.items)))]
        return self.items[idx]


# --------------------------------------------------------------------------------------------
# per-row non-tensor data in a TensorDict
# --------------------------------------------------------------------------------------------


def set_row_data(td: TensorDict, key: str, values: Sequence) -> TensorDict:
    """Store one Python object per row (str, dict, ...) under ``key`` so that it follows the rows
    through ``td[idx]``, ``td.split``, ``torch.cat``, ``repeat_interleave``, pickle and Ray.

    Uses ``NonTensorStack.from_list``. Note: list values are turned into nested stacks by
    tensordict (read back as lists); dict values come back unchanged.
    """
    values = list(values)
    if td.batch_dims != 1:
        raise ValueError(f"set_row_data needs a TensorDict with one batch dim, got {td.batch_size}")
    if len(values) != td.batch_size[0]:
        raise ValueError(
            f"set_row_data({key!r}): {len(values)} values for a batch of {td.batch_size[0]} rows"
        )
    if not values:
        raise ValueError(f"set_row_data({key!r}): cannot store per-row data in an empty batch")
    td.set(key, NonTensorStack.from_list(values))
    return td


def _plain(v):
    if isinstance(v, list):  # tensordict's LinkedList is a list subclass; nested lists too
        return [_plain(x) for x in v]
    return v


def get_row_data(td: TensorDict, key: str) -> list:
    """The per-row values stored by ``set_row_data``, as a plain list (one entry per row)."""
    entry = td.get(key)
    if isinstance(entry, NonTensorStack):
        return _plain(entry.tolist())
    if isinstance(entry, NonTensorData):
        if td.batch_dims == 0:  # a single row, e.g. td[3]
            return [_plain(entry.data)]
        raise TypeError(
            f"{key!r} holds one value shared by all rows (stored with set_non_tensor), not "
            f"per-row data; store per-row values with set_row_data(td, {key!r}, values)"
        )
    raise TypeError(f"{key!r} is a {type(entry).__name__}, not per-row non-tensor data")


# --------------------------------------------------------------------------------------------
# batching
# --------------------------------------------------------------------------------------------


def collate(items: Sequence[Mapping], pad_token_id: int) -> TensorDict:
    """Batch dataset items: ``input_ids``/``attention_mask``/``position_ids`` [B, P] long,
    LEFT-padded to the longest prompt of the batch; ``position_ids = clamp(cumsum(mask)-1, 0)``;
    per-row ``data_source``, ``ground_truth``, ``extra_info``, ``raw_prompt``, ``source_prompt`` via
    set_row_data."""
    if not items:
        raise ValueError("collate: empty batch")
    bsz = len(items)
    width = max(len(it["input_ids"]) for it in items)
    if width == 0:
        raise ValueError("collate: every prompt in the batch is empty (0 tokens)")
    input_ids = torch.full((bsz, width), int(pad_token_id), dtype=torch.long)
    attention_mask = torch.zeros((bsz, width), dtype=torch.long)
    for b, it in enumerate(items):
        ids = it["input_ids"]
        n = len(ids)
        if n:
            input_ids[b, width - n :] = torch.as_tensor(ids, dtype=torch.long)
            attention_mask[b, width - n :] = 1
    position_ids = torch.clamp(torch.cumsum(attention_mask, dim=1) - 1, min=0)
    td = TensorDict(
        {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids},
        batch_size=[bsz],
    )
    for key in ROW_DATA_KEYS:
        set_row_data(td, key, [it.get(key) for it in items])
    return td


class StatefulDataLoader:
    """An endless iterator of batches over epochs.

    Each epoch is a permutation seeded by (seed, epoch), so every epoch's order is reproducible
    on its own. ``state_dict()`` is {"epoch", "position", "seed"}: ``position`` counts the batches
    already yielded in ``epoch``; ``load_state_dict`` resumes at the next unseen batch.

    Yields ``collate_fn(items)``; by default ``collate(items, dataset.pad_token_id)`` for a
    PromptDataset (a plain list of items for a dataset without ``pad_token_id``).
    """

    def __init__(
        self,
        dataset: Sequence,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        collate_fn: Callable[[list], Any] | None = None,
    ):
        n = len(dataset)
        if int(batch_size) <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if batch_size > n:
            dropped = getattr(dataset, "num_dropped", 0)
            extra = f" ({dropped} over-long prompts were dropped)" if dropped else ""
            raise ValueError(
                f"batch_size={batch_size} is larger than the dataset ({n} prompts{extra}); "
                f"lower data.train_batch_size or add data"
            )
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        if collate_fn is None:
            pad = getattr(dataset, "pad_token_id", None)
            collate_fn = (lambda items: collate(items, pad)) if pad is not None else list
        self.collate_fn = collate_fn
        self.epoch = 0
        self.position = 0
        self._order: list[int] | None = None
        self._order_epoch = -1

    def __len__(self) -> int:
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def epoch_order(self, epoch: int) -> list[int]:
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator().manual_seed(_mix_seed(self.seed, epoch))
        return torch.randperm(n, generator=g).tolist()

    def __iter__(self):
        return self

    def __next__(self):
        if self.position >= len(self):
            self.epoch += 1
            self.position = 0
        if self._order_epoch != self.epoch:
            self._order = self.epoch_order(self.epoch)
            self._order_epoch = self.epoch
        start = self.position * self.batch_size
        idx = self._order[start : start + self.batch_size]
        self.position += 1
        return self.collate_fn([self.dataset[i] for i in idx])

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: Mapping) -> None:
        missing = [k for k in ("epoch", "position", "seed") if k not in state]
        if missing:
            raise KeyError(f"dataloader state is missing {missing} (got keys {sorted(state)})")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= len(self):
            raise ValueError(
                f"dataloader state epoch={epoch}, position={position} does not fit a loader "
                f"with {len(self)} batches per epoch (did the dataset or batch_size change?)"
            )
        self.epoch, self.position, self.seed = epoch, position, int(state["seed"])
        self._order_epoch = -1


def _mix_seed(seed: int, epoch: int) -> int:
    # distinct, deterministic 63-bit seed per (seed, epoch)
    return (int(seed) * 0x9E3779B97F4A7C15 + int(epoch) * 0xBF58476D1CE4E5B9 + 1) % (2**63 - 1)
