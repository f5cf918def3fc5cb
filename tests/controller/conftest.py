import pytest

from lit_losses.controller import METRIC_HANDLERS, OPERATION_HANDLERS


@pytest.fixture
def isolated_registries():
    """Handlers registered by a test are gone after it (the registries are process-wide)."""
    with METRIC_HANDLERS.scoped(), OPERATION_HANDLERS.scoped():
        yield
