"""A tiny Qwen2 model and tokenizer built locally, and the SFT warm start of the default run.

Nothing here downloads anything: the tokenizer is a byte-level BPE trained with ``tokenizers`` on
text of the synthetic tasks' alphabet, the model is a ``Qwen2ForCausalLM`` initialised from a
config, and ``warm_start`` fine-tunes it briefly on synthetic train rows and caches the result
under ``$RLFLOW_CACHE`` (default ``~/.cache/rlflow``).

The tokenizer uses exactly the pipeline transformers' ``Qwen2Tokenizer`` builds from a vocab and
merges (NFC, Qwen2's split regex, byte-level with no prefix space, byte-level decoder), so the
folder reloads the same whether ``AutoTokenizer`` returns a ``PreTrainedTokenizerFast`` or
rebuilds it as ``Qwen2Tokenizer`` (transformers 5 does for a folder whose config says qwen2).

The warm start imitates a *mixed-quality demonstrator*: each SFT target is the right answer with
probability ``correct_frac`` (0.4) and otherwise the task's distractor, a systematic mistake
(reverse: copying the digits unreversed). The SFT model thus learns to execute both strategies
and prefers the wrong one, so greedy decoding is mostly wrong while sampling at T=1 often finds
the rewarded strategy: RL has a clear, quickly learnable signal (choose the strategy the reward
favours), which is what an RL stage on top of a pretrained model does at scale. A plain,
undertrained SFT (correct_frac=1.0, fewer steps) left RL almost nothing to gain in 40 steps.

Multi-turn tool tasks (``AGENT_TASKS``: "calc", long additions with a calculator tool,
rlflow.agents.calculator) are warm-started the same way on *episodes*: the demonstrator plays each
train row against the task's environment, calling the tool in a fraction ``correct_frac`` of the
episodes ("@a+b" EOS, observation "=sum", "sum" EOS) and otherwise answering at once with the
distractor (add without carry: right only by luck). The SFT example is laid out exactly as the agent
loop builds a trajectory (``encode_episode``): prompt ids, then each model turn's ids + EOS
(trained on) followed by the observation's ids (label -100). Such tasks take their SFT options from
``TASK_SFT_DEFAULTS`` over SFT_DEFAULTS; the other tasks' options, and so their cache entries, are
unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import time
from pathlib import Path

from rlflow.files import building_dir

__all__ = [
    "CODE_VERSION",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "CHAT_TEMPLATE",
    "MODEL_DEFAULTS",
    "SFT_DEFAULTS",
    "build_tokenizer",
    "build_tiny_model",
    "warm_start",
    "cache_root",
    "evaluate_exact_match",
    "AGENT_TASKS",
    "TASK_SFT_DEFAULTS",
    "encode_episode",
    "agent_demos",
    "agent_sft_examples",
]

#: Bump when a change here changes what warm_start produces, so old cache entries are not reused.
CODE_VERSION = "1"

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"

#: The tiny tokenizer's chat template: a conversation laid out exactly as the agent loop lays out a
#: trajectory, with no role markers (the tokenizer has no special tokens for them, and adding some
#: would change the vocabulary and so the model). A user or tool message is its content as it is; an
#: assistant message is its content followed by EOS (a model turn ends with EOS); a system message is
#: its content and a newline. The generation prompt is empty. So a prompt of one user message renders
#: to the same text, and the same token ids, as the plain-string prompt the warm start trains on:
#: chat rows of a synthetic task reach the warm-started model as it was trained. Content given as a
#: list of parts (OpenAI's [{"type": "text", "text": ...}]) renders its text parts in order.
CHAT_TEMPLATE = (
    "{%- macro text(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content -%}{%- for part in content -%}{%- if part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{ text(message['content']) }}{{ '\\n' }}"
    "{%- elif message['role'] == 'assistant' -%}{{ text(message['content']) }}{{ eos_token }}"
    "{%- else -%}{{ text(message['content']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

# Qwen2's pre-tokenizer regex (digits are split one by one, so no merge ever joins two digits).
_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

MODEL_DEFAULTS: dict = {
    "hidden_size": 128,
    "num_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 512,
    "max_position_embeddings": 128,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "seed": 0,
}

SFT_DEFAULTS: dict = {
    "steps": 300,
    "batch_size": 64,
    "lr": 1e-3,
    "warmup_steps": 20,
    "weight_decay": 0.0,
    "num_rows": 20000,
    "seed": 0,
    "grad_clip": 1.0,
    # fraction of SFT targets that are right; the rest are the task's distractor (see above)
    "correct_frac": 0.4,
}

#: Multi-turn tasks whose warm start imitates episodes played against an environment
#: ("module:Class", constructed without arguments); see agent_demos.
AGENT_TASKS: dict[str, str] = {
    "calc": "rlflow.agents.calculator:CalculatorEnv",
}

#: Per-task overrides of SFT_DEFAULTS (same keys). A task not listed here uses SFT_DEFAULTS as they
#: are, so adding an entry never changes another task's cache key. For "calc", correct_frac is the
#: fraction of demonstrations that call the tool.
TASK_SFT_DEFAULTS: dict[str, dict] = {
    # 800 steps: copying the operands into the call and the result into the answer is learnt by
    # ~500, but the first digit of the direct answer only outweighs "@" (30%) later; before that,
    # greedy decoding calls the tool on most prompts and there is little left for RL to improve
    "calc": {"correct_frac": 0.3, "steps": 800},
    # ~2300-token rows: a short warm start of few rows (the recipe shows the sequence axis at
    # length; the model learns the answer's length and digit counts, not sorting)
    "sort_long": {"steps": 40, "batch_size": 4, "num_rows": 256, "warmup_steps": 5},
}


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("RLFLOW_CACHE")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "rlflow"


# ----------------------------------------------------------------------------------------------
# tokenizer


#: The tasks whose text the tiny tokenizer is trained on. A fixed list: a task added to the registry
#: later (e.g. the English word problems for a pretrained model) must not change the tiny tokenizer.
TOKENIZER_TASKS = ("add", "reverse", "sort")


def _tokenizer_corpus() -> list[str]:
    from rlflow.data.synthetic import TASKS, make_synthetic_rows

    lines: list[str] = []
    for name in TOKENIZER_TASKS:
        for row in make_synthetic_rows(name, 200, seed=12345, split="train"):
            lines.append(row["prompt"] + row["reward_model"]["ground_truth"])
            lines.append(row["prompt"] + " " + row["reward_model"]["ground_truth"])
    chars = sorted({c for name in TOKENIZER_TASKS for c in TASKS[name].alphabet} | set(" \n"))
    lines.append("".join(chars))
    lines.append("the answer is 42\nQ: what is 3+4? A: 7")
    return lines


def build_tokenizer(out_dir: str | os.PathLike, vocab_size: int = 300):
    """Train a byte-level BPE tokenizer on task text and save it (transformers format) in out_dir.

    Returns the ``PreTrainedTokenizerFast``. ``eos_token`` = ``<|endoftext|>`` (id 0) and
    ``pad_token`` = ``<|pad|>`` (id 1) are distinct; there is no bos (like Qwen2). All 256 bytes are
    in the vocabulary, so any text round-trips. Its chat template is CHAT_TEMPLATE.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tokenizer_corpus(), trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        bos_token=None,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=MODEL_DEFAULTS["max_position_embeddings"],
    )
    hf.chat_template = CHAT_TEMPLATE
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out))
    return hf


