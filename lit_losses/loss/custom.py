"""``forward_backward_custom(data, loss_fn=None, regularizers=None)``, sync and async (Tinker's call).

For users who drive their own loop (manual optimization, notebooks): one forward pass of the model, the
loss functions on ``(data, logprobs_list)`` (`lit_losses.regularizers.sequences`), one backward pass into
the parameters' ``.grad``, and the metrics. The loss is
``loss_total = loss_fn + Σ_i weight_i · regularizer_i`` (either part may be absent, not both): the
model's own base loss and configured regularizers take no part, and every scalar is used as returned.

Under data parallelism (DDP, FSDP2: any initialized process group) the call is one step over the global
batch, the union of every rank's ``data``: the counts that the terms are normalized by are all-reduced
over the data-parallel group, each rank's loss is scaled by the group's size (which DDP's and FSDP's
gradient averaging divides back), and the metrics are the global batch's. Every rank must make the call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lit_losses.aggregation import GlobalStats, count_masks
from lit_losses.aggregation.loader import all_reduce_counts, data_parallel_group
from lit_losses.aggregation.stats import counts_to_tensor, tensor_to_counts
from lit_losses.distributed import all_reduce
from lit_losses.errors import ConfigError
from lit_losses.loss.context import LossContext
from lit_losses.loss.objective import agg_norm_option, batch_tensor, check_something_to_optimize
from lit_losses.regularizers import RegularizerSet, RegularizerSpec, TermResult
from lit_losses.regularizers.spec import as_spec

if TYPE_CHECKING:
    from lit_losses.heads import HeadOutput

BASE_NAME = "loss_fn"


def forward_backward_custom(
    model: Any,
    data: Sequence[Any] | Mapping[str, Any],
    loss_fn: Callable[..., Any] | None = None,
    regularizers: Sequence[Mapping[str, Any] | RegularizerSpec] | None = None,
) -> dict[str, Any]:
    """Forward, the sequence-form loss functions, backward: returns the telemetry dict of the call.

    Args:
        model: a `RegularizedLM` (its ``forward_hidden``, ``output_projection``, ``loss_agg`` and, for
            terms aggregated with ``seq-mean-token-sum-norm``, ``loss_agg_norm``: the constant ``C``).
        data: a batch dict (``input_ids``, ``labels``, optionally ``segment_ids``, …) or a list of
            sequences, each a dict with ``input_ids`` and ``labels`` (``ignore_index``: no target) or in
            the sequence form, ``model_input`` and ``loss_fn_inputs["target_tokens"]`` (and
            ``loss_fn_inputs["weights"]``: 0 = no target), padded into one batch. The functions get one
            `Datum` per sequence, in the same order.
        loss_fn: the legacy single callback ``loss_fn(data, logprobs_list) -> (loss, metrics)``.
        regularizers: sequence-form terms ``[{"fn": f, "weight": w, "name": n}, ...]`` (any `RegularizerSpec`
            field may be added: ``executor``, ``timeout_s``, ``on_error``, …); sync or async.

    Returns:
        ``{"loss_total", "base_loss": {"value", "weight", "custom"} (with ``loss_fn``), "regularizers":
        {name: {"value", "weight", "contribution", "custom", "error"}}, "regularizer_total"}`` (floats).

    Raises:
        ConfigError: a regularizer aggregated with ``seq-mean-token-sum-norm`` (its ``agg``, or the
            model's ``loss_agg``) while the model has no ``loss_agg_norm``.

    Example:
        >>> import torch
        >>> from lit_losses import TinyLM
        >>> model = TinyLM(vocab_size=16, d_model=8, n_layers=1, n_heads=2)
        >>> data = [{"input_ids": torch.tensor([1, 2, 3]), "labels": torch.tensor([2, 3, -100])}]
        >>> def sparsity(data, logprobs_list):
        ...     l1 = torch.stack([lp.abs().sum() for lp in logprobs_list]).mean()
        ...     return l1, {"l1": l1.item()}
        >>> metrics = forward_backward_custom(model, data, regularizers=[
        ...     {"fn": sparsity, "weight": 0.01, "name": "sparsity"}])
        >>> sorted(metrics["regularizers"]["sparsity"])
        ['contribution', 'custom', 'error', 'value', 'weight']
        >>> model.output_projection()[0].grad is not None  # backward ran
        True
    """
    call = _CustomCall(model, data, loss_fn, regularizers=regularizers)
    return call.finish(call.terms.executors.run(call.active, call.ctx))


async def forward_backward_custom_async(
    model: Any,
    data: Sequence[Any] | Mapping[str, Any],
    loss_fn: Callable[..., Any] | None = None,
    regularizers: Sequence[Mapping[str, Any] | RegularizerSpec] | None = None,
) -> dict[str, Any]:
    """`forward_backward_custom` from a coroutine: async functions run concurrently on the caller's
    event loop (thread and process terms as configured), so the loop stays free while they wait.

    Example:
        >>> import asyncio, torch
        >>> from lit_losses import TinyLM
        >>> model = TinyLM(vocab_size=16, d_model=8, n_layers=1, n_heads=2)
        >>> data = [{"input_ids": torch.tensor([1, 2, 3]), "labels": torch.tensor([2, 3, -100])}]
        >>> async def remote(data, logprobs_list):
        ...     await asyncio.sleep(0.01)  # e.g. a knowledge-base query
        ...     return -torch.cat(logprobs_list).mean(), {"queries": len(data)}
        >>> metrics = asyncio.run(forward_backward_custom_async(model, data, loss_fn=remote))
        >>> metrics["base_loss"]["custom"], metrics["loss_total"] == metrics["base_loss"]["value"]
        ({'queries': 1.0}, True)
    """
    call = _CustomCall(model, data, loss_fn, regularizers=regularizers)
    return call.finish(await call.terms.executors.run_async(call.active, call.ctx))


class _CustomCall:
    """One call: the forward pass and the terms (`__init__`), then the loss, backward, metrics (`finish`)."""

    def __init__(self, model: Any, data: Any, loss_fn: Any, regularizers: Any) -> None:
        if loss_fn is None and not regularizers:
            raise ValueError("forward_backward_custom: give loss_fn or regularizers (or both)")
        specs = [as_spec(r, f"regularizers[{i}]") for i, r in enumerate(regularizers or ())]
        executors = model.regularizer_set.executors  # one event loop and process pool per model
        self.model = model
        self.has_base = loss_fn is not None
        self.terms = RegularizerSet(specs, model.loss_agg, executors=executors)
        base = [RegularizerSpec(BASE_NAME, fn=loss_fn, legacy=True)] if loss_fn is not None else []
        self.base = RegularizerSet(base, model.loss_agg, executors=executors)
        self.terms.agg_norm = self.base.agg_norm = _agg_norm(model, self.terms)
        batch = dict(data) if isinstance(data, Mapping) else collate(data, model.ignore_index)
        labels = batch_tensor(batch, "labels")
        needs = {"logprobs", *self.terms.needs(), *self.base.needs()} - {"hidden"}
        outputs = ("logprobs", *sorted(needs - {"logprobs"}))
        hidden, head = model.forward_head_outputs(batch, outputs)  # FSDP gathers the parameters here
        mask_keys = ("labels", *self.terms.mask_keys())
        self.group = _data_parallel_group(model)
        stats = step_stats(batch, mask_keys, model.ignore_index, group=self.group)
        step = int(model.global_step)
        self.ctx = LossContext(
            batch, head, hidden, mask=labels != model.ignore_index, stats=stats, step=step, stage="train"
        )
        self.base_active = self.base.prepare(self.ctx)
        self.reg_active = self.terms.prepare(self.ctx)
        self.active = self.base_active + self.reg_active

    def finish(self, outcomes: list[Any]) -> dict[str, Any]:
        n = len(self.base_active)
        base_total, base_terms = self.base.combine(self.ctx, self.base_active, outcomes[:n])
        reg_total, reg_terms = self.terms.combine(self.ctx, self.reg_active, outcomes[n:])
        total = base_total + reg_total
        check_something_to_optimize(total, {**base_terms, **reg_terms}, "forward_backward_custom")
        self._backward(total * self.ctx.stats.loss_scale)
        return self._global_metrics(total, reg_total, {**base_terms, **reg_terms})

    def _global_metrics(
        self, total: Tensor, reg_total: Tensor, results: dict[str, TermResult]
    ) -> dict[str, Any]:
        """The metrics of the global batch: this rank's shares summed over the ranks (error flags: max)."""
        shares = [total, reg_total]
        for result in results.values():
            shares += [result.value, result.contribution]
        sums, worst = _all_reduce_metrics(shares, [r.error for r in results.values()], self.group)
        entries = {
            name: _entry(result, value=sums[2 + 2 * i], contribution=sums[3 + 2 * i], error=worst[i])
            for i, (name, result) in enumerate(results.items())
        }
        metrics: dict[str, Any] = {"loss_total": sums[0]}
        if self.has_base:
            base = entries.pop(BASE_NAME)
            metrics["base_loss"] = {"value": base["value"], "weight": 1.0, "custom": base["custom"]}
        metrics["regularizers"] = entries
        metrics["regularizer_total"] = sums[1]
        return metrics

    def _backward(self, total: Tensor) -> None:
        """``total.backward()``; inside a Lightning fit, ``manual_backward`` (precision, strategies)."""
        try:
            trainer = self.model.trainer
        except RuntimeError:  # not attached to a Trainer
            trainer = None
        if trainer is not None and trainer.training:
            self.model.manual_backward(total)
        else:
            total.backward()


def _agg_norm(model: Any, terms: RegularizerSet) -> float | None:
    """The constant ``C`` of ``seq-mean-token-sum-norm`` for the call's terms: ``model.loss_agg_norm``
    (the model's `Objective` holds it), a `ConfigError` naming the terms that need it when it is unset."""
    try:
        return agg_norm_option(model.objective.loss_agg_norm, model.loss_agg, terms)
    except ConfigError as exc:
        raise ConfigError(f"forward_backward_custom: {exc}") from None


def _data_parallel_group(model: Any) -> Any:
    """The data-parallel group of the model's trainer (`data_parallel_group`), else the whole world."""
    try:
        trainer = model.trainer
    except RuntimeError:  # not attached to a Trainer
        return None
    return data_parallel_group(trainer)


def step_stats(
    batch: Mapping[str, Any], mask_keys: Sequence[str], ignore_index: int, group: Any
) -> GlobalStats:
    """The counts of the step: this batch's summed over the ranks of ``group`` (all of them when no process
    group is initialized: one process), ``loss_scale`` the number of ranks.

    Example:
        >>> import torch
        >>> stats = step_stats({"labels": torch.tensor([[1, -100]])}, ("labels",), -100, None)
        >>> stats.get("labels").num_tokens, stats.loss_scale
        (1, 1.0)
    """
    local = count_masks(batch, dict.fromkeys(mask_keys), ignore_index)
    keys = list(local)
    totals, ranks = all_reduce_counts(counts_to_tensor(local, keys), group)
    return GlobalStats(masks=tensor_to_counts(totals, keys), loss_scale=float(ranks), local=local)


def _all_reduce_metrics(
    shares: list[Any], errors: list[float], group: Any
) -> tuple[list[float], list[float]]:
    """``(Σ over the ranks of each share, max over the ranks of each error flag)`` as floats."""
    values = torch.tensor([float(torch.as_tensor(v).detach()) for v in shares], dtype=torch.float64)
    flags = torch.tensor([float(e) for e in errors], dtype=torch.float64)
    values = all_reduce(values, group=group)
    flags = all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=group)
    return values.tolist(), flags.tolist()


