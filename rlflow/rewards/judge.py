"""A judge reward: a generative reward model (an LLM judge) asked for a verdict on each response.

``reward.judge`` (rlflow/config.py, JudgeConfig). Each (prompt, response, ground truth) fills the
judge's template (``{prompt}``, ``{response}``, ``{ground_truth}``), which goes to the judge as one
user message under the judge's own chat template (the plain text where it has none); the judge's
rollout engine (``hf``, ``vllm``, ``auto``: vllm when importable) generates a verdict of at most
``max_new_tokens`` tokens (greedy at temperature 0), and the parser turns the verdict into a score.
A sample's score is ``reward.rule_weight * rule + reward.judge.weight * judge``.

Where the judge runs: in the reward pool's processes (rlflow/rewards/pool.py), a pool of its own
(``reward.judge.num_workers`` processes), each of which loads the judge's engine ONCE when it
starts (within trainer.startup_timeout_s; a load error stops the run naming it) and then judges
one sample per call. So the pool's guarantees are the judge's: a judge call past
``reward.timeout_s`` is stopped by killing its process, which takes the hung generation with it
(a Ray actor holding the engine, called by the pool, would go on generating for an abandoned call,
and every later call would queue behind it); a verdict that does not parse, a call that raises and
a process that dies are that sample's error, and ``reward.on_error`` decides (raise: the run stops
naming the sample; zero: it scores 0 and is counted in ``reward/num_errors``). The price: each
process holds a copy of the judge, and a replaced process loads it again.

The parser: ``reward.judge.parser`` is "" (``default_parser``) or ``module:function`` /
``file.py:function``, a function ``(verdict: str) -> float | None``; None (or a non-number) means
the verdict could not be parsed, which is an error of that sample.
"""

from __future__ import annotations

import importlib
import math
import os
import re
from dataclasses import dataclass

from rlflow.plugins import is_file_spec, load_file

__all__ = ["DEFAULT_TEMPLATE", "JudgeReward", "JudgeVerdictError", "check_judge", "default_parser", "fill_template",
           "load_parser", "make_judge_pool"]

DEFAULT_TEMPLATE = """Please act as an impartial judge and evaluate the response to the question below.
Judge its correctness and helpfulness. A reference answer is given when one exists; a response
that contradicts it is wrong.

[Question]
{prompt}

[Reference answer]
{ground_truth}

[Response]
{response}

Give a short explanation, then your rating of the response from 1 (worst) to 10 (best) strictly in
this format: "Rating: [[5]]"."""

PLACEHOLDERS = ("{prompt}", "{response}", "{ground_truth}")

_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_BRACKETED = re.compile(r"\[\[\s*(" + _NUMBER + r")\s*(?:/\s*\d+\s*)?\]\]")
_RATING = re.compile(r"(?:rating|score|grade)\s*(?:is|of)?\s*[:=]?\s*\**\s*(" + _NUMBER + r")", re.IGNORECASE)
_YES_NO = re.compile(r"^\W*(yes|no)\b", re.IGNORECASE)
_NUMBER_ONLY = re.compile(r"^\s*(" + _NUMBER + r")\s*\.?\s*$")


class JudgeVerdictError(ValueError):
    """The judge's verdict gave no score (the parser found none)."""


def default_parser(verdict: str) -> float | None:
    """The score in a verdict, or None. In order: the last ``[[x]]`` (also ``[[x/10]]``); the
    last "Rating: x" / "Score: x" / "Grade: x"; a verdict that starts with yes (1.0) or no (0.0);
    a verdict that is a number alone. Anything else is unparsable (no guess from stray numbers)."""
    text = str(verdict)
    for pattern in (_BRACKETED, _RATING):
        found = pattern.findall(text)
        if found:
            return float(found[-1])
    yes_no = _YES_NO.match(text)
    if yes_no:
        return 1.0 if yes_no.group(1).lower() == "yes" else 0.0
    alone = _NUMBER_ONLY.match(text)
    return float(alone.group(1)) if alone else None


