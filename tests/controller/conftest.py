import pytest

from lit_losses.controller import METRIC_HANDLERS, OPERATION_HANDLERS


@pytest.fixture
def isolated_registries(monkeypatch):
    """Handlers registered by a test are gone after it (the registries are process-wide)."""
    for registry in (METRIC_HANDLERS, OPERATION_HANDLERS):
        monkeypatch.setattr(registry, "_entries", dict(registry._entries))