# ----------------------------------------------------------------------------------------------
# model


def _qwen2_config(vocab_size: int, eos_id: int, pad_id: int, **model_kwargs):
    from transformers import Qwen2Config

    m = {**MODEL_DEFAULTS, **model_kwargs}
    unknown = set(m) - set(MODEL_DEFAULTS)
    if unknown:
        raise TypeError(f"unknown model option(s) {sorted(unknown)}; known: {sorted(MODEL_DEFAULTS)}")
    hidden, heads = m["hidden_size"], m["num_attention_heads"]
    if hidden % heads:
        raise ValueError(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=m["intermediate_size"],
        num_hidden_layers=m["num_layers"],
        num_attention_heads=heads,
        num_key_value_heads=m["num_key_value_heads"],
        max_position_embeddings=m["max_position_embeddings"],
        rope_theta=m["rope_theta"],
        tie_word_embeddings=m["tie_word_embeddings"],
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        use_cache=True,
        torch_dtype="float32",
    )


def build_tiny_model(out_dir: str | os.PathLike, **model_kwargs) -> str:
    """Build tokenizer + randomly initialised Qwen2ForCausalLM (float32, safetensors) in out_dir.

    ``model_kwargs`` override MODEL_DEFAULTS (hidden_size, num_layers, num_attention_heads,
    num_key_value_heads, intermediate_size, max_position_embeddings, rope_theta,
    tie_word_embeddings, seed). The defaults give ~0.9M parameters. Returns out_dir as a string.
    """
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    out = Path(out_dir)
    tok = build_tokenizer(out)
    seed = {**MODEL_DEFAULTS, **model_kwargs}["seed"]
    config = _qwen2_config(len(tok), tok.eos_token_id, tok.pad_token_id, **model_kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None
    )
    model.save_pretrained(str(out), safe_serialization=True)
    # save_pretrained of the tokenizer again so its files sit next to the config
    tok.save_pretrained(str(out))
    return str(out)