def load_parser(spec: str, key: str = "reward.judge.parser"):
    """The parser a spec names: "" -> default_parser; ``module:function`` or ``file.py:function``.
    Errors name ``key``."""
    if not spec:
        return default_parser
    where, sep, name = str(spec).rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise ValueError(f"{key}={spec!r} must be module:function or file.py:function")
    try:
        if is_file_spec(where):
            if not os.path.isfile(where):
                raise FileNotFoundError(f"no file {os.path.abspath(where)}")
            module = load_file(where, "rlflow_judge_parser_", once=True)
        else:
            module = importlib.import_module(where)
    except Exception as err:  # noqa: BLE001 - any error of the user's module, in one line naming the key
        raise ImportError(f"{key}={spec!r}: cannot import {where}: {type(err).__name__}: {err}") from err
    fn = getattr(module, name, None)
    if not callable(fn):
        raise AttributeError(f"{key}={spec!r}: {where} defines no function {name!r}")
    return fn


def fill_template(template: str, prompt: str, response: str, ground_truth) -> str:
    """The template with its placeholders replaced (plain replacement: other braces stay as they
    are, e.g. a JSON example). A missing ground truth reads "(none)"."""
    missing = ground_truth is None or (isinstance(ground_truth, str) and not ground_truth)
    truth = "(none)" if missing else str(ground_truth)
    values = {"{prompt}": prompt, "{response}": response, "{ground_truth}": truth}
    # one pass, so a response that contains "{prompt}" is not itself replaced
    return re.sub("|".join(re.escape(p) for p in PLACEHOLDERS), lambda m: values[m.group(0)], template)


def prompt_text(raw_prompt) -> str:
    """The policy's prompt as text: a string as it is; chat messages as "role: content" lines."""
    if isinstance(raw_prompt, str):
        return raw_prompt
    try:
        return "\n".join(f"{m['role']}: {m['content']}" for m in raw_prompt)
    except (TypeError, KeyError):
        return str(raw_prompt)


def read_template(section, key: str = "reward.judge") -> str:
    """The template: template_file's text, the template string, or the default."""
    if section.template_file:
        path = section.template_file
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{key}.template_file={path!r} is not a file")
        with open(path, encoding="utf-8") as f:
            return f.read()
    return section.template or DEFAULT_TEMPLATE


@dataclass
class JudgeReward:
    """The judge as a reward function of the pool: pickled to each pool process, where
    ``load_in_process`` builds the engine once; ``__call__`` judges one sample. The item's
    extra_info is ``{"prompt": raw prompt, "extra_info": the row's}`` (the Scorer builds it)."""

    model_path: str
    engine: str = "auto"
    template: str = DEFAULT_TEMPLATE
    parser: str = ""
    max_prompt_length: int = 1024
    max_new_tokens: int = 64
    temperature: float = 0.0
    dtype: str = "float32"
    seed: int = 0
    device: str | None = None  # the hf engine's: "cpu", or None (cuda where the process sees one)

    def load_in_process(self) -> "JudgeReward":
        """Loads the tokenizer, the engine and the parser (in the pool process, once)."""
        import torch
        from transformers import AutoTokenizer

        from workers.rollout.engine import get_engine

        from transformers import AutoConfig

        self._parse = load_parser(self.parser)
        self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        # the prompt and the verdict fit the judge's context: a longer prompt loses its start
        window = getattr(AutoConfig.from_pretrained(self.model_path), "max_position_embeddings", None)
        self._prompt_tokens = self.max_prompt_length
        if window:
            self._prompt_tokens = max(1, min(self.max_prompt_length, int(window) - self.max_new_tokens))
        eos = self._tokenizer.eos_token_id
        pad = self._tokenizer.pad_token_id if self._tokenizer.pad_token_id is not None else eos
        name = self.engine
        if name == "auto":
            name = "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
        cls = get_engine(name)
        kwargs = dict(max_prompt_length=self._prompt_tokens, max_response_length=self.max_new_tokens,
                      temperature=max(self.temperature, 1e-5), dtype=self.dtype, seed=self.seed,
                      pad_token_id=pad, eos_token_id=eos)
        if name == "hf":
            kwargs["device"] = self.device
        if name == "vllm":
            kwargs["engine_in_process"] = True  # the pool process is the engine's own
            if not torch.cuda.is_available():
                kwargs["kv_cache_memory_bytes"] = 256 * 2**20
        self._engine = cls(self.model_path, **kwargs)
        return self

    def judge_ids(self, text: str) -> list[int]:
        tok = self._tokenizer
        if getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                          add_generation_prompt=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = tok(text)["input_ids"]
        return list(ids)[-self._prompt_tokens:]  # a long prompt loses its start, the response stays

    def verdict(self, text: str) -> str:
        import torch

        ids = torch.tensor([self.judge_ids(text)], dtype=torch.long)
        responses, _ = self._engine.generate_ids(
            ids, torch.ones_like(ids), n=1, do_sample=self.temperature > 0, seed=None, return_log_probs=False,
            temperature=max(self.temperature, 1e-5), top_p=1.0, max_new_tokens=self.max_new_tokens)
        out = responses[0]
        eos = self._engine.eos_token_id
        if eos in out:
            out = out[:out.index(eos)]
        return self._tokenizer.decode(out, skip_special_tokens=True)

    def score(self, verdict: str) -> float:
        value = self._parse(verdict)
        number = None
        if value is not None and not isinstance(value, bool):
            try:
                number = float(value)
            except (TypeError, ValueError):
                number = None
        if number is None or not math.isfinite(number):
            shown = verdict if len(verdict) <= 200 else verdict[:200] + "..."
            raise JudgeVerdictError(f"the judge's verdict gave no score (parser returned {value!r}): {shown!r}")
        return number

    def __call__(self, data_source, solution_str, ground_truth, extra_info=None):
        raw_prompt = (extra_info or {}).get("prompt", "")
        text = fill_template(self.template, prompt_text(raw_prompt), solution_str, ground_truth)
        verdict = self.verdict(text)
        return {"score": self.score(verdict)}


