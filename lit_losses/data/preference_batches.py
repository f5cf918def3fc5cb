"""Preference records → next-token rows → micro-batches in the preference batch layout.

**Paired records** (P pairs per micro-batch)::

    input_ids        [2P, T] long    rows 0..P-1: prompt + chosen of pairs 0..P-1; rows P..2P-1: + rejected
    attention_mask   [2P, T] long    1 on the sequence's tokens, 0 on padding (right-padded)
    labels           [2P, T] long    next-token labels: labels[:, t] = input_ids[:, t + 1] where that token
                                     is a completion token; -100 on prompt positions, padding, the last one
    chosen_mask      [2P, T] bool    the chosen rows' labelled positions (their completion tokens)
    chosen_sequence_mask  [2P, T] bool    the chosen rows' every next-token position (prompt and completion)
    ref_chosen_logps, ref_rejected_logps   [P] float64, when the records carry them

The two masks are counted by the training loader (`GlobalStatsLoader`): the global token means of the
chosen completions' NLL (DPO's ``sft``, CPO's ``cpo_alpha``) and of the chosen sequences' NLL (ORPO).

**Unpaired records** (KTO, B records per micro-batch): ``input_ids``, ``attention_mask``, ``labels``
``[B, T]`` as above; ``kto_label`` ``[B]`` bool (TRL's ``label``: desirable); ``desirable_mask`` ``[B, T]``
bool, the desirable rows' labelled positions (counted by the training loader: the step's number of
desirable sequences, for KTO's per-label metrics); ``kl_input_ids``,
``kl_attention_mask``, ``kl_labels`` ``[B, T]``, the record's prompt followed by its KL partner's
completion (`lit_losses.data.preference_records.pair_kl_partners`), as TRL builds KTO's mismatched pairs
(token ids: ``prompt_ids + completion_ids`` of the partner); ``ref_logps`` and ``ref_kl_logps`` ``[B]``
float64 when the records carry ``ref_logps`` / ``ref_KL_logps``.

A sequence is ``prompt_ids + completion_ids`` (`lit_losses.data.completions.split_completion`: the
completion starts where the tokenized prompt and prompt + completion diverge, as in TRL),
truncated to ``max_length`` tokens as TRL's collators truncate (``truncation_mode``), and every row has at
least one target. A pair (a record and its KL row) is never split over micro-batches: a micro-batch holds
the records, in order of length, while ``2 × records × longest row ≤ tokens_per_batch``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lit_losses.data.completions import (
    IGNORE_INDEX,
    Split,
    Text,
    TruncationMode,
    check_targets,
    next_token_row,
    shared_prompt_length,
    split_completion,
)
from lit_losses.data.encoding import TokenEncoder
from lit_losses.data.packing import batch_rows
from lit_losses.data.preference_records import PairRecord, Record, UnpairedRecord
from lit_losses.errors import ConfigError

Row = tuple[list[int], list[int]]
"""A sequence's ``(input_ids, labels)``."""

REF_KEYS = {
    "ref_chosen_logps": "ref_chosen_logps",
    "ref_rejected_logps": "ref_rejected_logps",
    "ref_logps": "ref_logps",
    "ref_KL_logps": "ref_kl_logps",
}
"""Record field → batch key of the precomputed reference log-probabilities."""


@dataclass
class RecordRows:
    """The rows of one record: ``(chosen, rejected)`` for a pair, ``(completion, KL row)`` for an unpaired
    record (whose ``label`` is set), and the reference values ``ref`` (record field → value)."""

    where: str
    first: Row
    second: Row
    ref: dict[str, float]
    label: bool | None = None

    @property
    def length(self) -> int:
        return max(len(self.first[0]), len(self.second[0]))


