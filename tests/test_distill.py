"""On-policy distillation (actor.distill, the teacher role): the term's gradient by hand, the
config's errors before Ray starts, the teacher's log-probs reaching the loss, one step's direction
on real models, and a fit through the driver. (Split invariance: tests/test_algos_invariance.py;
the float64 formulas in the composed actor loss: tests/test_loss_composition.py.)"""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import tiny_overrides
from controllers.ppo import PPOTrainer
from controllers.roles import enabled_roles, resolve_roles
from rlflow import load_config
from rlflow.algos import LOSS_TERMS, DistillOptions, kl_penalty
from rlflow.algos.terms import actor_loss_terms
from rlflow.config import ConfigError, to_dataclass
from rlflow.protocol import assemble_rollout

F64 = torch.float64


# ------------------------------------------------------------------------------- the term by hand


def _term_inputs(rows=4, width=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    log_probs = (torch.randn(rows, width, generator=gen, dtype=F64) * 0.5 - 1.0).requires_grad_(True)
    teacher = log_probs.detach() + torch.randn(rows, width, generator=gen, dtype=F64) * 0.7
    mask = torch.ones(rows, width, dtype=F64)
    mask[1, 3:] = 0
    mask[2, 1:] = 0
    return log_probs, teacher, mask


@pytest.mark.parametrize("kl_type", ["k3", "k1", "k2"])
def test_distill_on_policy_gradient_by_hand(kl_type):
    """On-policy (old = the detached log-probs: the ratio is 1, its gradient grad log pi) the term's
    value is coef * the mean estimate and its gradient per token coef * (k' + k) / N: for k3
    exactly (log pi - log pi_teacher) / N, the per-token reverse KL's policy gradient; for k1
    (1 + k1) / N; for k2 (k1 + k2) / N."""
    log_probs, teacher, mask = _term_inputs()
    coef, count = 0.7, mask.sum()
    options = DistillOptions(coef=coef, kl_type=kl_type)
    batch = {"log_probs": log_probs, "old_log_probs": log_probs.detach(), "teacher_log_prob": teacher,
             "response_mask": mask}
    loss, metrics = LOSS_TERMS["distill_loss"].fn(batch, None, options)
    loss.backward()
    d = (log_probs - teacher).detach()
    estimate = kl_penalty(log_probs.detach(), teacher, kl_type)
    assert float(loss.detach()) == pytest.approx(coef * float((estimate * mask).sum() / count), rel=1e-12)
    per_token = {"k3": d, "k1": 1.0 + d, "k2": d + 0.5 * d * d}[kl_type]
    torch.testing.assert_close(log_probs.grad, coef * per_token * mask / count, rtol=1e-12, atol=1e-15)
    assert metrics["distill_reverse_kl"].value == pytest.approx(float((d * mask).sum() / count), rel=1e-12)
    assert metrics["distill_loss"].value == pytest.approx(float(loss.detach()) / coef, rel=1e-12)


def test_distill_off_policy_is_importance_weighted():
    """Off-policy (old != current) the estimate is weighted by rho = pi / pi_old, which carries the
    score-function gradient: value rho * k, gradient rho * (k' + k)."""
    log_probs, teacher, mask = _term_inputs(seed=1)
    old = log_probs.detach() + 0.3
    options = DistillOptions(coef=1.0, kl_type="k3")
    batch = {"log_probs": log_probs, "old_log_probs": old, "teacher_log_prob": teacher, "response_mask": mask}
    loss, _ = LOSS_TERMS["distill_loss"].fn(batch, None, options)
    loss.backward()
    rho = torch.exp(log_probs.detach() - old)
    d = (log_probs - teacher).detach()
    k3 = kl_penalty(log_probs.detach(), teacher, "k3")
    assert float(loss.detach()) == pytest.approx(float((rho * k3 * mask).sum() / mask.sum()), rel=1e-12)
    torch.testing.assert_close(log_probs.grad, rho * d * mask / mask.sum(), rtol=1e-12, atol=1e-15)


# ------------------------------------------------------------------------------------- the config


def _section(**fields):
    from types import SimpleNamespace

    from rlflow.config import ActorConfig, DistillConfig

    actor = ActorConfig()
    return SimpleNamespace(**{**vars(actor), "loss_scale_factor": 8.0, "distill": DistillConfig(**fields)})


def test_distill_topk_forward_kl_gradient_by_hand():
    """The top-k term (actor.distill.top_k): per token sum_j q_j (log q_j - log pi_j), q the
    teacher's top k renormalised; token-mean over the mask; its gradient with respect to the
    actor's log-probs of those tokens is -q_j / N, and the value is >= 0 (the actor's mass on the k
    tokens is below 1)."""
    gen = torch.Generator().manual_seed(5)
    rows, width, k = 3, 4, 5
    actor_logits = torch.randn(rows, width, 9, generator=gen, dtype=F64) * 1.5
    log_pi = torch.log_softmax(actor_logits, dim=-1)[..., :k].clone().requires_grad_(True)
    teacher = torch.randn(rows, width, k, generator=gen, dtype=F64) - 2.0
    mask = torch.ones(rows, width, dtype=F64)
    mask[0, 2:] = 0
    options = LOSS_TERMS["distill_topk_loss"].options(coef=0.3, loss_agg_mode="token-mean")
    batch = {"topk_log_probs": log_pi, "teacher_topk_log_probs": teacher, "response_mask": mask}
    loss, metrics = LOSS_TERMS["distill_topk_loss"].fn(batch, None, options)
    loss.backward()
    q = torch.softmax(teacher, dim=-1)
    per_token = (q * (q.log() - log_pi.detach())).sum(-1)
    count = mask.sum()
    assert float(loss) == pytest.approx(0.3 * float((per_token * mask).sum() / count), rel=1e-12)
    torch.testing.assert_close(log_pi.grad, -0.3 * q * mask.unsqueeze(-1) / count, rtol=1e-12, atol=0)
    assert (per_token > 0).all()
    assert metrics["distill_forward_kl"].value == pytest.approx(float((per_token * mask).sum() / count), rel=1e-12)


def test_distill_terms_of_the_actor():
    names = lambda section: [term.name for term in actor_loss_terms(section)]  # noqa: E731
    assert names(_section()) == ["policy_loss"]
    assert names(_section(coef=0.5)) == ["policy_loss", "distill_loss"]
    assert names(_section(coef=0.5, use_policy_loss=False)) == ["distill_loss"]
    term = actor_loss_terms(_section(coef=0.5, kl_type="k1"))[-1]
    assert (term.options.coef, term.options.kl_type, term.options.loss_agg_mode) == (0.5, "k1", "token-mean")


@pytest.mark.parametrize("overrides, message", [
    ({"actor.distill.coef": -0.1}, "actor.distill.coef must be >= 0 (0: no distillation), got -0.1"),
    ({"actor.distill.coef": 0.5}, "actor.distill.coef=0.5 distils from a teacher: set teacher.enable=true"),
    ({"actor.distill.coef": 0.5, "teacher.enable": True}, "teacher.enable=true needs teacher.model.path"),
    ({"actor.distill.coef": 0.5, "teacher.enable": True, "teacher.model.path": "/no/such/folder"},
     "teacher.model.path='/no/such/folder' is not a folder"),
    ({"teacher.enable": True, "teacher.model.path": "tiny"}, "teacher.enable=true but nothing reads the teacher's"),
    ({"actor.distill.use_policy_loss": False}, "actor.distill.use_policy_loss=false leaves the actor no loss"),
    ({"actor.distill.coef": 0.5, "actor.distill.kl_type": "k9", "teacher.enable": True, "teacher.model.path": "tiny"},
     "actor.distill.kl_type must be one of kl, k1"),
    ({"actor.distill.coef": 0.5, "teacher.enable": True, "teacher.model.path": "tiny", "teacher.dp_size": 3},
     "teacher.dp_size=3 must divide"),
    ({"actor.distill.top_k": 4}, "actor.distill.top_k=4 chooses the distillation objective, which is off"),
    ({"actor.distill.top_k": -1}, "actor.distill.top_k must be >= 0"),
])
def test_distill_config_errors_are_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{key}={value}" for key, value in overrides.items()])
    text = str(err.value)
    assert "\n" not in text and text.startswith(message.split("=")[0].split(" ")[0]), text
    assert message in text, text


def test_distill_config_enables_the_teacher_role_and_sends_its_log_probs():
    cfg = to_dataclass(load_config(None, ["actor.distill.coef=0.5", "teacher.enable=true", "teacher.model.path=tiny",
                                          "teacher.dp_size=2", "actor.use_remove_padding=true"]))
    roles = enabled_roles(resolve_roles(), cfg)
    assert "teacher" in roles and roles["teacher"].num_processes(cfg) == 2
    assert roles["teacher"].forward.produces == "teacher_log_prob"
    assert "teacher_log_prob" in roles["actor"].update_keys(cfg, True)
    assert cfg.teacher.use_remove_padding is True  # the actor's, inherited
    topk = to_dataclass(load_config(None, ["actor.distill.coef=0.5", "actor.distill.top_k=4", "teacher.enable=true",
                                           "teacher.model.path=tiny"]))
    keys = roles["actor"].update_keys(topk, True)
    assert {"teacher_topk_ids", "teacher_topk_log_probs"} <= set(keys) and "teacher_log_prob" not in keys
    assert [term.name for term in actor_loss_terms(topk.actor)] == ["policy_loss", "distill_topk_loss"]
    plain = to_dataclass(load_config())
    assert "teacher" not in enabled_roles(resolve_roles(), plain)
    assert "teacher_log_prob" not in resolve_roles()["actor"].update_keys(plain, True)


# ------------------------------------------------------------------------- real models, in process


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """Another tiny model with the same tokenizer (a different initialisation): far from the
    student, so the reverse KL is clearly above 0."""
    from rlflow.tiny import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("teacher")), seed=1)


