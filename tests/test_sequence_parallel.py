"""workers/sequence.py: packed micro-batches and Ulysses sequence parallelism, against the padded
forward of one process.

The sp runs are real torch.distributed process groups (gloo, one process per sp rank). Every
rank computes the same loss over the gathered outputs; summed over the sp ranks, the parameter
gradients are sp times the padded forward's (the data-parallel mean over dp x sp ranks divides the
sp back out: tests/test_exactness.py checks that through real fits). The micro-batches include a
packed row whose length sp does not divide, a rank whose slice holds only prompt tokens, and a
rank whose slice holds only the padding that rounds the row up to a multiple of sp.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from rlflow.protocol import assemble_rollout, balanced_partition, left_pad, plan_micro_batches
from workers.base import free_port
from workers.forward import response_log_probs, response_values
from workers.sequence import PADDED, SequenceLayout, head_split, pack_micro_batch, use_packed_attention

# (prompts, responses) per micro-batch; max_response_length 6
CASES = {
    # varied lengths, an EOS (0) mid-row: the packed row is 23 tokens (not divisible by 2 or 3)
    "varied": ([[5, 6, 7], [8], [9, 10, 11, 12, 13], [14, 15]], [[20, 21, 22, 0], [23], [24, 25], [26, 27, 28, 29, 30]]),
    # one row, a long prompt and a 1-token response: the first ranks' slices hold only prompt tokens
    "prompt_only_slices": ([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14]], [[30]]),
    # 2 tokens in all: at sp=3 the last rank's slice is only the padding to a multiple of sp
    "padding_only_slice": ([[5]], [[31]]),
    # one long sequence and three short ones: padded to the longest they would be mostly padding, so
    # the attention runs per sequence (the other cases run one batched call)
    "one_long_three_short": ([[5] * 16, [6], [7], [8]], [[20, 21, 22, 23, 24, 25], [26], [27], [28]]),
}
SP_SIZES = (2, 3)


def _batch(name):
    prompts, responses = CASES[name]
    ids, mask = left_pad(prompts, pad_token_id=1)
    return assemble_rollout(ids, mask, responses, 1, 6, pad_token_id=1, eos_token_id=0)


def _perturbed(model):
    torch.manual_seed(0)
    with torch.no_grad():  # not the identity: no prediction is trivially equal
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model.train()


def _outputs(model, critic, batch, layout):
    """Log-probs, entropy and values of every response token, and the gradients of a loss that
    reads all three (a weighted sum over the response mask)."""
    mask = batch["response_mask"].float()
    model.zero_grad(set_to_none=True)
    critic.zero_grad(set_to_none=True)
    log_probs, entropy = response_log_probs(model, batch, 0.7, with_entropy=True, layout=layout)
    values = response_values(critic, batch, layout=layout)
    weights = torch.linspace(0.5, 1.5, mask.shape[1])
    ((log_probs * weights + 0.3 * entropy + values ** 2) * mask).sum().backward()
    grads = {f"actor.{n}": p.grad.clone() for n, p in model.named_parameters()}
    grads.update({f"critic.{n}": p.grad.clone() for n, p in critic.named_parameters()})
    return {"log_probs": log_probs.detach(), "entropy": entropy.detach(), "values": values.detach(), "grads": grads}


def _models(model_dir):
    from transformers import AutoModelForCausalLM

    from workers.critic import load_value_model

    torch.manual_seed(1)  # the value head is initialised at load
    return _perturbed(AutoModelForCausalLM.from_pretrained(model_dir)), _perturbed(load_value_model(model_dir, "float32"))


def _sp_rank(rank: int, sp_size: int, port: int, model_dir: str, out_dir: str) -> None:
    import torch.distributed as dist

    from workers.sequence import sequence_parallel_groups

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=sp_size)
    try:
        model, critic = _models(model_dir)
        use_packed_attention(model)
        use_packed_attention(critic)
        layout = SequenceLayout(packs=True, sp=sequence_parallel_groups(rank, sp_size, sp_size))
        slices = {name: pack_micro_batch(_batch(name), layout.sp) for name in CASES}
        results = {name: _outputs(model, critic, _batch(name), layout) for name in CASES}
        torch.save({"results": results, "slices": {n: (p.input_ids.shape[1], p.padding, p.keep.numel())
                                                   for n, p in slices.items()}},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def padded(tiny_model_dir):
    model, critic = _models(tiny_model_dir)
    return {name: _outputs(model, critic, _batch(name), PADDED) for name in CASES}


def _assert_matches(got, want, name, sum_of_grads=1):
    mask = _batch(name)["response_mask"].bool()
    for key in ("log_probs", "entropy", "values"):
        torch.testing.assert_close(got[key][mask], want[key][mask], rtol=0, atol=1e-5, msg=lambda m: f"{name} {key}: {m}")
    # relative to the role's largest gradient entry, not the tensor's own: a tensor whose gradient
    # is zero in exact arithmetic (layer 0's q_proj when every prediction attends to one token)
    # holds only rounding noise, which differs between the layouts
    role_scale = {role: max(float(g.abs().max()) for p, g in want["grads"].items() if p.startswith(role))
                  for role in ("actor.", "critic.")}
    for param, grad in want["grads"].items():
        scale = role_scale[param[: param.index(".") + 1]]
        torch.testing.assert_close(got["grads"][param] / sum_of_grads, grad, rtol=1e-4, atol=1e-5 * scale,
                                   msg=lambda m: f"{name} {param}: {m}")


def test_packed_forward_equals_the_padded_one(tiny_model_dir, padded):
    model, critic = _models(tiny_model_dir)
    use_packed_attention(model)
    use_packed_attention(critic)
    for name in CASES:
        got = _outputs(model, critic, _batch(name), SequenceLayout(packs=True))
        _assert_matches(got, padded[name], name)
        mask = _batch(name)["response_mask"].bool()
        assert (got["log_probs"][~mask] == 0).all() and (got["values"][~mask] == 0).all()


def test_pack_plan_maps_every_response_token_to_its_predictor():
    batch = _batch("varied")
    packed = pack_micro_batch(batch)
    valid = batch["attention_mask"].bool()
    assert packed.packed_length == int(valid.sum()) == 23 and packed.padding == 0
    assert packed.boundaries.tolist() == [0, 7, 9, 16, 23]
    # restarting positions, the rows' own
    assert packed.position_ids[0].tolist() == [i for n in (7, 2, 7, 7) for i in range(n)]
    response_valid = batch["attention_mask"][:, batch["prompts"].shape[1]:].bool()
    assert sorted(zip(packed.rows.tolist(), packed.columns.tolist())) == sorted(map(tuple, response_valid.nonzero().tolist()))
    # the predictor of each response token is the token before it in its row
    for row, column, keep in zip(packed.rows.tolist(), packed.columns.tolist(), packed.keep.tolist()):
        assert packed.input_ids[0, keep + 1] == batch["responses"][row, column]


@pytest.mark.parametrize("sp_size", SP_SIZES)
def test_sequence_parallel_forward_and_gradient_equal_the_padded_one(tiny_model_dir, padded, tmp_path, sp_size):
    mp.start_processes(_sp_rank, args=(sp_size, free_port(), tiny_model_dir, str(tmp_path)), nprocs=sp_size,
                       start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(sp_size)]
    for name in CASES:
        for rank in ranks:  # every rank of the group holds every output
            for key in ("log_probs", "entropy", "values"):
                assert torch.equal(rank["results"][name][key], ranks[0]["results"][name][key])
        summed = {**ranks[0]["results"][name],
                  "grads": {p: sum(r["results"][name]["grads"][p] for r in ranks) for p in padded[name]["grads"]}}
        _assert_matches(summed, padded[name], name, sum_of_grads=sp_size)
    # the edge cases are what they claim: (slice length, padding, response tokens predicted) per rank
    slices = {name: [r["slices"][name] for r in ranks] for name in CASES}
    assert all(padding == (-23) % sp_size for _, padding, _ in slices["varied"])
    prompt_only = slices["prompt_only_slices"]  # 11 tokens: the response token is predicted by the last slice
    assert [keep for _, _, keep in prompt_only] == [0] * (sp_size - 1) + [1]
    if sp_size == 3:
        assert slices["padding_only_slice"] == [(1, 1, 1), (1, 1, 0), (1, 1, 0)]


def test_both_attention_paths_run(monkeypatch):
    """varlen_attention's batched call (sequences right-padded to the longest) and its call per
    sequence (when that padding would outweigh the tokens) are what the cases above exercise."""
    from workers.sequence import _sdpa_per_sequence

    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def counting(q, *args, **kwargs):
        calls.append(q.shape[0])
        return real(q, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    for name, batched in (("varied", True), ("one_long_three_short", False)):
        packed = pack_micro_batch(_batch(name))
        x = torch.randn(1, 2, packed.packed_length, 4)
        calls.clear()
        _sdpa_per_sequence(x, x, x, packed.boundaries, None)
        assert calls == ([4] if batched else [1] * 4), (name, calls)


def test_heads_split_as_evenly_as_possible():
    assert head_split(4, 2) == [2, 2] and head_split(4, 3) == [2, 1, 1] and head_split(9, 2) == [5, 4]


def test_token_budget_packs_micro_batches_to_the_budget():
    """Under use_dynamic_bsz a micro-batch's rows hold at most the budget of real tokens (prompt +
    response): exactly the packed row's length, whatever the padded width would be."""
    prompts = [[5] * n for n in (3, 9, 1, 6, 2, 8, 4, 7)]
    responses = [[20] * n for n in (6, 1, 5, 2, 6, 3, 4, 1)]
    ids, mask = left_pad(prompts, pad_token_id=1)
    batch = assemble_rollout(ids, mask, responses, 1, 6, pad_token_id=1, eos_token_id=0)
    budget = 24
    micro = plan_micro_batches(batch, max_token_len=budget)
    lengths = [pack_micro_batch(batch[idx]).packed_length for idx in micro]
    assert sum(lengths) == int(batch["attention_mask"].sum()) and max(lengths) <= budget
    # the fewest balanced micro-batches that keep to it: one fewer would overflow it
    weights = batch["attention_mask"].sum(-1).tolist()
    fewer = balanced_partition(weights, len(micro) - 1)
    assert max(sum(weights[r] for r in part) for part in fewer) > budget


def test_more_sp_ranks_than_attention_heads_is_an_error_naming_the_key(tiny_model_dir):
    from conftest import tiny_overrides
    from rlflow.config import load_config, to_dataclass
    from workers.actor import ActorWorker

    cfg = to_dataclass(load_config(None, tiny_overrides(tiny_model_dir, **{"actor.sp_size": 8})))
    with pytest.raises(ValueError, match=r"actor\.sp_size=8: the model has 4 attention heads"):
        ActorWorker(cfg, 0, 8).init_model(tiny_model_dir, 1)