class RowBuilder:
    """Tokenizes records into `RecordRows` with ``encoder``, truncating to ``max_length`` (TRL's
    ``max_length`` and ``truncation_mode``); warns once when a tokenized prompt is not a prefix of its
    prompt + completion (as TRL does).

    Example:
        >>> from lit_losses.data.tokenizer import train_tokenizer
        >>> encoder = TokenEncoder(train_tokenizer(["2 + 2 = 4"] * 4, vocab_size=262), "bpe")
        >>> rows = RowBuilder(encoder, max_length=None).rows(PairRecord("a:1", "2 + 2 =", " 4", " 5", {}))
        >>> first_target = rows.first[1].index(next(t for t in rows.first[1] if t != -100))
        >>> rows.first[0][first_target + 1:] == encoder.encode(" 4" + encoder.eos_token)
        True
    """

    def __init__(
        self, encoder: TokenEncoder, max_length: int | None, truncation_mode: TruncationMode = "keep_start"
    ) -> None:
        self.encoder = encoder
        self.max_length = max_length
        self.truncation_mode = truncation_mode
        self.mismatch_warned = False
        self._splits: dict[tuple[str, str], Split] = {}

    def completion(self, text: Text) -> Text:
        """A standard completion ends with the EOS token's text (TRL adds it when missing).

        Raises:
            ConfigError: for a standard completion when the tokenizer has no EOS token.
        """
        if not isinstance(text, str):
            return text
        eos = self.encoder.eos_token
        if eos is None:
            raise ConfigError(
                f"data.tokenizer: {self.encoder.name} has no eos_token, which ends every standard (text) "
                "completion, as in TRL; give a tokenizer with one"
            )
        return text if text.endswith(eos) else text + eos

    def split(self, record: Record, field: str) -> Split:
        key = (record.where, field)
        if key not in self._splits:
            completion = self.completion(getattr(record, field))
            split = split_completion(
                self.encoder,
                prompt=record.prompt,
                completion=completion,
                where=record.where,
                template_kwargs=record.template_kwargs,
            )
            if not split.prefix_matches and not self.mismatch_warned:
                self.mismatch_warned = True
                left_out = self.encoder.decode(split.prompt_ids[split.prompt_length :])
                rank_zero_warn(
                    f"{record.where}: the tokenized prompt is not a prefix of the tokenized prompt + {field} "
                    "(the tokenizer merges tokens across the boundary, or the chat template renders the "
                    "prompt alone differently); the completion starts where the two diverge and the prompt's "
                    f"end {left_out!r} is left out of the "
                    "sequence, as TRL does"
                )
            self._splits[key] = split
        return self._splits[key]

    def row(self, prompt_ids: list[int], completion_ids: list[int], where: str, what: str) -> Row:
        """The next-token row of ``prompt_ids + completion_ids``, truncated; one without a target is an
        error naming ``where`` and ``what`` it is."""
        ids = prompt_ids + completion_ids
        mask = [0] * len(prompt_ids) + [1] * len(completion_ids)
        row = next_token_row(ids, mask, max_length=self.max_length, mode=self.truncation_mode)
        check_targets(row[1], where=where, what=what, max_length=self.max_length)
        return row

    def pair_rows(self, record: PairRecord) -> tuple[Row, Row]:
        """The chosen and rejected rows of a pair: each is its prompt + completion's tokens, the
        completion starting after the prompt tokens that both share (`shared_prompt_length`)."""
        splits = [self.split(record, field) for field in ("chosen", "rejected")]
        length = shared_prompt_length(splits)
        chosen, rejected = (
            self.row(
                split.full_ids[:length],
                split.full_ids[length:],
                where=record.where,
                what=f"the {field} completion",
            )
            for split, field in zip(splits, ("chosen", "rejected"), strict=True)
        )
        return chosen, rejected

    def unpaired_rows(self, record: UnpairedRecord) -> tuple[Row, Row]:
        """The completion row of an unpaired record and its KL row: the record's prompt tokens followed by
        its KL partner's completion tokens (TRL's ``prompt_ids + KL_completion_ids``)."""
        own = self.split(record, "completion")
        partner = self.split(record.kl_partner or record, "completion")
        prompt_ids = own.full_ids[: own.prompt_length]
        first = self.row(prompt_ids, own.completion_ids, where=record.where, what="the completion")
        second = self.row(prompt_ids, partner.completion_ids, where=record.where, what="its KL row")
        return first, second

    def rows(self, record: Record) -> RecordRows:
        """The two rows of ``record`` (chosen and rejected; completion and KL row)."""
        if isinstance(record, PairRecord):
            first, second = self.pair_rows(record)
            return RecordRows(where=record.where, first=first, second=second, ref=record.ref)
        first, second = self.unpaired_rows(record)
        return RecordRows(where=record.where, first=first, second=second, ref=record.ref, label=record.label)