def _entry(result: TermResult, value: float, contribution: float, error: float) -> dict[str, Any]:
    return {
        "value": value,
        "weight": float(result.weight),
        "contribution": contribution,
        "custom": dict(result.custom),
        "error": error,
    }


def _ids(value: Any, where: str) -> Tensor:
    """A 1-D ``long`` tensor from a tensor, a list, or a Tinker-style ``ModelInput``/``TensorData``."""
    for method in ("to_ints", "tolist"):
        if not isinstance(value, Tensor) and callable(getattr(value, method, None)):
            value = getattr(value, method)()
    value = getattr(value, "data", value) if not isinstance(value, Tensor) else value
    tensor = torch.as_tensor(value)
    if tensor.dim() != 1:
        raise ValueError(f"{where} must be 1-D, got shape {tuple(tensor.shape)}")
    return tensor


def _get(item: Any, key: str) -> Any:
    return item.get(key) if isinstance(item, Mapping) else getattr(item, key, None)


def _sequence(item: Any, i: int, ignore_index: int) -> tuple[Tensor, Tensor]:
    """``(input_ids, labels)`` of ``data[i]``."""
    if _get(item, "input_ids") is not None and _get(item, "labels") is not None:
        ids = _ids(_get(item, "input_ids"), f"data[{i}].input_ids")
        labels = _ids(_get(item, "labels"), f"data[{i}].labels")
    elif _get(item, "model_input") is not None and _get(item, "loss_fn_inputs") is not None:
        inputs = _get(item, "loss_fn_inputs")
        ids = _ids(_get(item, "model_input"), f"data[{i}].model_input")
        labels = _ids(inputs["target_tokens"], f"data[{i}].loss_fn_inputs['target_tokens']").long()
        if inputs.get("weights") is not None:
            weights = _ids(inputs["weights"], f"data[{i}].loss_fn_inputs['weights']")
            labels = torch.where(weights.to(labels.device) != 0, labels, ignore_index)
    else:
        raise ValueError(
            f"data[{i}] must have 'input_ids' and 'labels', or the sequence form's 'model_input' and "
            f"'loss_fn_inputs'; got {type(item).__name__}"
        )
    if ids.shape != labels.shape:
        raise ValueError(f"data[{i}]: {len(ids)} input tokens but {len(labels)} targets")
    return ids.long(), labels.long()


