"""The sequence form's view of a micro-batch: ``data`` (a `Datum` per sequence), an aligned ``logprobs_list``.

The form is explained in ``docs/tutorials/regularizers.md``.

A loss function in the sequence form, ``fn(data, logprobs_list) -> (loss, metrics)``, receives

- ``data``: one `Datum` per sequence, in order: a row, or in packed rows (``segment_ids``) a
  (row, segment) pair, segments in their order in the row. Padding (a row's last segment when its id is
  0 and it has no target, the layout of `lit_losses.TextDataModule`) is no sequence; any other sequence
  without a target is kept, with an empty tensor.
- ``logprobs_list``: ``logprobs_list[i]`` is the 1-D tensor of ``log p(target)`` at the targets of
  ``data[i]`` (positions whose label is not ``ignore_index``), aligned with
  ``data[i].loss_fn_inputs["target_tokens"]``; empty where the sequence has no target. The tensors are
  views of the head's log-probabilities: gradients flow to the model.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lit_losses.aggregation import GLOBAL_STATS_KEY, LABELS_KEY
from lit_losses.aggregation.stats import batch_segment_ids

if TYPE_CHECKING:
    from lit_losses.loss.context import LossContext

SequenceFn = Callable[[list["Datum"], list[Tensor]], Any]
"""A sequence-form loss function: ``fn(data, logprobs_list) -> (loss, metrics)`` (or a coroutine of it)."""

_CACHE_KEY = "sequence_inputs"


class Datum:
    """One sequence of a micro-batch, as a sequence-form function ``fn(data, logprobs_list)`` sees it.

    A read-only mapping of the sequence's batch fields: per-token fields (tensors ``[B, T, ...]``, e.g.
    ``input_ids``, ``labels``, ``position_ids``) at the sequence's positions, per-row fields (tensors or
    lists of length ``B``) at its row, anything else as in the batch (each sliced when first read). The
    sequence form's names:

    - ``model_input``: the sequence's input tokens (``datum["input_ids"]``),
    - ``loss_fn_inputs["target_tokens"]``: its targets (labels at its target positions, ignored
      positions left out), aligned with ``logprobs_list[i]``,
    - ``loss_fn_inputs["weights"]``: the batch's per-token ``weights`` (else ``loss_weights``) at those
      targets, else ``1.0`` per target; ``loss_fn_inputs["logprobs"]`` and ``["advantages"]``: the
      batch's ``sampling_logprobs`` and ``advantages`` at those targets, when it has them.

    Attributes:
        row: its row in the micro-batch.
        segment: its segment id (``None`` without ``segment_ids``).
        positions: its positions in the row (1-D ``long``).
        target_mask: which of its positions have a target (1-D ``bool``, ``len(positions)``).

    Example:
        >>> import torch
        >>> batch = {"input_ids": torch.tensor([[5, 6, 7]]), "labels": torch.tensor([[6, 7, -100]])}
        >>> data = sequence_data(batch, batch["labels"] != -100)
        >>> datum = data[0]
        >>> datum.model_input, datum.loss_fn_inputs["target_tokens"], datum["labels"]
        (tensor([5, 6, 7]), tensor([6, 7]), tensor([   6,    7, -100]))
    """

    __slots__ = ("_fields", "_index", "_mask", "_source", "positions", "row", "segment")

    def __init__(
        self,
        fields: dict[str, Any],
        row: int,
        segment: int | None,
        positions: Tensor,
        target_mask: Tensor | None = None,
        source: tuple[dict[str, Any], Tensor, slice | Tensor] | None = None,
    ) -> None:
        self._fields = dict(fields)
        self.row = row
        self.segment = segment
        self.positions = positions
        self._mask = target_mask
        self._source = source  # (batch, mask, index), sliced lazily
        self._index = source[2] if source is not None else None

    def _keys(self) -> list[str]:
        if self._source is None:
            return list(self._fields)
        return [k for k in self._source[0] if k != GLOBAL_STATS_KEY]

    def __getitem__(self, key: str) -> Any:
        if key not in self._fields:
            if self._source is None or key not in self._source[0] or key == GLOBAL_STATS_KEY:
                raise KeyError(f"datum field {key!r} is missing; it has fields {sorted(self._keys())}")
            batch, mask, index = self._source
            self._fields[key] = _field(batch[key], self.row, index, shape=tuple(mask.shape))
        return self._fields[key]

    def __contains__(self, key: object) -> bool:
        return key in self._keys()

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys())

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def keys(self) -> list[str]:
        return self._keys()

    @property
    def fields(self) -> dict[str, Any]:
        """Every field of the sequence (all sliced now)."""
        return {k: self[k] for k in self._keys()}

    @property
    def target_mask(self) -> Tensor:
        if self._mask is None:
            self._mask = self._source[1][self.row, self._index]
        return self._mask

    @property
    def model_input(self) -> Tensor | None:
        """The sequence's input tokens (the sequence form's ``datum.model_input``)."""
        return self.get("input_ids")

    @property
    def loss_fn_inputs(self) -> dict[str, Tensor]:
        """``{"target_tokens", "weights"[, "logprobs", "advantages"]}`` at the targets."""
        targets = self[LABELS_KEY][self.target_mask]
        inputs = {"target_tokens": targets}
        for name, keys in (
            ("weights", ("weights", "loss_weights")),
            ("logprobs", ("sampling_logprobs",)),
            ("advantages", ("advantages",)),
        ):
            value = next((v for v in map(self._at_targets, keys) if v is not None), None)
            if value is not None:
                inputs[name] = value
        if "weights" not in inputs:
            inputs["weights"] = torch.ones(targets.shape, dtype=torch.float32, device=targets.device)
        return inputs

    def _at_targets(self, key: str) -> Tensor | None:
        """The per-token field ``key`` at the sequence's targets (float), or ``None``."""
        value = self.get(key)
        if isinstance(value, Tensor) and value.shape == self.target_mask.shape:
            return value[self.target_mask].float()
        return None

    def __repr__(self) -> str:
        where = f"row={self.row}" + ("" if self.segment is None else f", segment={self.segment}")
        return f"Datum({where}, tokens={len(self.positions)}, targets={int(self.target_mask.sum())})"