def pad_rows(rows: Sequence[Row], pad_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """``input_ids``, ``attention_mask``, ``labels`` of ``rows``, right-padded to the longest.

    Example:
        >>> ids, mask, labels = pad_rows([([4, 5, 6], [-100, 6, -100]), ([7, 8], [8, -100])], pad_id=0)
        >>> ids.tolist(), mask.tolist(), labels.tolist()
        ([[4, 5, 6], [7, 8, 0]], [[1, 1, 1], [1, 1, 0]], [[-100, 6, -100], [8, -100, -100]])
    """
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, (ids, labs) in enumerate(rows):
        input_ids[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        labels[r, : len(labs)] = torch.tensor(labs, dtype=torch.long)
        attention_mask[r, : len(ids)] = 1
    return input_ids, attention_mask, labels


def chosen_masks(labels: Tensor, attention_mask: Tensor, pairs: int) -> dict[str, Tensor]:
    """``chosen_mask`` (the chosen rows' labelled positions) and ``chosen_sequence_mask`` (the chosen rows'
    positions whose next token is a token of the sequence) of paired rows ``[2P, T]``.

    Example:
        >>> labels = torch.tensor([[-100, 7, -100], [-100, 8, 9]])  # 1 pair: chosen, rejected
        >>> masks = chosen_masks(labels, torch.tensor([[1, 1, 1], [1, 1, 1]]), pairs=1)
        >>> masks["chosen_mask"].tolist(), masks["chosen_sequence_mask"].tolist()
        ([[False, True, False], [False, False, False]], [[True, True, False], [False, False, False]])
    """
    chosen = torch.zeros_like(labels, dtype=torch.bool)
    chosen[:pairs] = labels[:pairs] != IGNORE_INDEX
    sequence = torch.zeros_like(chosen)
    sequence[:pairs, :-1] = attention_mask[:pairs, 1:].bool()
    return {"chosen_mask": chosen, "chosen_sequence_mask": sequence}


def collate_records(items: Sequence[RecordRows], pad_id: int) -> dict[str, Tensor]:
    """The micro-batch of ``items`` (all pairs or all unpaired records) in the layout of the module
    docstring.

    Example:
        >>> pair = RecordRows("a:1", ([1, 2], [2, -100]), ([1, 3, 4], [-100, 4, -100]), {})
        >>> batch = collate_records([pair], pad_id=0)
        >>> sorted(batch)
        ['attention_mask', 'chosen_mask', 'chosen_sequence_mask', 'input_ids', 'labels']
        >>> batch["input_ids"].tolist(), batch["chosen_sequence_mask"].tolist()
        ([[1, 2, 0], [1, 3, 4]], [[True, False, False], [False, False, False]])
    """
    n = len(items)
    input_ids, attention_mask, labels = pad_rows(
        [item.first for item in items] + [item.second for item in items], pad_id=pad_id
    )
    if items[0].label is None:  # pairs: chosen rows, then rejected rows
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
        batch |= chosen_masks(labels, attention_mask, pairs=n)
    else:  # unpaired: the completion rows, and their KL rows under kl_*
        batch = {"input_ids": input_ids[:n], "attention_mask": attention_mask[:n], "labels": labels[:n]}
        batch |= {"kl_input_ids": input_ids[n:], "kl_attention_mask": attention_mask[n:]}
        batch |= {"kl_labels": labels[n:], "kto_label": torch.tensor([item.label for item in items])}
        batch["desirable_mask"] = (labels[:n] != IGNORE_INDEX) & batch["kto_label"][:, None]
    for field in items[0].ref:
        batch[REF_KEYS[field]] = torch.tensor([item.ref[field] for item in items], dtype=torch.float64)
    return batch


class PreferenceDataset(torch.utils.data.Dataset):
    """Item ``i`` is micro-batch ``i`` (serve it with ``DataLoader(batch_size=None)``): records in order
    of length, grouped while ``2 × records × longest row ≤ tokens_per_batch`` (a record longer than that
    is a micro-batch alone).

    Example:
        >>> pairs = [RecordRows(f"a:{i}", ([1, 2] * i, [2, 1] * i), ([1, 2], [2, 1]), {}) for i in (1, 3, 2)]
        >>> data = PreferenceDataset(pairs, tokens_per_batch=16, pad_id=0)
        >>> len(data), [tuple(data[i]["input_ids"].shape) for i in range(len(data))]
        (2, [(4, 4), (2, 6)])
    """

    def __init__(self, items: Sequence[RecordRows], tokens_per_batch: int, pad_id: int) -> None:
        self.items = list(items)
        self.pad_id = pad_id
        order = sorted(range(len(self.items)), key=lambda i: self.items[i].length)
        groups = batch_rows(
            [self.items[i].length for i in order], tokens_per_batch=max(1, tokens_per_batch // 2)
        )
        self.batches = [[order[j] for j in group] for group in groups]

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return collate_records([self.items[i] for i in self.batches[index]], pad_id=self.pad_id)
