"""`GlobalStatsLoader`: a DataLoader that knows each optimizer step's global counts in advance."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from itertools import islice
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lit_losses.aggregation.position import LoaderPosition, LoaderStats, iterate_from
from lit_losses.aggregation.stats import (
    LABELS_KEY,
    LabelFormat,
    count_masks,
    counts_to_tensor,
    sum_counts,
    tensor_to_counts,
)
from lit_losses.choices import check_choice
from lit_losses.distributed import all_reduce
from lit_losses.errors import ConfigError

GLOBAL_STATS_KEY = "global_stats"
"""The batch key under which the loader attaches the `GlobalStats` of a micro-batch."""
BatchTransform = Callable[[dict[str, Any], int], dict[str, Any]]
"""``transform(batch, ignore_index) -> batch``: applied to each micro-batch before it is counted."""


class GlobalStatsLoader(DataLoader):
    """A ``DataLoader`` whose micro-batches carry the global counts of their optimizer step.

    Iterating it reads one accumulation window ahead (``accumulate_grad_batches`` micro-batches, fewer
    for the trailing window of an epoch), counts the valid tokens and sequences of every mask key in each
    micro-batch, sums them over the window and all-reduces the sums over the data-parallel group: **one
    collective per optimizer step**, before the first micro-batch's loss is computed. Each micro-batch
    (a dict) is then yielded with ``batch["global_stats"] = LoaderStats(masks=global counts,
    loss_scale=A × D, local=its own counts, position, window, index, ends_window)``.

    Windows follow Lightning's batch index: window ``k`` of a pass holds the micro-batches with index
    ``[k·A, min((k+1)·A, length))``, ``length`` being Lightning's number of batches per epoch; each
    micro-batch's `LoaderStats` carry its index, and `check_window` raises if Lightning's ``batch_idx``
    or its window ends disagree.

    **Resumable**: ``state_dict`` / ``load_state_dict`` save and restore the position in the pass
    (`LoaderPosition`), which Lightning does with every checkpoint; a run resumed mid-epoch continues
    with the next micro-batch (the skipped ones are not loaded: the sampler skips their indices), and
    its windows line up with the uninterrupted run's.

    It is a plain ``DataLoader`` otherwise: Lightning may re-create it to inject its
    ``DistributedSampler`` (the init arguments are kept), workers (``num_workers > 0``) produce the
    micro-batches while the lookahead runs in the main process. Every rank must see the same number of
    micro-batches per epoch (Lightning's ``DistributedSampler`` guarantees it), or the collective hangs.

    `RegularizedLM` configures the loader at ``on_train_start`` from its trainer and its loss terms
    (``accumulate_grad_batches``, mask keys, ``ignore_index``, the number of batches per epoch after
    ``limit_train_batches``); values given here must agree with the trainer's.

    Args:
        *args: ``DataLoader`` arguments (micro-batches must be dicts: use ``batch_size=None`` with a
            dataset whose items are whole micro-batches, or a ``collate_fn`` that returns a dict).
        accumulate_grad_batches: micro-batches per optimizer step (``None``: from the trainer).
        mask_keys: mask keys to count; ``"labels"`` means ``labels != ignore_index``, any other key a
            0/1 or boolean tensor of the batch (``None``: from the module, else ``("labels",)``).
        ignore_index: label value of positions without a target.
        label_format: ``input_aligned`` for Hugging Face collators' labels, counted after the model's
            shift (`count_masks`); ``None``: from the module (``next_token`` unless it says otherwise).
        process_group: group to all-reduce over (default: the whole world when initialized).
        **kwargs: ``DataLoader`` keyword arguments.

    Example:
        >>> import torch
        >>> micro_batches = [{"labels": torch.tensor([[5, 6, 7, 8]])}, {"labels": torch.tensor([[5, -100]])}]
        >>> loader = GlobalStatsLoader(micro_batches, batch_size=None, accumulate_grad_batches=2)
        >>> [(b["global_stats"].get().num_tokens, b["global_stats"].get_local().num_tokens) for b in loader]
        [(5, 4), (5, 1)]
    """

    def __init__(
        self,
        *args: Any,
        accumulate_grad_batches: int | None = None,
        mask_keys: Sequence[str] | None = None,
        ignore_index: int = -100,
        label_format: LabelFormat | None = None,
        process_group: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        check_loader_options(
            accumulate_grad_batches=accumulate_grad_batches,
            mask_keys=mask_keys,
            ignore_index=ignore_index,
            label_format=label_format,
        )
        self.accumulate_grad_batches = accumulate_grad_batches
        self.mask_keys = tuple(mask_keys) if mask_keys is not None else None
        self.ignore_index = ignore_index
        self.label_format = label_format
        self.process_group = process_group
        self.max_batches: int | None = None
        self.transform: BatchTransform | None = None
        """Applied to every micro-batch before it is counted (`configure`; e.g. a rollout rejection)."""
        self.position = LoaderPosition()
        """Where the current pass is (what `state_dict` saves)."""
        self._resume: LoaderPosition | None = None
        self._pending_skip = 0
        self.lookahead_seconds = 0.0
        """Time spent counting and all-reducing (for benchmarks)."""

    def configure(
        self,
        accumulate_grad_batches: int,
        mask_keys: Sequence[str],
        ignore_index: int,
        max_batches: int | float | None = None,
        label_format: LabelFormat = "next_token",
        transform: BatchTransform | None = None,
    ) -> None:
        """Take the trainer's and the module's settings (called by `RegularizedLM.on_train_start`),
        checked as the constructor's (`check_loader_options`; ``max_batches >= 0``);
        ``transform(batch, ignore_index)`` changes each micro-batch before it is counted (the module's
        rejection of rollout tokens, whose labels leave the step's denominators)."""
        check_loader_options(
            accumulate_grad_batches=accumulate_grad_batches,
            mask_keys=mask_keys,
            ignore_index=ignore_index,
            label_format=label_format,
        )
        if max_batches is not None and not max_batches >= 0:
            raise ConfigError(f"GlobalStatsLoader: max_batches must be >= 0 (or None), got {max_batches!r}")
        if accumulate_grad_batches is None:
            raise ConfigError(
                "GlobalStatsLoader.configure: accumulate_grad_batches must be an integer >= 1, got None"
            )
        if self.accumulate_grad_batches not in (None, accumulate_grad_batches):
            raise ConfigError(
                f"GlobalStatsLoader(accumulate_grad_batches={self.accumulate_grad_batches}) disagrees with "
                f"trainer.accumulate_grad_batches={accumulate_grad_batches}"
            )
        if self.label_format not in (None, label_format):
            raise ConfigError(
                f"GlobalStatsLoader(label_format={self.label_format!r}) disagrees with the model's "
                f"label_format={label_format!r} (model.init_args.label_format)"
            )
        self.label_format = label_format
        self.accumulate_grad_batches = accumulate_grad_batches
        keys = dict.fromkeys((*(self.mask_keys or ()), *mask_keys))
        self.mask_keys = tuple(keys)
        self.ignore_index = ignore_index
        finite = max_batches is not None and max_batches != float("inf")
        self.max_batches = int(max_batches) if finite else None
        self.transform = transform

    def __iter__(self) -> Iterator[Any]:
        return self._pass()

    # ---- resumable position (Lightning saves `state_dict` in checkpoints and restores it) ---------
    def state_dict(self) -> dict[str, Any]:
        """The position in the current pass (`LoaderPosition`): Lightning saves it in checkpoints."""
        return self.position.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the next pass where the checkpointed one was (Lightning calls it before iterating)."""
        self._resume = LoaderPosition.from_state(state_dict)

    def skip(self, num_batches: int) -> None:
        """Drop the next ``num_batches`` micro-batches of the current pass (e.g. after a loss spike).

        Lightning's count of the epoch does not change, so the pass ends early: at the last whole
        accumulation window that the remaining data fills (the trailing micro-batches of a partial
        window are dropped too), and Lightning then ends the epoch.
        """
        if num_batches < 0:
            raise ValueError(f"GlobalStatsLoader.skip: num_batches must be >= 0, got {num_batches}")
        self._pending_skip += num_batches

    # ---- one pass ----------------------------------------------------------------------------
    def _pass(self) -> Iterator[Any]:
        """Windows aligned with Lightning's batch index: window ``k`` holds the micro-batches with index
        ``[k·A, min((k+1)·A, length))``. The data iterator is created at the first ``next``, after
        Lightning has set the sampler's epoch."""
        window_size = self.accumulate_grad_batches
        if window_size is None:
            raise ConfigError(
                "GlobalStatsLoader has no accumulate_grad_batches: pass it to the loader, or train a "
                "RegularizedLM (which configures the loader when training starts)"
            )
        keys = self.mask_keys or (LABELS_KEY,)
        epoch, length = getattr(self.sampler, "epoch", None), self.max_batches
        resume, self._resume, self._pending_skip = self._resume, None, 0
        start = resume.resume_point(epoch, length, window_size) if resume else 0
        skipped = resume.skipped if resume and start else 0
        self.position = LoaderPosition(
            epoch, start, skipped, length=length, accumulate_grad_batches=window_size
        )
        batches = iterate_from(self, start + skipped)
        while length is None or self.position.index < length:
            if self._pending_skip:
                dropped = sum(1 for _ in islice(batches, self._pending_skip))
                self.position.skipped += dropped
                self._pending_skip = 0
            index = self.position.index
            size = window_size - index % window_size
            if length is not None:
                size = min(size, length - index)
            window = list(islice(batches, size))
            if not window or (length is not None and len(window) < size):
                break  # the data ended before Lightning's count: no partial window (see `skip`)
            yield from self._attach(window, window_size, keys, index=index)
        self.position.done = True

    def _attach(self, window: list[Any], window_size: int, keys: Sequence[str], index: int) -> Iterator[Any]:
        start = time.perf_counter()
        for i, batch in enumerate(window):
            if not isinstance(batch, dict):
                raise TypeError(
                    f"GlobalStatsLoader needs dict micro-batches (item {i} of a window is a "
                    f"{type(batch).__name__})"
                )
        if self.transform is not None:
            window = [self.transform(batch, self.ignore_index) for batch in window]
        label_format = self.label_format or "next_token"
        local = [count_masks(batch, keys, self.ignore_index, label_format=label_format) for batch in window]
        totals, world_size = self._all_reduce(counts_to_tensor(sum_counts(local), keys))
        masks = tensor_to_counts(totals, keys)
        self.lookahead_seconds += time.perf_counter() - start
        for i, batch in enumerate(window):
            stats = LoaderStats(
                masks=masks,
                loss_scale=float(window_size * world_size),
                local=local[i],
                position=(index + i) % window_size,
                window=len(window),
                index=index + i,
                ends_window=i == len(window) - 1,
            )
            self.position.index = index + i + 1  # counted before Lightning sees it: saved as consumed
            yield {**batch, GLOBAL_STATS_KEY: stats}

    def _all_reduce(self, counts: torch.Tensor) -> tuple[torch.Tensor, int]:
        return all_reduce_counts(counts, self.process_group)


def check_loader_options(
    accumulate_grad_batches: Any, mask_keys: Any, ignore_index: Any, label_format: Any
) -> None:
    """Refuse `GlobalStatsLoader` options of the wrong type or range, with one `ConfigError` line each.

    Example:
        >>> check_loader_options(  # doctest: +ELLIPSIS
        ...     accumulate_grad_batches=2, mask_keys="labels", ignore_index=-100, label_format=None
        ... )
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: GlobalStatsLoader: mask_keys must be a sequence of ...
    """
    accumulate = accumulate_grad_batches
    if accumulate is not None and (
        isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1
    ):
        raise ConfigError(
            f"GlobalStatsLoader: accumulate_grad_batches must be an integer >= 1, got {accumulate!r}"
        )
    if isinstance(mask_keys, str) or (
        mask_keys is not None and not all(isinstance(k, str) for k in mask_keys)
    ):
        raise ConfigError(
            f"GlobalStatsLoader: mask_keys must be a sequence of batch keys, got the string {mask_keys!r}"
            if isinstance(mask_keys, str)
            else f"GlobalStatsLoader: mask_keys must be batch key names (strings), got {list(mask_keys)!r}"
        )
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ConfigError(
            f"GlobalStatsLoader: ignore_index must be an integer label value, got {ignore_index!r}"
        )
    if label_format is not None:
        check_choice(label_format, LabelFormat, "GlobalStatsLoader: label_format")


def all_reduce_counts(counts: torch.Tensor, group: Any = None) -> tuple[torch.Tensor, int]:
    """``(Σ over the ranks of group of counts, number of ranks)``; ``(counts, 1)`` without a process group.

    Example:
        >>> import torch
        >>> all_reduce_counts(torch.tensor([[5, 2]]))  # one process
        (tensor([[5, 2]]), 1)
    """
    if not (dist.is_available() and dist.is_initialized()):
        return counts, 1
    return all_reduce(counts, group=group).cpu(), dist.get_world_size(group)


def data_parallel_group(trainer: Any) -> Any:
    """The group whose ranks' counts make a step's global counts: the ``data_parallel`` dimension of the
    device mesh under Lightning's ``ModelParallelStrategy`` (its tensor-parallel ranks hold the same
    micro-batches), else ``None`` (the whole world)."""
    mesh = getattr(getattr(trainer, "lightning_module", None), "device_mesh", None)
    if mesh is None or "data_parallel" not in (mesh.mesh_dim_names or ()):
        return None
    return mesh["data_parallel"].get_group()
