"""Regularizers: a registry of named loss terms, their specs, the set that runs them, built-ins."""

from lit_losses.regularizers import builtins
from lit_losses.regularizers.legacy import legacy_term, sequence_logprobs
from lit_losses.regularizers.registry import NEEDS, REGISTRY, RegistryEntry, register_regularizer
from lit_losses.regularizers.regularizer_set import RegularizerError, RegularizerSet, Term
from lit_losses.regularizers.schedule import Schedule
from lit_losses.regularizers.spec import RegularizerSpec

__all__ = [
    "NEEDS",
    "REGISTRY",
    "RegistryEntry",
    "RegularizerError",
    "RegularizerSet",
    "RegularizerSpec",
    "Schedule",
    "Term",
    "builtins",
    "legacy_term",
    "register_regularizer",
    "sequence_logprobs",
]
