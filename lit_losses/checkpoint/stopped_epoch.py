"""Resuming from a checkpoint taken when ``max_steps`` stopped an epoch before its data ran out.

The user need: extending a finished run (``max_steps`` raised, ``ckpt_path`` its last checkpoint). Without
this repair the resumed run silently skips the rest of the stopped epoch's data and repeats the start of
another permutation: a different, wrong data order with no error.

When ``max_steps`` ends a fit in the middle of an epoch, Lightning still runs ``on_train_epoch_end`` and
counts the epoch as *processed* (and, once the fit returns, *completed*); a checkpoint saved then
(`ModelCheckpoint`'s epoch-end save, or ``trainer.save_checkpoint`` after the fit) reads, on resume, as
"epoch e is over" while its batch counter is mid-epoch. Lightning then continues at that batch index with
the sampler of epoch ``e + 1``: the rest of epoch ``e`` would be replaced by the start of another
permutation. Extending a
finished run with a larger ``max_steps`` is common, so `reopen_stopped_epoch` turns such a checkpoint back
into the mid-epoch one it is, when the train loaders' saved positions (`GlobalStatsLoader`) say their
pass was not over: the resumed run then continues the epoch exactly as the uninterrupted run.

The counters edited are those of the checkpoint's ``loops.fit_loop.epoch_progress`` (Lightning's
checkpoint format); nothing else is touched.
"""

from __future__ import annotations

from typing import Any

from lit_losses.aggregation.position import LoaderPosition


def reopen_stopped_epoch(checkpoint: dict[str, Any]) -> bool:
    """Mark the epoch of ``checkpoint`` as still running when ``max_steps`` stopped it early.

    Args:
        checkpoint: a Lightning checkpoint dict, before Lightning restores its loops from it.

    Returns:
        Whether the checkpoint was changed: its epoch was counted as processed while every train loader's
        saved position is inside that epoch's pass (with several loaders, a shorter one restarts its pass
        within an epoch: the epoch ended if any pass did).

    Example:
        >>> progress = {"ready": 1, "started": 1, "processed": 1, "completed": 0}
        >>> ckpt = {"loops": {"fit_loop": {
        ...     "epoch_progress": {"total": dict(progress), "current": dict(progress)},
        ...     "state_dict": {"combined_loader": [{"epoch": 0, "index": 2, "length": 4}]}}}}
        >>> reopen_stopped_epoch(ckpt), ckpt["loops"]["fit_loop"]["epoch_progress"]["total"]["processed"]
        (True, 0)
        >>> reopen_stopped_epoch(ckpt)  # now a mid-epoch checkpoint: nothing more to do
        False
        >>> passes = [{"index": 4, "length": 4}, {"index": 1, "length": 3}]  # two loaders, max_size_cycle
        >>> ended = {"epoch_progress": {"total": dict(progress), "current": dict(progress)},
        ...          "state_dict": {"combined_loader": passes}}
        >>> reopen_stopped_epoch({"loops": {"fit_loop": ended}})  # the longest pass ended: so did the epoch
        False
    """
    fit_loop = (checkpoint.get("loops") or {}).get("fit_loop") or {}
    progress = fit_loop.get("epoch_progress") or {}
    total, current = progress.get("total"), progress.get("current")
    if not total or not current:
        return False
    epoch = total["started"] - 1
    ended = total["ready"] == total["started"] == total["processed"] and total["completed"] >= epoch
    states = (fit_loop.get("state_dict") or {}).get("combined_loader") or []
    positions = [LoaderPosition.from_state(s) for s in states if isinstance(s, dict) and "index" in s]
    inside = [not p.finished and p.index > 0 and p.epoch in (None, epoch) for p in positions]
    if not ended or not positions or not all(inside):  # one finished pass: the epoch did end
        return False
    for counters in (total, current):
        counters["processed"] = counters["completed"] = counters["started"] - 1
    return True
