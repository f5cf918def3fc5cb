"""Lightning fits of a tiny Hugging Face Llama under mixed precision on CPU, through every CPU backend: the
head computes in fp32 whatever the body's dtype, so every backend gives the same loss."""

import pytest
import torch

pytest.importorskip("transformers")

from lit_losses import GlobalStatsLoader, HFCausalLM
from lit_losses.heads import HEAD_BACKENDS
from tests.helpers import LossRecorder, quiet_trainer
from tests.models.hf_models import V, hf_config

#: The CPU backends this PyTorch has (``torch`` needs `F.linear_cross_entropy`).
CPU_BACKENDS = [b for b in ("chunked", "naive", "torch") if HEAD_BACKENDS[b].available()]


def micro_batches(n=3, rows=2, length=16):
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(n):
        ids = torch.randint(3, V, (rows, length), generator=g)
        labels = torch.cat([ids[:, 1:], torch.full((rows, 1), -100)], 1)
        batches.append({"input_ids": ids, "labels": labels})
    return batches


class HiddenDtype(HFCausalLM):
    """Records the dtype of the hidden states handed to the head, and whether autocast was on."""

    def forward_hidden(self, batch):
        hidden = super().forward_hidden(batch)
        seen = (hidden.dtype, torch.is_autocast_enabled("cpu"))
        self.seen = getattr(self, "seen", set()) | {seen}
        return hidden


def fit(backend, precision, steps=2, accelerator="cpu"):
    torch.manual_seed(0)
    model = HiddenDtype(
        config=hf_config("llama"), head_backend=backend, optimizer={"lr": 1e-2, "warmup_steps": 0}
    )
    recorder = LossRecorder()
    loader = GlobalStatsLoader(micro_batches(steps), batch_size=None)
    trainer = quiet_trainer(
        max_steps=steps, precision=precision, callbacks=[recorder], accelerator=accelerator
    )
    trainer.fit(model, loader)
    return model, recorder.losses


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_mixed_precision_fit_runs_and_every_backend_gives_the_same_loss(precision):
    losses = {}
    for backend in CPU_BACKENDS:
        model, losses[backend] = fit(backend, precision)
        # bf16-true: bf16 hidden states; bf16-mixed: under autocast (Llama's fp32 final norm weight
        # promotes the last hidden states to fp32)
        assert model.seen == (
            {(torch.bfloat16, False)} if precision == "bf16-true" else {(torch.float32, True)}
        )
        assert all(torch.isfinite(torch.tensor(v)) for v in losses[backend].values())
    first = {b: v[1] for b, v in losses.items()}  # step 1's loss: the same body output for every backend
    assert max(first.values()) - min(first.values()) < 1e-5 * abs(first["naive"]), first
    assert losses["chunked"][2] < losses["chunked"][1]  # and it trains


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["auto", "chunked", "naive"])
def test_bf16_mixed_fit_on_cuda_gives_the_loss_of_the_cpu_fp32_head(backend):
    """On CUDA (``auto``: Liger when the [liger] extra is installed): the first step's loss equals the fp32
    reference computed on CPU from the same initial weights and data, to bf16 body rounding."""
    _, cuda_losses = fit(backend, "bf16-mixed", accelerator="cuda")
    _, cpu_losses = fit("naive", "32-true")
    assert abs(cuda_losses[1] - cpu_losses[1]) < 2e-2 * abs(cpu_losses[1])
    assert cuda_losses[2] < cuda_losses[1]