# ----------------------------------------------------------------------------------------------
# SFT warm start


def sft_targets(task: str, rows: list[dict], correct_frac: float, seed: int) -> list[str]:
    """The SFT target of each row: the ground truth with probability ``correct_frac``, else the
    task's distractor (a systematic mistake), drawn independently per row with ``seed``."""
    from rlflow.data.synthetic import get_task

    spec = get_task(task)
    if correct_frac < 1.0 and spec.distractor is None:
        raise ValueError(f"task {task!r} has no distractor; use correct_frac=1.0")
    rng = random.Random(seed * 1_000_003 + 17)
    out = []
    for row in rows:
        truth = row["reward_model"]["ground_truth"]
        if correct_frac >= 1.0 or rng.random() < correct_frac:
            out.append(truth)
        else:
            out.append(spec.distractor(row["prompt"], truth))
    return out


def _encode_sft_rows(tok, rows, targets=None):
    eos = tok.eos_token_id
    examples = []
    for i, row in enumerate(rows):
        target = row["reward_model"]["ground_truth"] if targets is None else targets[i]
        p = tok.encode(row["prompt"], add_special_tokens=False)
        a = tok.encode(target, add_special_tokens=False) + [eos]
        examples.append((p, a))
    return examples


def _sft_batch(examples, pad_id):
    import torch

    width = max(len(p) + len(a) for p, a in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (p, a) in enumerate(examples):
        seq = p + a
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, len(p) : len(seq)] = torch.tensor(a)
        mask[i, : len(seq)] = 1
    return ids, mask, labels


# -- multi-turn (agent) warm start ---------------------------------------------------------------


def _agent_env(task: str):
    import importlib

    module, _, cls = AGENT_TASKS[task].rpartition(":")
    return getattr(importlib.import_module(module), cls)()


def _calc_demo(env, row: dict, use_tool: bool) -> tuple[list[str], list[str]]:
    """One episode of the calc demonstrator: (turns, observations after each turn but the last)."""
    from rlflow.data.synthetic import CALC_CALL_PREFIX, CALC_RESULT_PREFIX, get_task

    prompt, truth = row["prompt"], row["reward_model"]["ground_truth"]
    if not use_tool:
        answer = get_task("calc").distractor(prompt, truth)
        env.step(answer)
        return [answer], []
    call = CALC_CALL_PREFIX + prompt.rstrip("=")
    result = env.step(call)
    assert not result.done and result.observation.startswith(CALC_RESULT_PREFIX), result
    answer = result.observation[len(CALC_RESULT_PREFIX):]
    final = env.step(answer)
    assert final.done and final.info["acc"] == 1.0, (row, final)
    return [call, answer], [result.observation]


_DEMONSTRATORS = {"calc": _calc_demo}


def agent_demos(task: str, rows: list[dict], correct_frac: float, seed: int) -> list[dict]:
    """The demonstrator's episodes, one per row: {"prompt", "first_observation", "turns",
    "observations"} (``observations[i]`` follows ``turns[i]``; the last turn has none). An episode
    uses the tool with probability ``correct_frac`` (drawn per row with ``seed``), else answers at
    once with the task's distractor; observations come from the task's environment."""
    rng = random.Random(seed * 1_000_003 + 17)
    demos = []
    for row in rows:
        env = _agent_env(task)
        first = env.reset({"ground_truth": row["reward_model"]["ground_truth"],
                           "data_source": row["data_source"], "extra_info": row.get("extra_info", {}),
                           "raw_prompt": row["prompt"], "source_prompt": row["prompt"]})
        use_tool = correct_frac >= 1.0 or rng.random() < correct_frac
        turns, observations = _DEMONSTRATORS[task](env, row, use_tool)
        demos.append({"prompt": row["prompt"], "first_observation": first, "turns": turns,
                      "observations": observations})
    return demos


