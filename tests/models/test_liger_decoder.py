"""``HFCausalLM(use_liger_kernel=True)``: Liger-Kernel's decoder kernels on the wrapped model, its loss
patches off (the fused head computes the loss), refused where they cannot run. On CUDA the patched model's
loss and gradients are the unpatched model's, to Liger's kernels' rounding."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
liger_rms_norm = pytest.importorskip("liger_kernel.transformers.rms_norm")
liger_swiglu = pytest.importorskip("liger_kernel.transformers.swiglu")

from transformers.models.llama import modeling_llama  # noqa: E402

from lit_losses import GlobalStatsLoader, HFCausalLM  # noqa: E402
from lit_losses.errors import ConfigError  # noqa: E402
from tests.helpers import quiet_trainer  # noqa: E402
from tests.models.hf_models import V, hf_config, next_token  # noqa: E402


@pytest.fixture(autouse=True)
def llama_module_restored():
    """Liger's patch also replaces ``modeling_llama``'s RoPE function and norm/MLP classes for the whole
    process: put them back after each test, so that the other tests build plain models."""
    saved = dict(vars(modeling_llama))
    yield
    for name in set(vars(modeling_llama)) - set(saved):
        delattr(modeling_llama, name)
    for name, value in saved.items():
        setattr(modeling_llama, name, value)


def bound_function(module: torch.nn.Module):
    forward = module.forward
    return getattr(forward, "__func__", None)


def logits_of(model: HFCausalLM) -> torch.Tensor:
    return model.forward_logits({"input_ids": torch.arange(3, 11)[None]})


def test_only_the_model_given_gets_liger_kernels():
    """The patched model's modules run Liger's forwards (its own ``forward`` stays: no fused linear
    cross-entropy, the head computes the loss); a model built afterwards is Hugging Face's own and computes
    what one built before did (RoPE falls back to Hugging Face's function off CUDA)."""
    torch.manual_seed(0)
    before = logits_of(HFCausalLM(config=hf_config("llama")))
    model = HFCausalLM(config=hf_config("llama"), use_liger_kernel=True)
    lm = model.model
    assert bound_function(lm.model.norm) is liger_rms_norm.LigerRMSNorm.forward
    for layer in lm.model.layers:
        assert bound_function(layer.input_layernorm) is liger_rms_norm.LigerRMSNorm.forward
        assert bound_function(layer.mlp) is liger_swiglu.LigerSwiGLUMLP.forward
    assert "forward" not in vars(lm)
    assert modeling_llama.LlamaRMSNorm.__module__ == modeling_llama.__name__
    assert modeling_llama.LlamaMLP.__module__ == modeling_llama.__name__
    torch.manual_seed(0)
    after = HFCausalLM(config=hf_config("llama"))
    assert bound_function(after.model.model.norm) is modeling_llama.LlamaRMSNorm.forward
    torch.testing.assert_close(logits_of(after), before, rtol=0, atol=0)


def test_the_initial_policy_copy_runs_its_own_patched_modules():
    """A DPO reference without LoRA is a copy of the policy: built without a probe forward (the policy was
    checked before the patch), its Liger forwards bound to the copy's own modules."""
    model = HFCausalLM(config=hf_config("llama"), use_liger_kernel=True)
    runner = model.initial_copy()
    norm = runner.lm.model.norm
    assert norm is not model.model.model.norm
    assert norm.forward.__self__ is norm and bound_function(norm) is liger_rms_norm.LigerRMSNorm.forward


def test_liger_kernel_config_chooses_the_kernels_and_lora_wraps_the_patched_model():
    model = HFCausalLM(
        config=hf_config("llama"),
        use_liger_kernel=True,
        liger_kernel_config={"swiglu": False},
        lora={"r": 4, "target_modules": ["gate_proj", "q_proj"]},
    )
    base = model.model.get_base_model()
    assert bound_function(base.model.norm) is liger_rms_norm.LigerRMSNorm.forward
    assert bound_function(base.model.layers[0].mlp) is not liger_swiglu.LigerSwiGLUMLP.forward
    assert type(base.model.layers[0].mlp.gate_proj).__name__ == "Linear"  # peft's LoRA layer
    assert hasattr(base.model.layers[0].mlp.gate_proj, "lora_A")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"use_liger_kernel": True, "liger_kernel_config": {"fused_linear_cross_entropy": True}},
            "liger_kernel_config.fused_linear_cross_entropy=True: the fused head computes the loss",
        ),
        (
            {"use_liger_kernel": True, "liger_kernel_config": {"cross_entropy": True}},
            "liger_kernel_config.cross_entropy=True",
        ),
        (
            {"use_liger_kernel": True, "liger_kernel_config": {"rms_nrom": False}},
            "['rms_nrom'] are not options of Liger-Kernel's apply_liger_kernel_to_llama",
        ),
        (
            {"use_liger_kernel": True, "liger_kernel_config": ["rope"]},
            "liger_kernel_config=['rope']: expected a mapping of Liger's options",
        ),
        (
            {"use_liger_kernel": True, "liger_kernel_config": {"rope": "false"}},
            "liger_kernel_config.rope='false': expected true or false",
        ),
        ({"use_liger_kernel": "false"}, "model.init_args.use_liger_kernel='false': expected true or false"),
        (
            {"liger_kernel_config": {"rope": False}},
            "liger_kernel_config={'rope': False} is given but model.init_args.use_liger_kernel",
        ),
    ],
)
def test_bad_options_are_refused_by_name(options, message):
    with pytest.raises(ConfigError) as err:
        HFCausalLM(config=hf_config("llama"), **options)
    assert message in str(err.value)