def collate(data: Sequence[Any], ignore_index: int = -100) -> dict[str, Tensor]:
    """A list of sequences as one right-padded batch ``{"input_ids", "labels"}`` (row ``i`` = ``data[i]``).

    Example:
        >>> import torch
        >>> collate([{"input_ids": torch.tensor([1, 2]), "labels": torch.tensor([2, -100])},
        ...          {"model_input": [4], "loss_fn_inputs": {"target_tokens": [5], "weights": [1.0]}}])
        {'input_ids': tensor([[1, 2],
                [4, 0]]), 'labels': tensor([[   2, -100],
                [   5, -100]])}
    """
    if isinstance(data, str | bytes) or not isinstance(data, Sequence) or not data:
        raise ValueError(f"data must be a batch dict or a non-empty list of sequences, got {data!r:.80}")
    rows = [_sequence(item, i, ignore_index) for i, item in enumerate(data)]
    width = max(1, *(len(ids) for ids, _ in rows))
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), ignore_index, dtype=torch.long)
    for i, (ids, targets) in enumerate(rows):
        input_ids[i, : len(ids)], labels[i, : len(targets)] = ids, targets
    return {"input_ids": input_ids, "labels": labels}


class CustomLossMixin:
    """``forward_backward_custom`` and ``forward_backward_custom_async`` as `RegularizedLM` methods."""

    def forward_head_outputs(
        self, batch: dict[str, Any], outputs: Sequence[str]
    ) -> tuple[Tensor, HeadOutput]:
        """The body's hidden states and the fused head's ``outputs`` for ``batch`` (the forward pass of
        `forward_backward_custom`: one method, so that FSDP2 gathers the parameters around it)."""
        hidden = self.forward_hidden(batch)
        return hidden, self.output_head()(hidden, batch_tensor(batch, "labels"), tuple(outputs))

    def forward_backward_custom(
        self,
        data: Sequence[Any] | Mapping[str, Any],
        loss_fn: Callable[..., Any] | None = None,
        regularizers: Sequence[Mapping[str, Any] | RegularizerSpec] | None = None,
    ) -> dict[str, Any]:
        """The call for manual loops: see `lit_losses.loss.custom.forward_backward_custom`."""
        return forward_backward_custom(self, data, loss_fn, regularizers=regularizers)

    async def forward_backward_custom_async(
        self,
        data: Sequence[Any] | Mapping[str, Any],
        loss_fn: Callable[..., Any] | None = None,
        regularizers: Sequence[Mapping[str, Any] | RegularizerSpec] | None = None,
    ) -> dict[str, Any]:
        """Its async twin: see `lit_losses.loss.custom.forward_backward_custom_async`."""
        return await forward_backward_custom_async(self, data, loss_fn, regularizers)
