"""``model.distillation`` against TRL's own distillation losses (the installed ``trl``), on one micro-batch
of a tiny Llama student and a Llama teacher of another width (float64): ``GKDTrainer.generalized_jsd_loss``
on both models' materialized logits, and ``DistillationTrainer``'s ``_chunked_divergence_loss`` on their
hidden states and output projections (TRL's fused kernel, float32 inside, hence ``rtol = 1e-5`` there).
Our fused head never materializes the logits; the loss and every student parameter's gradient agree."""

from __future__ import annotations

import copy

import pytest
import torch
from trl.experimental.gkd import GKDTrainer
from trl.trainer.distillation_trainer import _chunked_divergence_loss

from lit_losses import ConfigError, HFCausalLM
from lit_losses.objectives.distillation import DistillationConfig
from tests.objectives import trl_grpo_trainer as trl

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

PROMPT = 4
LENGTHS = (9, 6, 8)  # tokens of each row (right-padded)
CASES = {  # our fields: TRL's beta (0: forward KL, 1: reverse KL) and temperature
    "forward_kl": {"loss": "forward_kl", "beta": 0.0},
    "reverse_kl-tempered": {"loss": "reverse_kl", "beta": 1.0, "temperature": 0.7},
    "jsd": {"loss": "jsd", "beta": 0.5},
    "jsd-beta-tempered": {"loss": "jsd", "beta": 0.2, "temperature": 2.0},
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A student (2 layers, width 32) and a teacher of another width, saved where our module loads it."""
    student = trl.llama(seed=0)
    vocab = student.config.vocab_size
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    teacher = LlamaForCausalLM(config).double()
    with torch.no_grad():  # logits far enough from uniform that the divergences are not tiny
        teacher.lm_head.weight.mul_(8.0)
    saved = tmp_path_factory.mktemp("teacher")
    teacher.save_pretrained(saved)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab, (len(LENGTHS), max(LENGTHS)), generator=g)
    mask = torch.arange(max(LENGTHS))[None] < torch.tensor(LENGTHS)[:, None]
    trl_labels = torch.where(mask, ids, -100)  # TRL's: aligned with input_ids, the prompt unlabelled
    trl_labels[:, :PROMPT] = -100
    return student, teacher.eval(), saved, {"input_ids": ids, "attention_mask": mask.long()}, trl_labels


def ours(models, cfg: dict):
    student, _, saved, inputs, trl_labels = models
    module = HFCausalLM(model=copy.deepcopy(student), distillation={"teacher": str(saved), **cfg})
    module.train()
    labels = torch.cat([trl_labels[:, 1:], torch.full_like(trl_labels[:, :1], -100)], 1)  # next-token
    out = module.compute_loss({"input_ids": inputs["input_ids"], "labels": labels})
    out.total.backward()
    grads = {n.removeprefix("model."): p.grad for n, p in module.named_parameters() if p.grad is not None}
    return out, grads


def student_leaves(models):
    student = copy.deepcopy(models[0])
    return student, dict(student.named_parameters())


def assert_same(loss, grads, reference, ref_grads, rtol):
    torch.testing.assert_close(loss.detach(), reference.detach().to(loss.dtype), rtol=rtol, atol=1e-12)
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    assert scale > 1e-4 and set(grads) == set(ref_grads)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad.to(grad.dtype), rtol=rtol, atol=rtol * scale, msg=name)


@pytest.mark.parametrize("name", sorted(CASES))
def test_gkd_generalized_jsd_on_the_logits_is_our_loss(models, name):
    """``GKDTrainer.generalized_jsd_loss`` (its ``compute_loss``'s shift and mask, the batch mean over
    labelled positions) on materialized float64 logits: our loss and gradients to 1e-10."""
    cfg = CASES[name]
    _, teacher, _, inputs, trl_labels = models
    student, params = student_leaves(models)
    student_logits = student(**inputs).logits
    with torch.no_grad():
        teacher_logits = teacher(**inputs).logits
    reference = GKDTrainer.generalized_jsd_loss(
        student_logits[:, :-1],
        teacher_logits[:, :-1],
        labels=trl_labels[:, 1:],
        beta=cfg["beta"],
        temperature=cfg.get("temperature", 1.0),
    )
    ref_grads = dict(zip(params, torch.autograd.grad(reference, list(params.values())), strict=True))
    out, grads = ours(models, cfg)
    assert_same(out.total, grads, reference, ref_grads, rtol=1e-10)


@pytest.mark.parametrize("name", sorted(CASES))
def test_distillation_trainer_s_chunked_divergence_is_our_loss(models, name):
    """``DistillationTrainer``'s ``_chunked_divergence_loss`` (TRL's fused kernel) on both models' hidden
    states and output projections over the completion positions."""
    cfg = CASES[name]
    _, teacher, _, inputs, trl_labels = models
    student, params = student_leaves(models)
    hidden = student.model(**inputs).last_hidden_state[:, :-1]
    with torch.no_grad():
        teacher_hidden = teacher.model(**inputs).last_hidden_state[:, :-1]
    loss, _, _ = _chunked_divergence_loss(
        hidden,
        teacher_hidden,
        student.lm_head.weight,
        teacher.lm_head.weight,
        completion_mask=(trl_labels[:, 1:] != -100).long(),
        beta=cfg["beta"],
        temperature=cfg.get("temperature", 1.0),
    )
    ref_grads = dict(zip(params, torch.autograd.grad(loss, list(params.values())), strict=True))
    out, grads = ours(models, cfg)
    assert_same(out.total, grads, loss, ref_grads, rtol=1e-5)


def test_a_beta_that_the_divergence_ignores_is_refused():
    """TRL's ``beta`` selects the divergence; here ``loss`` does: a ``beta`` beside ``forward_kl`` or
    ``reverse_kl`` (or given without ``loss``) would be dropped, so it is an error."""
    with pytest.raises(ConfigError, match=r"model\.distillation\.beta=0\.9: loss 'forward_kl' ignores it"):
        DistillationConfig.coerce({"beta": 0.9})
    with pytest.raises(ConfigError, match=r"model\.distillation\.beta=0\.5: loss 'reverse_kl' ignores it"):
        DistillationConfig.coerce({"loss": "reverse_kl", "beta": 0.5})
    assert DistillationConfig.coerce({"loss": "jsd", "beta": 0.9}).beta == 0.9