def _judge_key(section) -> str:
    return f"reward.judge.model_path={section.model_path!r}"


def check_judge(cfg) -> JudgeReward:
    """What the config cannot check without files, before Ray starts: the model folder (an alias
    of rlflow.models resolved here), the template file, the parser. Raises a ConfigError naming the
    key. Returns the JudgeReward the pool's processes run."""
    from rlflow.config import ConfigError
    from rlflow.models import MODEL_ALIASES, resolve_alias

    section = cfg.reward.judge
    path = section.model_path
    try:
        if path in MODEL_ALIASES:
            path = resolve_alias(path)
        elif not os.path.isdir(path):
            raise FileNotFoundError(f"{_judge_key(section)} is not a folder (a local HF causal LM folder, or one of "
                                    f"{', '.join(sorted(MODEL_ALIASES))})")
        elif not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"{_judge_key(section)} has no config.json: not a HF model folder")
        template = read_template(section)
        load_parser(section.parser)
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - one line naming the key
        raise ConfigError(str(err)) from err
    if "{response}" not in template:
        raise ConfigError(f"reward.judge.template{'_file' if section.template_file else ''} has no {{response}} "
                          "placeholder: the judge would never see the response")
    return JudgeReward(path, section.engine, template, section.parser, section.max_prompt_length,
                       section.max_new_tokens, section.temperature, section.dtype, cfg.trainer.seed,
                       device=None if section.num_gpus else "cpu")


def make_judge_pool(cfg, judge: JudgeReward | None = None):
    """The judge's RewardPool (its processes start on the first batch): reward.judge.num_workers
    processes, reward.timeout_s per sample, reward.on_error. None when the judge is off."""
    if not cfg.reward.judge.enable:
        return None
    from rlflow.rewards.pool import RewardPool

    judge = judge if judge is not None else check_judge(cfg)
    section = cfg.reward.judge
    return RewardPool(num_workers=section.num_workers, timeout_s=cfg.reward.timeout_s, on_error=cfg.reward.on_error,
                      startup_timeout_s=cfg.trainer.startup_timeout_s, fn=judge,
                      actor_options={"num_gpus": section.num_gpus} if section.num_gpus else None,
                      label="judge")


def judge_items(raw_prompts, responses, ground_truths, data_sources, extra_infos) -> list[tuple]:
    """The judge pool's items: the row's extra_info wrapped with the prompt the template needs."""
    return [(ds, response, truth, {"prompt": prompt, "extra_info": extra})
            for prompt, response, truth, ds, extra in zip(raw_prompts, responses, ground_truths, data_sources,
                                                          extra_infos, strict=True)]
