"""The legacy single callback ``loss_fn(data, logprobs_list) -> (loss, metrics)`` as a term.

Functions in that form need no adapter in a `RegularizerSpec` (their signature says it, see
`lit_losses.regularizers.sequences`); `legacy_term` wraps one by hand, with extra keyword arguments.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import Tensor

from lit_losses.regularizers.sequences import Datum, sequences_term

if TYPE_CHECKING:
    from lit_losses.loss.context import LossContext

LegacyLossFn = Callable[[list[Datum], list[Tensor]], tuple[Tensor, dict[str, Any]]]


def legacy_term(loss_fn: LegacyLossFn, **kwargs: Any) -> Callable[[LossContext], Any]:
    """Wrap ``loss_fn(data, logprobs_list, **kwargs) -> (loss, metrics)`` (sync or async) as ``term(ctx)``.

    ``data`` holds one `Datum` per sequence and ``logprobs_list`` one aligned 1-D tensor per datum
    (`sequence_inputs`); the scalar ``loss`` follows the term's ``scalar`` rule (`scalar_value`) and
    ``metrics`` become the term's custom telemetry.
    """
    return sequences_term(functools.partial(loss_fn, **kwargs) if kwargs else loss_fn)
