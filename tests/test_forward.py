"""workers/forward.py: the response log-probs every role computes, against a plain full forward.

The forward trims the columns that are padding in every row and asks a causal LM for the logits
of the response-predicting columns only (`logits_to_keep`); both must leave each response token's
log-prob and entropy what a forward over the whole padded sequence gives.
"""

from __future__ import annotations

import pytest
import torch

from rlflow.algos import entropy_from_logits
from rlflow.protocol import assemble_rollout, left_pad
from workers.forward import response_log_probs

PROMPTS = [[5, 6, 7], [8], [9, 10, 11, 12, 13], [14, 15]]
RESPONSES = [[20, 21, 22, 0], [23], [24, 25], [26, 27, 28, 29, 30, 31]]
MAX_RESPONSE = 8  # wider than every response: the right padding is trimmed too


def _batch():
    ids, mask = left_pad(PROMPTS, pad_token_id=1)
    # two pad columns on the left of every row: trimmed
    ids = torch.cat([torch.ones(ids.shape[0], 2, dtype=ids.dtype), ids], dim=1)
    mask = torch.cat([torch.zeros(mask.shape[0], 2, dtype=mask.dtype), mask], dim=1)
    return assemble_rollout(ids, mask, RESPONSES, 1, MAX_RESPONSE, pad_token_id=1, eos_token_id=0)


