"""Regularizers: a registry of named loss terms, their specs, the set that runs them, built-ins.

Layers: `spec` (configuration) → `registry` (names) → `term` (one resolved term, its checks) →
`runner` (`RegularizerSet`, the general path) and `fused` (pointwise terms inside the fused head);
`sequences` is the sequence form's ``fn(data, logprobs_list)`` view, `scalar` the rule for scalar terms,
`executors` and `process` where terms run; `builtins` and `legacy` are terms; `testing` checks a term's
gradient.
"""

from lit_losses.regularizers import builtins
from lit_losses.regularizers.fused import FusedTerms
from lit_losses.regularizers.legacy import legacy_term
from lit_losses.regularizers.registry import NEEDS, REGISTRY, Need, RegistryEntry, register_regularizer
from lit_losses.regularizers.runner import RegularizerSet
from lit_losses.regularizers.scalar import ScalarRule, scalar_value
from lit_losses.regularizers.sequences import Datum, sequence_data, sequence_inputs, sequence_logprobs
from lit_losses.regularizers.spec import RegularizerSpec
from lit_losses.regularizers.term import RegularizerError, Term, TermResult
from lit_losses.schedule import Schedule

__all__ = [
    "NEEDS",
    "REGISTRY",
    "Datum",
    "FusedTerms",
    "Need",
    "RegistryEntry",
    "RegularizerError",
    "RegularizerSet",
    "RegularizerSpec",
    "ScalarRule",
    "Schedule",
    "Term",
    "TermResult",
    "builtins",
    "legacy_term",
    "register_regularizer",
    "scalar_value",
    "sequence_data",
    "sequence_inputs",
    "sequence_logprobs",
]