def encode_episode(tok, prompt: str, first_observation: str, turns: list[str],
                   observations: list[str]) -> tuple[list[int], list[int]]:
    """(ids, labels) of one episode laid out as the agent loop builds a trajectory: the prompt's ids
    (``tok(prompt)["input_ids"]``, as rlflow.data.dataset encodes a plain-string prompt), the first
    observation's ids if it is not empty, then per turn its ids + EOS (labels = the ids) and, but
    after the last turn, the observation's ids (labels -100)."""
    if len(observations) != len(turns) - 1:
        raise ValueError(f"{len(turns)} turns need {len(turns) - 1} observations, got {len(observations)}")
    eos = tok.eos_token_id
    ids = list(tok(prompt)["input_ids"])
    if first_observation:
        ids += tok.encode(first_observation, add_special_tokens=False)
    labels = [-100] * len(ids)
    for i, turn in enumerate(turns):
        t = tok.encode(turn, add_special_tokens=False) + [eos]
        ids += t
        labels += t
        if i < len(observations):
            o = tok.encode(observations[i], add_special_tokens=False)
            ids += o
            labels += [-100] * len(o)
    return ids, labels


def agent_sft_examples(tok, task: str, rows: list[dict], correct_frac: float, seed: int):
    """The SFT examples of a multi-turn task: (ids, labels) per row (see encode_episode)."""
    return [encode_episode(tok, d["prompt"], d["first_observation"], d["turns"], d["observations"])
            for d in agent_demos(task, rows, correct_frac, seed)]


def _sft_batch_labelled(examples, pad_id):
    import torch

    width = max(len(ids) for ids, _ in examples)
    ids_t = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels_t = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (ids, labels) in enumerate(examples):
        ids_t[i, : len(ids)] = torch.tensor(ids)
        labels_t[i, : len(ids)] = torch.tensor(labels)
        mask[i, : len(ids)] = 1
    return ids_t, mask, labels_t