def student_samples(model_dir: str, rows: int = 32, max_new_tokens: int = 6) -> TensorDict:
    """The student's own samples at T=1 on the synthetic task's prompts, as the rollout assembles them."""
    from rlflow.data.synthetic import make_synthetic_rows

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts = [row["prompt"] for row in make_synthetic_rows("reverse", rows, seed=3, split="train")]
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=True, temperature=1.0, top_k=0,
                             top_p=1.0, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    generated = out[:, enc["input_ids"].shape[1]:].tolist()
    return assemble_rollout(enc["input_ids"], enc["attention_mask"], generated, 1, max_new_tokens,
                            tok.pad_token_id, tok.eos_token_id)


def response_log_softmax(model, batch: TensorDict) -> torch.Tensor:
    """log pi(. | context) at every response position, [B, R, V], from the untrimmed sequence."""
    prompt_width = batch["prompts"].shape[1]
    width = batch["responses"].shape[1]
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"], use_cache=False).logits
    return torch.log_softmax(logits[:, prompt_width - 1: prompt_width - 1 + width].to(F64), dim=-1)


def exact_reverse_kl(student, teacher, batch: TensorDict) -> float:
    """KL(pi_student || pi_teacher) over the whole vocabulary, averaged over the response tokens."""
    with torch.no_grad():
        log_s, log_t = response_log_softmax(student, batch), response_log_softmax(teacher, batch)
    per_token = (log_s.exp() * (log_s - log_t)).sum(-1)
    mask = batch["response_mask"] != 0
    return float(per_token[mask].mean())


