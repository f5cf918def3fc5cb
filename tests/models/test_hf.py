"""`HFCausalLM` against the wrapped model's own ``labels=`` loss: values, log-probabilities, every parameter
gradient (fp32 and float64), both label conventions, and the refusals."""

import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("transformers")

from lit_losses import HFCausalLM
from lit_losses.errors import ConfigError
from lit_losses.heads import HEAD_BACKENDS
from tests.models.hf_models import CONFIGS, V, batch_of, hf_config, next_token

NEEDS_TORCH_LCE = pytest.mark.skipif(
    not HEAD_BACKENDS["torch"].available(), reason="this PyTorch has no F.linear_cross_entropy"
)


def make(model_type, dtype=torch.float32, seed=0, **kwargs):
    torch.manual_seed(seed)
    model = HFCausalLM(config=hf_config(model_type), attn_implementation="sdpa", **kwargs)
    return model.to(dtype)


def own_loss_and_grads(model, batch, from_logits=False):
    """The wrapped model's own loss (it shifts the aligned labels) and its parameter gradients; with
    ``from_logits``, the cross-entropy of its own logits in their dtype (transformers' loss upcasts
    float64 logits to fp32)."""
    model.zero_grad()
    if from_logits:
        logits = model.model(input_ids=batch["input_ids"]).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["labels"][:, 1:])
    else:
        loss = model.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return loss.detach(), grads


def our_loss_and_grads(model, batch):
    model.zero_grad()
    loss = model.compute_loss(batch).total
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return loss.detach(), grads


def assert_grads_close(got, want, rtol):
    assert got.keys() == want.keys()
    for name, ref in want.items():
        scale = ref.abs().max().clamp_min(1e-30)
        torch.testing.assert_close(got[name] / scale, ref / scale, rtol=0, atol=rtol, msg=name)


@pytest.mark.parametrize("label_format", ["next_token", "input_aligned"])
@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_loss_and_every_gradient_equal_the_models_own_fp32(model_type, label_format):
    model = make(model_type, label_format=label_format)
    batch = batch_of()
    ref, ref_grads = own_loss_and_grads(model, batch)
    ours = batch if label_format == "input_aligned" else {**batch, "labels": next_token(batch["labels"])}
    loss, grads = our_loss_and_grads(model, ours)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)
    assert_grads_close(grads, ref_grads, rtol=1e-5)


@pytest.mark.parametrize("model_type", ["llama", "phi"])
def test_loss_and_every_gradient_equal_the_models_own_float64(model_type):
    model = make(model_type, torch.float64, label_format="input_aligned")
    batch = batch_of(seed=1)
    ref, ref_grads = own_loss_and_grads(model, batch, from_logits=True)
    loss, grads = our_loss_and_grads(model, batch)
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=0)
    assert_grads_close(grads, ref_grads, rtol=1e-10)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_logprobs_equal_log_softmax_of_the_models_own_logits(model_type):
    model = make(model_type).eval()
    batch = batch_of(seed=2)
    labels = next_token(batch["labels"])
    with torch.no_grad():
        logits = model.model(input_ids=batch["input_ids"]).logits
        got = model.predict_step({**batch, "labels": labels}, 0)
        full = model.forward_logits(batch)
    logp = torch.log_softmax(logits.float(), -1).gather(-1, labels.clamp_min(0)[..., None])[..., 0]
    torch.testing.assert_close(got, torch.where(labels != -100, logp, 0.0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(full, logits, rtol=1e-5, atol=1e-5)


def test_output_layer_bias_and_tied_weights_are_the_heads():
    phi, gpt2 = make("phi"), make("gpt2")
    weight, bias = phi.output_projection()
    assert bias is phi.model.lm_head.bias and weight is phi.model.lm_head.weight
    weight, bias = gpt2.output_projection()
    assert bias is None and weight is gpt2.model.transformer.wte.weight  # tied


@pytest.mark.parametrize("backend", ["chunked", "naive", pytest.param("torch", marks=NEEDS_TORCH_LCE)])
def test_regularized_loss_through_every_backend_equals_a_reference(backend):
    """z_loss + entropy (fused or general path) on top of the HF model, against materialized logits (the
    ``torch`` backend gives log-probabilities only: the base loss)."""
    regs = [{"name": "z_loss", "weight": 0.01}, {"name": "entropy", "weight": 0.1, "args": {"mode": "bonus"}}]
    if backend == "torch":
        regs = []
    model = make("llama", torch.float64, head_backend=backend, regularizers=regs)
    batch = batch_of(seed=3)
    batch["labels"] = next_token(batch["labels"])
    loss, grads = our_loss_and_grads(model, batch)
    mask = batch["labels"] != -100
    logits = model.model(input_ids=batch["input_ids"]).logits[mask]
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, batch["labels"][mask][:, None])[:, 0]
    if backend == "torch":
        ref = (-lp).mean()
    else:
        ent = -(logp.exp() * logp).sum(-1)
        ref = (-lp).mean() + 0.01 * torch.logsumexp(logits, -1).square().mean() - 0.1 * ent.mean()
    model.zero_grad()
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-10, atol=0)
    assert_grads_close(grads, ref_grads, rtol=1e-9)