def _run_sft(model, tok, task: str, task_kwargs: dict, sft: dict, log) -> dict:
    import torch

    from rlflow.data.synthetic import make_synthetic_rows

    rows = make_synthetic_rows(task, sft["num_rows"], seed=sft["seed"], split="train", **task_kwargs)
    if task in AGENT_TASKS:
        examples = agent_sft_examples(tok, task, rows, sft["correct_frac"], sft["seed"])
        collate = _sft_batch_labelled
    else:
        targets = sft_targets(task, rows, sft["correct_frac"], sft["seed"])
        examples = _encode_sft_rows(tok, rows, targets)
        collate = _sft_batch
    gen = torch.Generator().manual_seed(sft["seed"])
    opt = torch.optim.AdamW(
        model.parameters(), lr=sft["lr"], weight_decay=sft["weight_decay"], betas=(0.9, 0.98)
    )
    steps, bs, warm = sft["steps"], sft["batch_size"], max(sft["warmup_steps"], 1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
    model.train()
    order = torch.randperm(len(examples), generator=gen).tolist()
    pos = 0
    t0 = time.time()
    last = float("nan")
    for step in range(steps):
        if pos + bs > len(order):
            order = torch.randperm(len(examples), generator=gen).tolist()
            pos = 0
        batch = [examples[j] for j in order[pos : pos + bs]]
        pos += bs
        ids, mask, labels = collate(batch, tok.pad_token_id)
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        if sft["grad_clip"]:
            torch.nn.utils.clip_grad_norm_(model.parameters(), sft["grad_clip"])
        opt.step()
        sched.step()
        last = float(out.loss.detach())
        if log and (step + 1) % max(1, steps // 5) == 0:
            log(f"[rlflow] warm start {task}: step {step + 1}/{steps} loss {last:.4f} "
                f"({time.time() - t0:.0f}s)")
    model.eval()
    return {"final_loss": last, "seconds": time.time() - t0}


def _cache_key(task: str, task_kwargs: dict, model_kwargs: dict, sft: dict) -> str:
    blob = json.dumps(
        {
            "code_version": CODE_VERSION,
            "task": task,
            "task_kwargs": task_kwargs,
            "model": model_kwargs,
            "sft": sft,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _ensure_chat_template(folder: Path) -> None:
    """Give a cached warm start the current CHAT_TEMPLATE. Entries built before the tiny tokenizer
    had a template lack it; the template changes no weight and no token id of a plain-string prompt,
    so the entry is upgraded in place (one file, written beside and renamed: atomic for concurrent
    readers) rather than keyed anew and retrained."""
    path = folder / "chat_template.jinja"
    try:
        if path.is_file() and path.read_text(encoding="utf-8") == CHAT_TEMPLATE:
            return
        tmp = folder / f".chat_template.jinja.{os.getpid()}.tmp"
        tmp.write_text(CHAT_TEMPLATE, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as err:  # a read-only cache: chat rows then fail naming the missing template
        print(f"[rlflow] warm start {folder}: cannot add the chat template ({err})", file=sys.stderr)


def warm_start(
    task: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    *,
    model: dict | None = None,
    task_kwargs: dict | None = None,
    verbose: bool = True,
    **sft_kwargs,
) -> str:
    """Return a model folder for ``task``: tiny Qwen2 + tokenizer, SFT-ed on synthetic train rows.

    ``sft_kwargs`` override SFT_DEFAULTS (steps, batch_size, lr, warmup_steps, weight_decay,
    num_rows, seed, grad_clip, correct_frac), themselves overridden for the task by
    TASK_SFT_DEFAULTS; ``model`` overrides MODEL_DEFAULTS; ``task_kwargs`` are passed to
    the task generator. The folder is ``<cache>/warm/<task>-<hash>``, the hash covering all of
    these and CODE_VERSION; if it exists it is returned at once. It is written to a temporary
    folder beside it and renamed into place, so an interrupted run leaves no partial folder.
    """
    from rlflow.data.synthetic import DEFAULT_TASK, get_task

    task = get_task(task or DEFAULT_TASK).name
    tkw = get_task(task).kwargs(**(task_kwargs or {}))
    unknown = set(sft_kwargs) - set(SFT_DEFAULTS)
    if unknown:
        raise TypeError(f"unknown SFT option(s) {sorted(unknown)}; known: {sorted(SFT_DEFAULTS)}")
    sft = {**SFT_DEFAULTS, **TASK_SFT_DEFAULTS.get(task, {}), **sft_kwargs}
    mkw = {**MODEL_DEFAULTS, **(model or {})}
    _qwen2_config(300, 0, 1, **mkw)  # validate the model options before doing any work

    root = cache_root(cache_dir) / "warm"
    final = root / f"{task}-{_cache_key(task, tkw, mkw, sft)}"
    if (final / "config.json").is_file():
        _ensure_chat_template(final)
        return str(final)

    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if verbose else None
    root.mkdir(parents=True, exist_ok=True)
    # another process finishing the same entry first keeps its folder
    with building_dir(final, is_complete=lambda folder: (folder / "config.json").is_file()) as tmp:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        t0 = time.time()
        if log:
            log(f"[rlflow] warm start {task}: building tiny model, SFT {sft['steps']} steps "
                f"-> {final}")
        build_tiny_model(tmp, **mkw)
        tok = AutoTokenizer.from_pretrained(str(tmp))
        lm = AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.float32)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(sft["seed"])
            info = _run_sft(lm, tok, task, tkw, sft, log)
        lm.save_pretrained(str(tmp), safe_serialization=True)
        meta = {
            "code_version": CODE_VERSION,
            "task": task,
            "task_kwargs": tkw,
            "model": mkw,
            "sft": sft,
            "final_loss": info["final_loss"],
            "sft_seconds": round(info["seconds"], 2),
        }
        (tmp / "rlflow_warm_start.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
    if log:
        log(f"[rlflow] warm start {task}: done in {time.time() - t0:.0f}s "
            f"(final loss {info['final_loss']:.4f})")
    return str(final)


# ----------------------------------------------------------------------------------------------
# evaluation helper (used by the scripts and tests; the framework has its own validation)


def evaluate_exact_match(
    model,
    tok,
    rows: list[dict],
    *,
    do_sample: bool = False,
    temperature: float = 1.0,
    max_new_tokens: int = 16,
    batch_size: int = 128,
    seed: int = 0,
) -> float:
    """Fraction of rows whose generated answer (decoded, special tokens skipped) is exact."""
    import torch

    from rlflow.rewards.synthetic import compute_score

    hits = 0.0
    tok.padding_side = "left"
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for i in range(0, len(rows), batch_size):
            chunk = rows[i : i + batch_size]
            enc = tok([r["prompt"] for r in chunk], return_tensors="pt", padding=True,
                      add_special_tokens=False)
            out = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                do_sample=do_sample,
                temperature=temperature if do_sample else None,
                top_k=0 if do_sample else None,
                top_p=1.0 if do_sample else None,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
            texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            for r, t in zip(chunk, texts):
                hits += compute_score(r["data_source"], t, r["reward_model"]["ground_truth"])["acc"]
    return hits / max(len(rows), 1)