def _reference(model, batch, temperature):
    """Each response token's log-prob and entropy from one forward over every column."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"], use_cache=False).logits.float() / temperature
    prompt_width, width = batch["prompts"].shape[1], batch["responses"].shape[1]
    logits = logits[:, prompt_width - 1 : prompt_width - 1 + width]
    log_probs = torch.log_softmax(logits, -1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    return log_probs, entropy_from_logits(logits)


def _head_columns(model):
    """Records the number of columns the vocabulary projection is applied to, per call."""
    seen = []
    model.get_output_embeddings().register_forward_hook(lambda module, args, out: seen.append(args[0].shape[1]))
    return seen


@pytest.mark.parametrize("wrap", ["plain", "lora"])
def test_response_log_probs_equal_a_full_forward_and_project_only_response_columns(tiny_model_dir, wrap):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    torch.manual_seed(0)
    with torch.no_grad():  # not the identity: a perturbed model, so no prediction is trivially equal
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    if wrap == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 init_lora_weights=False))
    batch = _batch()
    mask = batch["response_mask"].bool()
    seen = _head_columns(model.get_base_model() if wrap == "lora" else model)
    want_log_probs, want_entropy = _reference(model, batch, 0.7)
    seen.clear()
    with torch.no_grad():
        log_probs, entropy = response_log_probs(model, batch, 0.7, with_entropy=True)
    longest_response = max(len(r) for r in RESPONSES)
    assert seen == [longest_response + 1], f"the head saw {seen} columns; the responses need {longest_response} (+1)"
    assert log_probs.shape == entropy.shape == batch["responses"].shape
    assert torch.allclose(log_probs[mask], want_log_probs[mask], atol=1e-5, rtol=0)
    assert torch.allclose(entropy[mask], want_entropy[mask], atol=1e-5, rtol=0)
    # the trimmed columns (padding in every row) come back as zeros
    assert (log_probs[:, longest_response:] == 0).all() and (entropy[:, longest_response:] == 0).all()


# -- the shared-prompt forward (<role>.model.share_prompt_forward) ---------------------------------

GROUP_PROMPTS = [[5, 6, 7], [8], [9, 10, 11, 12, 13]]
# 3 responses per prompt, of different lengths (one empty after trimming at EOS 0)
GROUP_RESPONSES = [[20, 21, 22, 0], [23], [24, 25, 26, 27, 28, 29],
                   [30, 0], [31, 32, 33], [0],
                   [34, 35], [36, 37, 38, 39, 40, 41, 42], [43]]


def _grouped_batch(order=None):
    ids, mask = left_pad(GROUP_PROMPTS, pad_token_id=1)
    batch = assemble_rollout(ids, mask, GROUP_RESPONSES, 3, MAX_RESPONSE, pad_token_id=1, eos_token_id=0)
    return batch if order is None else batch[torch.tensor(order)]


def _perturbed(model):
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model


def _causal_lm(tiny_model_dir, attention="sdpa", wrap="plain"):
    from transformers import AutoModelForCausalLM

    from workers.forward import use_shared_prompt_sdpa

    loaded_as = "sdpa" if attention == "shared_prompt_sdpa" else attention
    model = _perturbed(AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=loaded_as))
    if attention == "shared_prompt_sdpa":  # as share_prompt_setting switches a role's sdpa model
        use_shared_prompt_sdpa(model)
    if wrap == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 init_lora_weights=False))
    return model


def _sequences_seen(model):
    """Records the [rows, columns] of every input the embedding layer sees."""
    seen = []
    model.get_input_embeddings().register_forward_hook(lambda module, args, out: seen.append(tuple(args[0].shape)))
    return seen


def _log_prob_gradients(model, batch, share_prompt):
    model.zero_grad(set_to_none=True)
    log_probs, entropy = response_log_probs(model, batch, 0.7, with_entropy=True, share_prompt=share_prompt)
    mask = batch["response_mask"]
    (-(log_probs * mask).sum() + 0.1 * (entropy * mask).sum()).backward()
    grads = {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}
    return log_probs.detach(), entropy.detach(), grads


@pytest.mark.parametrize("attention,wrap", [("sdpa", "plain"), ("eager", "plain"), ("sdpa", "lora"),
                                            ("shared_prompt_sdpa", "plain"), ("shared_prompt_sdpa", "lora")])
def test_a_shared_prompt_forward_equals_the_plain_forward_and_runs_each_prompt_once(tiny_model_dir, attention, wrap):
    model = _causal_lm(tiny_model_dir, attention, wrap)
    # the rows of a prompt need not be adjacent: row order 0 3 6 1 4 7 2 5 8 interleaves the groups
    batch = _grouped_batch([0, 3, 6, 1, 4, 7, 2, 5, 8])
    mask = batch["response_mask"].bool()
    want_log_probs, want_entropy, want_grads = _log_prob_gradients(model, batch, share_prompt=False)
    seen = _sequences_seen(model.get_base_model() if wrap == "lora" else model)
    log_probs, entropy, grads = _log_prob_gradients(model, batch, share_prompt=True)
    # one sequence per prompt: the trimmed prompt (5 columns) then its 3 responses' real tokens
    assert seen[0][0] == len(GROUP_PROMPTS), seen
    assert seen[0][1] == 5 + max(sum(min(len(r), MAX_RESPONSE) for r in GROUP_RESPONSES[3 * p : 3 * p + 3])
                                 for p in range(3)), seen
    assert torch.allclose(log_probs[mask], want_log_probs[mask], atol=1e-5, rtol=0)
    assert torch.allclose(entropy[mask], want_entropy[mask], atol=1e-5, rtol=0)
    assert torch.isfinite(log_probs).all() and torch.isfinite(entropy).all()
    assert grads.keys() == want_grads.keys() and grads
    for name, grad in grads.items():
        scale = want_grads[name].abs().max()
        assert torch.allclose(grad, want_grads[name], atol=1e-5 * float(scale), rtol=0), name


@pytest.mark.parametrize("attention", ["sdpa", "shared_prompt_sdpa"])
def test_a_shared_prompt_value_forward_equals_the_plain_one(tiny_model_dir, attention):
    from workers.critic import load_value_model
    from workers.forward import response_values, use_shared_prompt_sdpa

    model = _perturbed(load_value_model(tiny_model_dir, "float32"))
    if attention == "shared_prompt_sdpa":
        use_shared_prompt_sdpa(model)
    batch = _grouped_batch([8, 0, 4, 1, 5, 2, 6, 3, 7])
    mask = batch["response_mask"].bool()
    for share_prompt in (False, True):
        model.zero_grad(set_to_none=True)
        values = response_values(model, batch, share_prompt)
        (values * mask).square().sum().backward()
        if not share_prompt:
            want_values, want_grad = values.detach(), model.score.weight.grad.clone()
    assert torch.allclose(values[mask], want_values[mask], atol=1e-5, rtol=0)
    assert torch.allclose(model.score.weight.grad, want_grad, atol=1e-5 * float(want_grad.abs().max()), rtol=0)


@pytest.mark.parametrize("attention", ["sdpa", "shared_prompt_sdpa"])
def test_without_a_repeated_prompt_the_shared_prompt_forward_is_the_plain_one_bitwise(tiny_model_dir, attention):
    model = _causal_lm(tiny_model_dir, attention)
    batch = _grouped_batch([0, 3, 6])  # one row of each prompt
    with torch.no_grad():
        plain = response_log_probs(model, batch, 0.7, with_entropy=True)
        shared = response_log_probs(model, batch, 0.7, with_entropy=True, share_prompt=True)
    assert torch.equal(plain[0], shared[0]) and torch.equal(plain[1], shared[1])


def test_micro_batches_keep_a_prompts_rows_together_only_when_asked():
    from rlflow.protocol import grouped_by_prompt, plan_micro_batches, prompt_groups

    batch = _grouped_batch([0, 3, 6, 1, 4, 7, 2, 5, 8])
    assert prompt_groups(batch).tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2]
    assert grouped_by_prompt(batch).tolist() == [0, 3, 6, 1, 4, 7, 2, 5, 8]
    grouped = plan_micro_batches(batch, micro_batch_size=3, group_prompts=True)
    assert [idx.tolist() for idx in grouped] == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    plain = plan_micro_batches(batch, micro_batch_size=3)
    assert [idx.tolist() for idx in plain] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    distinct = _grouped_batch([0, 3, 6])  # no prompt repeats: the order is kept
    assert grouped_by_prompt(distinct).tolist() == [0, 1, 2]


@pytest.mark.parametrize("share", [True, False])
def test_the_driver_gives_each_dp_rank_whole_prompt_groups_when_the_forward_shares_them(share):
    """The driver's plan at actor.dp_size=2, one mini-batch of 8 prompts x 4 responses: with
    actor.model.share_prompt_forward each rank's shard holds 4 whole groups (its forward runs 4
    prompts); without it the shuffled rows are cut as they come. The BatchMeta is the same."""
    from controllers.ppo import PPOTrainer
    from rlflow import load_config
    from rlflow.protocol import get_meta

    ids, mask = left_pad([[5 + p, 30 + p] for p in range(8)], pad_token_id=1)
    batch = assemble_rollout(ids, mask, [[40 + i % 5] * (1 + i % 3) for i in range(32)], 4, 4,
                             pad_token_id=1, eos_token_id=0)
    cfg = load_config(None, ["data.train_batch_size=8", "actor.ppo_mini_batch_size=32", "actor.dp_size=2",
                             "actor.ppo_micro_batch_size_per_gpu=4", f"actor.model.share_prompt_forward={share}"])
    (rank0,), (rank1,) = PPOTrainer(cfg).plan_minibatches(batch, "actor", step=0)
    prompts = [{tuple(row.tolist()) for row in shard["prompts"]} for shard in (rank0, rank1)]
    rows = sorted(tuple(row.tolist()) for shard in (rank0, rank1) for row in shard["input_ids"])
    assert rows == sorted(tuple(row.tolist()) for row in batch["input_ids"]), "every row once"
    if share:
        assert [len(p) for p in prompts] == [4, 4] and not prompts[0] & prompts[1]
    else:
        assert min(len(p) for p in prompts) > 4, "the shuffled rows happened to hold whole groups"
    meta = get_meta(rank0)
    assert (meta.batch_num_tokens, meta.global_batch_size) == (int(batch["response_mask"].sum()), 32)


def test_a_model_that_cannot_take_the_mask_runs_the_plain_forward_and_says_which_key(tiny_model_dir, caplog):
    from transformers import AutoConfig, AutoModelForCausalLM

    from workers.forward import share_prompt_setting

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.use_sliding_window, config.sliding_window = True, 4
    windowed = AutoModelForCausalLM.from_config(config)
    assert windowed.config.sliding_window == 4
    with caplog.at_level("WARNING", logger="workers.forward"):
        assert share_prompt_setting(windowed, True, "actor.model.share_prompt_forward") is False
    assert "actor.model.share_prompt_forward" in caplog.text
    assert share_prompt_setting(_causal_lm(tiny_model_dir), True, "actor.model.share_prompt_forward") is True
    assert share_prompt_setting(_causal_lm(tiny_model_dir), False, "actor.model.share_prompt_forward") is False


def test_long_responses_behind_a_short_prompt_take_the_plain_forward(tiny_model_dir):
    """Packing 2 responses of 40 tokens behind a 1-token prompt saves one token's projections and MLP
    and adds 2 x 40 x 40 attention pairs (81^2 against 2 x 41^2): the cost rule keeps the plain forward."""
    model = _causal_lm(tiny_model_dir)
    ids, mask = left_pad([[5]], pad_token_id=1)
    responses = [list(range(10, 50)), list(range(50, 90))]
    batch = assemble_rollout(ids, mask, responses, 2, 48, pad_token_id=1, eos_token_id=0)
    seen = _sequences_seen(model)
    with torch.no_grad():
        plain = response_log_probs(model, batch, 1.0)[0]
        shared = response_log_probs(model, batch, 1.0, share_prompt=True)[0]
    assert seen == [(2, 41), (2, 41)], seen
    assert torch.equal(plain, shared)
    # the same prompt with short responses is packed: one sequence
    short = assemble_rollout(ids, mask, [[10, 11, 12], [13, 14]], 2, 48, pad_token_id=1, eos_token_id=0)
    seen.clear()
    with torch.no_grad():
        response_log_probs(model, short, 1.0, share_prompt=True)
    assert seen == [(1, 1 + 3 + 2)], seen


def test_shared_prompt_sdpa_packs_long_responses_too_and_computes_only_a_row_s_own_pairs(tiny_model_dir):
    """The batch the cost rule keeps plain on sdpa: shared_prompt_sdpa packs it (one sequence), with
    the plain forward's log-probs, and its attention calls see the prompt alone, then each row's
    prompt and response (2 rows x 41 keys), never the packed length's 81."""
    import torch.nn.functional as F

    model = _causal_lm(tiny_model_dir, "shared_prompt_sdpa")
    ids, mask = left_pad([[5]], pad_token_id=1)
    batch = assemble_rollout(ids, mask, [list(range(10, 50)), list(range(50, 90))], 2, 48, pad_token_id=1,
                             eos_token_id=0)
    seen, keys = _sequences_seen(model), []
    original = F.scaled_dot_product_attention

    def recording(query, key, *args, **kwargs):
        keys.append(tuple(key.shape[::2]))  # (rows, keys)
        return original(query, key, *args, **kwargs)

    with torch.no_grad():
        plain = response_log_probs(model, batch, 1.0)[0]
        F.scaled_dot_product_attention = recording
        try:
            shared = response_log_probs(model, batch, 1.0, share_prompt=True)[0]
        finally:
            F.scaled_dot_product_attention = original
    assert seen == [(2, 41), (1, 81)], seen
    layers = model.config.num_hidden_layers
    assert keys == [(1, 1), (2, 41)] * layers, keys
    assert torch.allclose(shared, plain, atol=1e-5, rtol=0)


def test_on_cpu_bfloat16_attention_runs_in_float32_and_returns_bfloat16(tiny_model_dir):
    """shared_prompt_sdpa's attention of bfloat16 inputs on CPU: float32 attention of the same
    (exactly widened) inputs, rounded once to bfloat16, and a bfloat16 gradient."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from workers.forward import shared_prompt_sdpa

    model = _causal_lm(tiny_model_dir, "shared_prompt_sdpa")
    module = model.model.layers[0].self_attn
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    query = torch.randn(2, heads, 5, 8, generator=gen).to(torch.bfloat16).requires_grad_()
    key, value = (torch.randn(2, kv_heads, 5, 8, generator=gen).to(torch.bfloat16).requires_grad_() for _ in range(2))
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    out, _ = shared_prompt_sdpa(module, query, key, value, mask, scaling=0.5)
    want, _ = sdpa_attention_forward(module, query.float(), key.float(), value.float(), mask, scaling=0.5)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want.to(torch.bfloat16))
    out.float().sum().backward()
    assert query.grad.dtype == key.grad.dtype == torch.bfloat16