def test_generate_keeps_working():
    model = make("llama").eval()
    out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 7) and torch.equal(out[:, :3], torch.tensor([[5, 6, 7]]))


def test_a_local_checkpoint_directory_and_a_built_model_give_the_same_loss(tmp_path):
    built = make("qwen2")
    built.model.save_pretrained(tmp_path / "ckpt")
    loaded = HFCausalLM(model_name_or_path=str(tmp_path / "ckpt"))
    from_python = HFCausalLM(model=built.model)
    batch = {**batch_of(), "labels": next_token(batch_of()["labels"])}
    ref = built.compute_loss(batch).total
    torch.testing.assert_close(loaded.compute_loss(batch).total, ref)
    torch.testing.assert_close(from_python.compute_loss(batch).total, ref)


def test_label_convention_mismatches_are_clear_errors():
    batch = batch_of()
    with pytest.raises(ConfigError, match="label_format: input_aligned"):
        make("llama").compute_loss(batch)  # HF labels given to a next-token model
    with pytest.raises(ConfigError, match="label_format: next_token"):
        make("llama", label_format="input_aligned").compute_loss(
            {**batch, "labels": next_token(batch["labels"])}
        )


def test_construction_errors_name_the_option(tmp_path):
    with pytest.raises(ConfigError, match=r"exactly one of model\.init_args\.model_name_or_path"):
        HFCausalLM()
    with pytest.raises(ConfigError, match="'/nowhere' is not a local directory"):
        HFCausalLM(model_name_or_path="/nowhere")
    with pytest.raises(ConfigError, match="'lamma' is not a transformers model type; did you mean 'llama'"):
        HFCausalLM(config={"model_type": "lamma"})
    with pytest.raises(ConfigError, match=r"config.vocab_size=97 differs from model.init_args.vocab_size=64"):
        HFCausalLM(config=hf_config("llama"), vocab_size=64)
    with pytest.raises(ConfigError, match="label_format 'shifted' is not one of"):
        HFCausalLM(config=hf_config("llama"), label_format="shifted")
    with pytest.raises(ConfigError, match=f"vocab_size=200 .* exceeds the model's output rows V={V}"):
        HFCausalLM(model=make("llama").model, vocab_size=200)


def test_logit_softcapping_is_refused():
    config = dict(
        model_type="gemma2",
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        final_logit_softcapping=3.0,
    )
    with pytest.raises(ConfigError, match=r"not linear.*config sets final_logit_softcapping"):
        HFCausalLM(config=config)


class HostReads(TorchDispatchMode):
    """The ops that wait for the device on CUDA (a value read to the host, an output sized by values), each
    with the package function that made it."""

    READS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "repeat_interleave"})

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        by_mask = name == "index" and any(getattr(i, "dtype", None) == torch.bool for i in args[1])
        if name in self.READS or by_mask:
            caller = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename][-1]
            inside = "/lit_losses/" in caller.filename
            self.reads.append(f"{name} in {caller.name}" if inside else f"{name} outside the package")
        return func(*args, **(kwargs or {}))


def test_an_sft_step_reads_the_device_three_times_in_the_package():
    """The loss of a plain SFT micro-batch and its backward read the device three times in the package
    (the hidden states' check, the head's input checks with the token weights', the valid tokens' index):
    each read after the forward stalls a CUDA queue. (The token counts come with the batch in ``fit``,
    from `GlobalStatsLoader`; counted here, they are one ``tolist`` more, which this mode does not see.)"""
    model = make("llama", dtype=torch.bfloat16, head_backend="blocked")
    batch = batch_of()
    batch["labels"] = next_token(batch["labels"])
    model.compute_loss(batch).total.backward()  # first call: one-time checks
    with HostReads() as log:
        model.compute_loss(batch).total.backward()
    ours = [r for r in log.reads if not r.endswith("outside the package")]
    assert ours == [
        "_local_scalar_dense in all_finite",  # check_hidden_states
        "_local_scalar_dense in pass_at_once",
        "nonzero in compact_valid",
    ]


@pytest.mark.parametrize("model_type", ["llama", "phi", "gpt2"])  # plain, an output bias, tied
def test_low_logits_gives_the_bf16_models_own_loss(model_type):
    """``head_matmul_precision="low_logits"``: the bf16 model's loss is its own bf16 ``labels=`` loss (whose
    logits a bf16 ``lm_head`` rounds), to fp32 rounding, where the default fp32 logits differ by ~1e-5;
    every gradient agrees to bf16's rounding."""
    model = make(
        model_type, dtype=torch.bfloat16, label_format="input_aligned", head_matmul_precision="low_logits"
    )
    batch = batch_of()
    want, want_grads = own_loss_and_grads(model, batch)
    got, grads = our_loss_and_grads(model, batch)
    torch.testing.assert_close(got.double(), want.double(), rtol=1e-6, atol=0)
    assert_grads_close(
        {n: g.double() for n, g in grads.items()}, {n: g.double() for n, g in want_grads.items()}, rtol=3e-2
    )