def _layout(mask: Tensor, segment_ids: Tensor | None) -> tuple[list[tuple], Tensor, list[int]]:
    """Every sequence in order as ``(row, segment, positions, index)``, the flat indices of their targets
    (row-major ``row · T + position``, in sequence order) and each one's number of targets.

    Vectorized: one ``unique`` and one stable sort for the whole micro-batch, whatever its number of
    sequences; ``index`` is a slice where the positions are contiguous (fields are then views).
    """
    B, T = mask.shape
    mask_cpu = mask.detach().cpu().reshape(-1)
    if segment_ids is None:
        positions = torch.arange(T)
        spans = [(row, None, positions, slice(0, T)) for row in range(B)]
        return spans, torch.nonzero(mask_cpu).squeeze(1), mask.detach().cpu().sum(1).tolist()
    if segment_ids.shape != mask.shape:
        raise ValueError(
            f"batch key 'segment_ids' has shape {tuple(segment_ids.shape)}, expected the labels' "
            f"shape {tuple(mask.shape)}"
        )
    seg = segment_ids.detach().cpu().long()
    low = int(seg.min()) if seg.numel() else 0
    width = int(seg.max()) - low + 1 if seg.numel() else 1
    flat = torch.arange(B * T)
    key = (torch.arange(B)[:, None] * width + seg - low).reshape(-1)
    keys, sequence = torch.unique(key, return_inverse=True)
    first = torch.full((len(keys),), B * T).scatter_reduce(0, sequence, flat, "amin")
    last = torch.full((len(keys),), -1).scatter_reduce(0, sequence, flat, "amax")
    by_first = first.argsort()  # by row, then first position in the row
    rank = torch.empty_like(by_first)
    rank[by_first] = torch.arange(len(keys))
    seq_rank = rank[sequence]
    order = torch.sort(seq_rank, stable=True).indices  # positions grouped by sequence, ascending
    counts = torch.bincount(seq_rank, minlength=len(keys))
    n_targets = torch.bincount(seq_rank[mask_cpu], minlength=len(keys)).tolist()
    first, last = first[by_first], last[by_first]
    rows, starts = (first // T).tolist(), (first % T).tolist()
    contiguous = (last - first + 1 == counts).tolist()
    segments = (keys[by_first] % width + low).tolist()
    groups, positions = torch.split(order, counts.tolist()), torch.split(order % T, counts.tolist())
    spans, kept, target_counts = [], [], []
    for i, (row, segment) in enumerate(zip(rows, segments, strict=True)):
        trailing = i + 1 == len(rows) or rows[i + 1] != row
        first_of_row = i == 0 or rows[i - 1] != row
        if segment == 0 and trailing and not first_of_row and n_targets[i] == 0:
            continue  # padding: the row's last segment, id 0, without target
        index = slice(starts[i], starts[i] + len(positions[i])) if contiguous[i] else positions[i]
        spans.append((row, segment, positions[i], index))
        kept.append(groups[i])
        target_counts.append(n_targets[i])
    targets = torch.cat(kept) if kept else order[:0]
    return spans, targets[mask_cpu[targets]], target_counts


def _field(value: Any, row: int, index: slice | Tensor, shape: tuple[int, int]) -> Any:
    if isinstance(value, Tensor):
        if value.dim() >= 2 and tuple(value.shape[:2]) == shape:
            return value[row, index.to(value.device) if isinstance(index, Tensor) else index]
        if value.dim() >= 1 and value.shape[0] == shape[0]:
            return value[row]
        return value
    if isinstance(value, list | tuple) and len(value) == shape[0]:
        return value[row]
    return value


def _build(batch: dict[str, Any], mask: Tensor) -> tuple[list[Datum], Tensor, list[int]]:
    spans, targets, counts = _layout(mask, batch_segment_ids(batch))
    data = []
    for row, segment, positions, index in spans:
        device_index = index.to(mask.device) if isinstance(index, Tensor) else index
        data.append(Datum({}, row, segment, positions=positions, source=(batch, mask, device_index)))
    return data, targets, counts


def sequence_data(batch: dict[str, Any], mask: Tensor) -> list[Datum]:
    """One `Datum` per sequence of ``batch`` (``mask``: which positions have a target)."""
    return _build(batch, mask)[0]


def aligned_logprobs(logprobs: Tensor, targets: Tensor, counts: list[int]) -> list[Tensor]:
    """``logprobs [B, T]`` at the flat ``targets`` (row-major), split into ``counts``: one 1-D view per
    datum (one gather, one split)."""
    flat = logprobs.reshape(-1).index_select(0, targets.to(logprobs.device))
    return list(torch.split(flat, counts))


def sequence_inputs(ctx: LossContext) -> tuple[list[Datum], list[Tensor]]:
    """``(data, logprobs_list)`` of ``ctx``, built once per context (fresh lists on every call)."""
    if _CACHE_KEY not in ctx.cache:
        data, targets, counts = _build(ctx.batch, ctx.mask)
        ctx.cache[_CACHE_KEY] = (data, aligned_logprobs(ctx.logprobs, targets, counts))
    data, logprobs_list = ctx.cache[_CACHE_KEY]
    return list(data), list(logprobs_list)


def sequence_logprobs(ctx: LossContext) -> list[Tensor]:
    """``logprobs_list`` of ``ctx``: one 1-D tensor per sequence, aligned with `sequence_data`."""
    return sequence_inputs(ctx)[1]


def is_coroutine_function(fn: Any) -> bool:
    """Whether calling ``fn`` (a function, a ``functools.partial``, a callable object) gives a coroutine."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if inspect.isfunction(fn) or inspect.ismethod(fn):
        return inspect.iscoroutinefunction(fn)
    return inspect.iscoroutinefunction(type(fn).__call__)


def takes_sequences(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` has the sequence form's signature: two required positional parameters
    ``(data, logprobs_list)``; one (``ctx``), ``*args`` only or an unreadable signature: ``False``."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in positional and p.default is p.empty for p in parameters) >= 2


class _SequencesTerm:
    """``fn(data, logprobs_list)`` called as ``term(ctx)`` (picklable when ``fn`` is)."""

    def __init__(self, fn: SequenceFn) -> None:
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)

    def __call__(self, ctx: LossContext) -> Any:
        return self.fn(*sequence_inputs(ctx))


class _AsyncSequencesTerm(_SequencesTerm):
    async def __call__(self, ctx: LossContext) -> Any:
        return await self.fn(*sequence_inputs(ctx))


def sequences_term(fn: SequenceFn) -> Callable[[LossContext], Any]:
    """``fn(data, logprobs_list)`` as a term ``term(ctx)`` (a coroutine function when ``fn`` is one)."""
    return _AsyncSequencesTerm(fn) if is_coroutine_function(fn) else _SequencesTerm(fn)