def test_distill_teacher_log_probs_reach_the_loss_and_one_step_lowers_the_reverse_kl(
        restore_process_state, tiny_model_dir, teacher_dir):
    """The teacher worker's forward is the teacher's log-prob of each sampled token (its own model
    folder, not the student's); the actor's loss reads it (distill_reverse_kl is the mean of
    log pi - log pi_teacher); one SGD step on the pure distillation loss over the student's own
    samples lowers the exact, full-vocabulary reverse KL of those contexts."""
    from workers.actor import ActorWorker
    from workers.teacher import TeacherWorker

    assert AutoTokenizer.from_pretrained(teacher_dir).get_vocab() == AutoTokenizer.from_pretrained(tiny_model_dir).get_vocab()
    cfg = to_dataclass(load_config(None, tiny_overrides(tiny_model_dir, **{
        "actor.distill.coef": 1.0, "actor.distill.use_policy_loss": False, "teacher.enable": True,
        "teacher.model.path": teacher_dir, "rollout.temperature": 1.0, "actor.optim.name": "sgd"})))
    batch = student_samples(tiny_model_dir)
    mask = batch["response_mask"] != 0
    assert mask.sum() > 100

    teacher = TeacherWorker(cfg, 0, 1)
    teacher.init_model(teacher_dir)
    teacher_log_prob = teacher.compute_teacher_log_prob(batch)["teacher_log_prob"]
    teacher_lm = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    with torch.no_grad():
        direct = response_log_softmax(teacher_lm, batch).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(teacher_log_prob[mask].to(F64), direct[mask], rtol=0, atol=1e-5)

    actor = ActorWorker(cfg, 0, 1)
    actor.init_model(tiny_model_dir, 1)
    student_lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    before = exact_reverse_kl(student_lm, teacher_lm, batch)
    micro = batch.clone()
    micro["teacher_log_prob"] = teacher_log_prob
    actor.model.train()
    loss, metrics = actor.micro_loss(micro, None)
    assert set(metrics) >= {"actor/distill_loss", "actor/distill_reverse_kl"} and "actor/pg_loss" not in metrics
    with torch.no_grad():
        student_log_prob = response_log_softmax(student_lm, batch).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    sampled_kl = float((student_log_prob - direct)[mask].mean())
    assert metrics["actor/distill_reverse_kl"].value == pytest.approx(sampled_kl, abs=1e-5)
    assert before > 0.01 and math.isfinite(float(loss.detach()))
    loss.backward()
    with torch.no_grad():
        for parameter in actor.model.parameters():
            parameter -= 0.05 * parameter.grad
    after = exact_reverse_kl(actor.model, teacher_lm, batch)
    assert after < before - 1e-3, (before, after)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_distill_topk_targets_reach_the_loss_and_one_step_lowers_the_forward_kl(
        restore_process_state, tiny_model_dir, teacher_dir, packed):
    """actor.distill.top_k=4: the teacher worker's targets are its 4 most likely tokens at each
    sampled position and their log-probs; the actor's forward reads its own log-probs of those ids
    (padded and packed micro-batches alike); distill_forward_kl is the renormalised top-k forward
    KL computed here from the two models; one SGD step on it lowers it."""
    from workers.actor import ActorWorker
    from workers.teacher import TeacherWorker

    top_k = 4
    cfg = to_dataclass(load_config(None, tiny_overrides(tiny_model_dir, **{
        "actor.distill.coef": 1.0, "actor.distill.top_k": top_k, "actor.distill.use_policy_loss": False,
        "teacher.enable": True, "teacher.model.path": teacher_dir, "rollout.temperature": 1.0,
        "actor.optim.name": "sgd", "actor.use_remove_padding": packed})))
    batch = student_samples(tiny_model_dir, rows=16)
    mask = batch["response_mask"] != 0

    teacher = TeacherWorker(cfg, 0, 1)
    teacher.init_model(teacher_dir)
    targets = teacher.compute_teacher_log_prob(batch)
    teacher_lm = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    with torch.no_grad():
        log_t = response_log_softmax(teacher_lm, batch)
    values, ids = log_t.topk(top_k, dim=-1)
    assert torch.equal(targets["teacher_topk_ids"][mask], ids[mask])
    torch.testing.assert_close(targets["teacher_topk_log_probs"][mask].to(F64), values[mask], rtol=0, atol=1e-5)

    def forward_kl(student) -> float:
        with torch.no_grad():
            log_s = response_log_softmax(student, batch).gather(-1, ids)
        log_q = torch.log_softmax(values, dim=-1)
        return float((log_q.exp() * (log_q - log_s)).sum(-1)[mask].mean())

    actor = ActorWorker(cfg, 0, 1)
    actor.init_model(tiny_model_dir, 1)
    before = forward_kl(AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval())
    micro = batch.clone()
    micro.update(targets.select("teacher_topk_ids", "teacher_topk_log_probs"))
    actor.model.train()
    loss, metrics = actor.micro_loss(micro, None)
    assert metrics["actor/distill_forward_kl"].value == pytest.approx(before, abs=1e-5)
    assert "actor/distill_reverse_kl" not in metrics and before > 0.05
    loss.backward()
    with torch.no_grad():
        for parameter in actor.model.parameters():
            parameter -= 0.05 * parameter.grad
    stepped = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()  # padded attention, the stepped weights
    stepped.load_state_dict({name.removeprefix("module."): value for name, value in actor.model.state_dict().items()})
    assert forward_kl(stepped) < before - 1e-3


