"""Fixtures of the head tests: the compiled element-wise kernels on or off."""

import pytest
import torch

from lit_losses.heads import entropy_kernels


@pytest.fixture(scope="session")
def can_compile():
    """Whether ``torch.compile`` builds CPU kernels here (it needs a C++ compiler)."""
    try:
        entropy_kernels._compiled(entropy_kernels._entropy_kernel)(torch.zeros(2, 4))
    except Exception as err:
        return f"{type(err).__name__}: {err}".splitlines()[0]
    return None


@pytest.fixture
def compiled_kernels(monkeypatch, can_compile):
    """The compiled entropy kernels for every chunk of at least ``COMPILE_MIN_LOGITS`` logits, with a
    fresh failure state; yields the names of the kernels that ran (returned a result)."""
    if can_compile:
        pytest.skip(f"torch.compile cannot build CPU kernels here: {can_compile}")
    calls: list[str] = []
    monkeypatch.setenv(entropy_kernels.ENV_SWITCH, "1")
    monkeypatch.setattr(entropy_kernels, "_failed", {})
    monkeypatch.setattr(entropy_kernels, "_warned", set())
    run = entropy_kernels._run

    def counted(kernel, *args):
        out = run(kernel, *args)
        if out is not None:
            calls.append(kernel.__name__)
        return out

    monkeypatch.setattr(entropy_kernels, "_run", counted)
    yield calls
    assert not entropy_kernels._failed


@pytest.fixture(params=["eager", "compiled"])
def entropy_kernel(request, monkeypatch):
    """The chunked head's entropy passes eager, or through the compiled kernels on every chunk of at
    least 2 rows (their size threshold lowered to 1 logit); the compiled case checks that they ran.
    Yields the names of the kernels that ran."""
    if request.param == "eager":
        monkeypatch.setenv(entropy_kernels.ENV_SWITCH, "0")
        yield []
        return
    calls = request.getfixturevalue("compiled_kernels")
    monkeypatch.setattr(entropy_kernels, "COMPILE_MIN_LOGITS", 1)
    yield calls
    assert calls