def test_the_swiglu_kernel_is_refused_for_another_activation():
    """Liger patches the MLP instance's forward with ``silu(gate) * up`` whatever ``hidden_act`` says."""
    config = hf_config("llama", hidden_act="gelu")
    with pytest.raises(
        ConfigError, match=r"this model's hidden_act is 'gelu'; set .*liger_kernel_config\.swiglu"
    ):
        HFCausalLM(config=config, use_liger_kernel=True)
    model = HFCausalLM(config=config, use_liger_kernel=True, liger_kernel_config={"swiglu": False})
    assert bound_function(model.model.model.layers[0].mlp) is modeling_llama.LlamaMLP.forward


def test_a_model_liger_has_no_kernels_for_is_refused():
    with pytest.raises(ConfigError, match="Liger-Kernel has no kernels for model_type 'gpt2'"):
        HFCausalLM(config=hf_config("gpt2"), use_liger_kernel=True)


def batches(n: int = 2, rows: int = 2, length: int = 16) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, V, (rows, length), generator=g) for _ in range(n)]
    return [{"input_ids": i, "labels": next_token(i)} for i in ids]


def test_a_cpu_run_is_refused_before_any_batch():
    """Before the frozen models are loaded (a DPO reference copied from the policy, here)."""
    model = HFCausalLM(config=hf_config("llama"), use_liger_kernel=True, dpo={"beta": 0.1})
    trainer = quiet_trainer(max_steps=1, accelerator="cpu")
    with pytest.raises(
        ConfigError, match="Liger-Kernel's kernels run on CUDA only and this run's device is cpu"
    ):
        trainer.fit(model, GlobalStatsLoader(batches(), batch_size=None))
    assert trainer.global_step == 0


def test_a_forward_on_cpu_outside_a_trainer_is_refused_by_name_not_by_triton():
    """Called from plain Python (no trainer's setup to refuse the device), the first forward of CPU tensors
    names the option rather than failing inside a Triton kernel."""
    model = HFCausalLM(config=hf_config("llama"), use_liger_kernel=True)
    with pytest.raises(ConfigError, match=r"use_liger_kernel: Liger-Kernel's kernels run on CUDA only.* cpu"):
        model.compute_loss(batches(n=1)[0])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_patched_model_gives_the_plain_model_loss_and_gradients():
    config = hf_config("llama", hidden_size=64, intermediate_size=128, num_attention_heads=4)
    batch = {k: v.cuda() for k, v in batches(1, rows=2, length=32)[0].items()}
    results = []
    for use_liger_kernel in (False, True):
        torch.manual_seed(0)
        model = HFCausalLM(config=config, use_liger_kernel=use_liger_kernel).cuda()
        loss = model.compute_loss(batch).total
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((loss.detach(), grads))
    (loss, grads), (liger_loss, liger_grads) = results
    torch.testing.assert_close(liger_loss, loss, rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(liger_grads[name], grad, rtol=1e-3, atol=1e-5, msg=name)
