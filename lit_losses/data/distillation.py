"""`DistillationDataModule`: offline distillation records (JSONL, a teacher's top-k log-probabilities per
token) → packed micro-batches carrying ``teacher_topk_ids`` and ``teacher_topk_logprobs`` ``[B, T, k]``."""

from __future__ import annotations

from lit_losses.data.distill_records import check_same_k, read_distill_jsonl
from lit_losses.data.rl import RLDataModule
from lit_losses.data.rl_records import RLRow


class DistillationDataModule(RLDataModule):
    """Offline distillation data: an offline teacher's top-k log-probabilities (JSONL) → packed micro-batches.

    For ``model.distillation`` with ``teacher: null``. Each line of the ``paths`` files is one record
    (``tokens``, ``teacher_topk_ids``, ``teacher_topk_logprobs``, optional ``completion_mask``;
    `lit_losses.data.distill_records`), checked at ``setup`` (every error names ``file:line``; every record
    has the same ``k``), shuffled with ``seed``, split, packed (a record is never split) into micro-batches
    of at most ``tokens_per_batch`` tokens, served by a `GlobalStatsLoader` as `RLDataModule`'s.

    Args:
        paths: JSONL file globs of distillation records (required).
        vocab_size: the model's vocabulary size (linked to ``model.init_args.vocab_size`` by the CLI);
            every token id and every top-k id must be below it.
        seq_len: longest row, in tokens: a record holds at most ``seq_len + 1`` tokens.
        tokens_per_batch: token budget of a micro-batch (rows × longest row, ≥ ``seq_len``).
        packing: pack several records per row (else one record per row).
        val_fraction: fraction of records held out for validation.
        max_records: use only the first records (after the seeded shuffle); ``None``: all.
        seed: seed of the record shuffle and of each epoch's micro-batch order.
        pad_id: input token id at padding positions (no target, segment 0).
        num_workers: DataLoader workers.

    Example:
        >>> import json, pathlib, tempfile
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "teacher_topk.jsonl"
        >>> record = {"tokens": [2, 5, 6], "teacher_topk_ids": [None, [5, 1], [6, 2]],
        ...           "teacher_topk_logprobs": [None, [-0.25, -2.0], [-0.5, -1.5]]}
        >>> _ = path.write_text(json.dumps(record) + "\\n")
        >>> data = DistillationDataModule(paths=[str(path)], vocab_size=8, seq_len=4, tokens_per_batch=8)
        >>> data.setup("fit")
        >>> batch = data.train_set[0]
        >>> batch["labels"].tolist(), batch["teacher_topk_ids"].shape
        ([[5, 6]], torch.Size([1, 2, 2]))
        >>> batch["teacher_topk_logprobs"][0, 1].tolist()
        [-0.5, -1.5]
    """

    paths_hint = (
        "give the JSONL files of distillation records (tokens, teacher_topk_ids, teacher_topk_logprobs)"
    )

    def read_file(self, src: str) -> list[tuple[RLRow, str]]:
        """The rows of one JSONL file of distillation records, each with its ``file:line``."""
        return read_distill_jsonl(src, vocab_size=self.vocab_size, seq_len=self.seq_len)

    def check_rows(self, rows: list[tuple[RLRow, str]]) -> list[RLRow]:
        """The rows of the whole data, when every one has the first's ``k`` (`check_same_k`)."""
        return check_same_k(rows)


__all__ = ["DistillationDataModule"]