# ------------------------------------------------------------------------------ through the driver


def test_distill_fit_with_the_student_as_its_own_teacher_measures_zero(ray_session, tiny_model_dir, tmp_path):
    """Pure distillation through the driver (the actor's update in micro-batches of 4, the teacher's
    forward in one): with the student's own folder as the teacher, every sampled
    token's log-prob is the same under both, so the reverse KL the actor measures is 0 to float
    rounding; a misaligned row or token (the teacher's rows gathered out of order,
    a shift of one position) would make it large. No policy loss ran."""
    cfg = load_config(None, tiny_overrides(tiny_model_dir, **{
        "trainer.total_steps": 1, "trainer.default_local_dir": str(tmp_path), "algorithm.adv_estimator": "grpo",
        # one on-policy mini-batch: a second one would follow an optimizer step, and Adam turns
        # even a rounding-noise gradient into a step of lr per weight (the KL then ~1e-3)
        "actor.ppo_mini_batch_size": 16, "actor.distill.coef": 1.0, "actor.distill.use_policy_loss": False,
        "teacher.enable": True, "teacher.model.path": tiny_model_dir}))
    trainer = PPOTrainer(cfg)
    trainer.setup()
    try:
        assert set(trainer.groups) == {"actor", "rollout", "teacher"}
        metrics = trainer.train_step(0)
        assert "actor/pg_loss" not in metrics
        assert abs(metrics["actor/distill_reverse_kl"]) < 1e-5, metrics["actor/distill_reverse_kl"]
        assert 0 <= metrics["actor/distill_loss"] < 1e-5
        assert math.isfinite(metrics["reward/score_mean"])
    finally:
        trainer.shutdown()
