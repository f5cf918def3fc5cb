"""A NaN is the controller's to handle: a micro-batch that makes the loss NaN at optimizer step k is skipped
before it reaches the weights; ``recover_from_spike.yaml`` rolls back and ends as a run that never saw the
batch, ``stop_on_runaway.yaml`` stops at step k with the weights of step k − 1; without a controller the
run stops with one error naming the options (`lit_losses.non_finite`)."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lit_losses import GlobalStatsLoader, TinyLM, TrainingController
from lit_losses.non_finite import NonFiniteStepError, check_hidden_states, gradients_finite
from lit_losses.validation import finite_sum
from tests.controller.helpers import REPO, pattern_batches
from tests.controller.test_recovery import StepLosses
from tests.helpers import quiet_trainer

POISON = 20  # the micro-batch whose hidden states turn NaN: optimizer step 21
STEPS = 30


class NaNLM(TinyLM):
    """`TinyLM` whose hidden states are NaN for a micro-batch marked ``nan``."""

    def forward_hidden(self, batch):
        hidden = super().forward_hidden(batch)
        return hidden * float("nan") if "nan" in batch else hidden


def batches(poisoned: bool) -> list[dict]:
    data = pattern_batches(STEPS)
    if poisoned:
        data.insert(POISON, {**data[0], "nan": torch.ones(1)})
    return data


def run(data, *callbacks, max_steps=None):
    L.seed_everything(0, verbose=False)
    optimizer = {"lr": 1e-2, "warmup_steps": 0, "schedule": "constant"}
    net = NaNLM(vocab_size=64, d_model=32, n_layers=1, n_heads=2, optimizer=optimizer)
    record = StepLosses()
    trainer = quiet_trainer(max_steps=max_steps or len(data), callbacks=[*callbacks, record])
    trainer.fit(net, GlobalStatsLoader(data, batch_size=None))
    return record, net, trainer


def controller(name: str) -> TrainingController:
    return TrainingController(str(REPO / "configs" / "controller" / f"{name}.yaml"))


@pytest.mark.slow
def test_recover_from_spike_rolls_the_nan_step_back_and_ends_as_without_the_batch():
    clean, clean_net, _ = run(batches(poisoned=False))
    ctrl = controller("recover_from_spike")
    recovered, recovered_net, trainer = run(batches(poisoned=True), ctrl)
    assert [f["step"] for f in ctrl.fired] == [POISON + 1]
    assert recovered.losses[POISON + 1] != recovered.losses[POISON + 1]  # NaN: logged for the rule
    assert trainer.global_step == STEPS + 1
    final, reference = recovered.losses[STEPS + 1], clean.losses[STEPS]
    assert abs(final - reference) <= 0.02 * reference
    for name, value in recovered_net.state_dict().items():
        assert torch.isfinite(value).all(), name
        torch.testing.assert_close(value, clean_net.state_dict()[name], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_stop_on_runaway_stops_at_the_nan_step_with_the_weights_before_it(tmp_path):
    _, before_net, _ = run(batches(poisoned=False), max_steps=POISON)
    ctrl = controller("stop_on_runaway")
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)
    _, stopped_net, trainer = run(batches(poisoned=True), ctrl, checkpoint)
    assert [(f["controller"], f["step"]) for f in ctrl.fired] == [("loss-not-finite", POISON + 1)]
    assert trainer.global_step == POISON + 1  # the skipped step counts
    last = torch.load(tmp_path / "last.ckpt", weights_only=True)["state_dict"]
    for name, value in before_net.state_dict().items():
        assert torch.equal(stopped_net.state_dict()[name], value), name
        assert torch.equal(last[name], value), name  # no NaN in the last checkpoint


def test_without_a_controller_the_nan_stops_the_run_naming_the_options():
    with pytest.raises(
        NonFiniteStepError,
        match=r"train batch at step 20: the hidden states contain .* "
        r"add a TrainingController .* model\.init_args\.check_finite=false",
    ):
        run(batches(poisoned=True))


def test_without_a_controller_non_finite_gradients_stop_the_run():
    """NaN gradients from finite hidden states (here a NaN output weight gradient hook) are refused too."""
    data = pattern_batches(4)
    L.seed_everything(0, verbose=False)
    net = TinyLM(vocab_size=64, d_model=32, n_layers=1, n_heads=2)
    net.body.blocks[0].mlp_norm.weight.register_hook(lambda g: g * float("nan"))
    with pytest.raises(
        NonFiniteStepError, match=r"optimizer step 1: the loss or the gradients are not finite"
    ):
        quiet_trainer(max_steps=2).fit(net, GlobalStatsLoader(data, batch_size=None))


class SkipsNonFiniteSteps(L.Callback):
    """The smallest callback that handles non-finite steps (a `TrainingController` without rules)."""

    handles_non_finite_steps = True


def test_the_callbacks_are_read_once_per_fit_and_again_at_the_next_fit(monkeypatch):
    """A NaN micro-batch is skipped in a fit with a callback that handles it and refused in the next fit of
    the same model without one: what the first fit read is not carried over. Each fit reads its callbacks
    once (at ``setup``), not at each micro-batch."""
    import lit_losses.module

    reads = []
    real = lit_losses.module.non_finite_steps_handled
    monkeypatch.setattr(
        lit_losses.module, "non_finite_steps_handled", lambda trainer: reads.append(trainer) or real(trainer)
    )
    data = pattern_batches(3)
    data.insert(1, {**data[0], "nan": torch.ones(1)})
    L.seed_everything(0, verbose=False)
    net = NaNLM(vocab_size=64, d_model=32, n_layers=1, n_heads=2)
    first = quiet_trainer(max_steps=len(data), callbacks=[SkipsNonFiniteSteps()])
    with pytest.warns(UserWarning, match="optimizer step 2: non-finite gradients"):
        first.fit(net, GlobalStatsLoader(data, batch_size=None))
    assert first.global_step == len(data) and reads == [first]
    second = quiet_trainer(max_steps=len(data))
    with pytest.raises(NonFiniteStepError, match="train batch at step 1: the hidden states contain"):
        second.fit(net, GlobalStatsLoader(data, batch_size=None))
    assert reads == [first, second]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_whose_sums_overflow_are_finite_and_one_nan_among_many_is_not(dtype):
    """The gradients are read as sums first: a sum that overflows is checked entry by entry (finite), and a
    single NaN or Inf among two tensors makes the step non-finite; the hidden states' check alike."""
    params = [torch.nn.Parameter(torch.zeros(4, dtype=dtype)) for _ in range(2)]
    params[0].grad = torch.full((4,), 3e38, dtype=dtype)  # finite entries, the sum overflows
    params[1].grad = torch.ones(4, dtype=dtype)
    assert not torch.isfinite(finite_sum(params[0].grad))
    assert gradients_finite(params)
    check_hidden_states(params[0].grad[None], where="train batch at step 0")
    for bad in (float("nan"), float("-inf")):
        params[1].grad[2] = bad
        assert not gradients_finite(params)
        with pytest.raises(NonFiniteStepError, match="contain 1 non-finite value"):
            check_hidden_states(params[1].grad[None], where="train batch at step 0")


def test_a_nan_in_the_imaginary_part_of_a_complex_gradient_is_not_finite():
    param = torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    param.grad = torch.tensor([1, complex(0, float("nan")), 0], dtype=torch.complex64)
    assert not gradients_finite([param])
    param.grad = torch.tensor([1, 2j, 0], dtype=torch.complex64)
    assert gradients_finite([param])
