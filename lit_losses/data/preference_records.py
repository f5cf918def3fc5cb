"""Preference records in TRL's formats, one JSON object per line, checked with errors naming ``file:line``.

**Paired** (DPO, IPO, SimPO, CPO, ORPO, …)::

    {"prompt": "What is 2 + 2?", "chosen": " 4.", "rejected": " 5."}                    # standard
    {"chosen": "What is 2 + 2? 4.", "rejected": "What is 2 + 2? 5."}                    # implicit prompt
    {"prompt": [{"role": "user", "content": "What is 2 + 2?"}],                          # conversational
     "chosen": [{"role": "assistant", "content": "4."}],
     "rejected": [{"role": "assistant", "content": "5."}]}

**Unpaired** (KTO): ``{"prompt": …, "completion": …, "label": true}`` (``label``: the completion is
desirable).

Fields are all strings (standard) or all message lists (conversational: ``{"role", "content"}`` objects,
``role`` one of ``system``, ``user``, ``assistant``, ``tool``; a completion ends with the assistant's
message), and one data set holds one kind of record
(paired or unpaired) in one form (standard or conversational). Without ``prompt``, a pair's prompt is
the longest common prefix of ``chosen`` and ``rejected`` (TRL's ``extract_prompt``: characters of text,
messages of a conversation). Precomputed reference log-probabilities (sums over the completion's tokens)
take TRL's names: ``ref_chosen_logps`` and ``ref_rejected_logps`` for pairs, ``ref_logps`` and
``ref_KL_logps`` for unpaired records; each is given in every record or in none. A conversational record's
``tools`` and ``chat_template_kwargs`` go to the chat template, as in TRL. Other fields are ignored,
unless they look like a misspelling of one of these.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lit_losses.data.completions import Text
from lit_losses.data.files import jsonl_values
from lit_losses.data.record_fields import TEMPLATE_FIELDS, RecordFields
from lit_losses.errors import ConfigError

PAIRED_REF = ("ref_chosen_logps", "ref_rejected_logps")
UNPAIRED_REF = ("ref_logps", "ref_KL_logps")
KNOWN_FIELDS = (
    "prompt",
    "chosen",
    "rejected",
    "completion",
    "label",
    *PAIRED_REF,
    *UNPAIRED_REF,
    *TEMPLATE_FIELDS,
)


@dataclass
class PairRecord:
    """One pair: ``prompt`` (extracted when implicit), ``chosen``, ``rejected``, the precomputed
    reference sums ``ref`` (``name → value``, empty when none) and the chat template's keyword arguments
    ``template_kwargs`` (``tools``, ``chat_template_kwargs``); ``where`` names it (``file:line``)."""

    where: str
    prompt: Text
    chosen: Text
    rejected: Text
    ref: dict[str, float]
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def conversational(self) -> bool:
        return not isinstance(self.chosen, str)


@dataclass
class UnpairedRecord:
    """One unpaired record (KTO): ``prompt``, ``completion``, ``label`` (desirable), ``ref`` as for
    pairs; ``kl_partner`` is the record whose completion KTO's KL estimate pairs with this prompt;
    ``template_kwargs`` as for pairs."""

    where: str
    prompt: Text
    completion: Text
    label: bool
    ref: dict[str, float]
    kl_partner: UnpairedRecord | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def conversational(self) -> bool:
        return not isinstance(self.completion, str)


Record = PairRecord | UnpairedRecord


def extract_prompt(chosen: Text, rejected: Text) -> tuple[Text, Text, Text]:
    """``(prompt, chosen, rejected)``: the longest common prefix of ``chosen`` and ``rejected`` and their
    rests, as TRL's ``extract_prompt`` computes it (a space before the first difference goes with the
    completions; when one is a prefix of the other, the prompt stops one item before the shorter's end).

    Example:
        >>> extract_prompt("Sky? It is blue.", "Sky? It is green.")
        ('Sky? It is', ' blue.', ' green.')
    """
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if idx > 0 and chosen[idx - 1] == " ":
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def _paired(f: RecordFields) -> PairRecord:
    kind = "a paired preference record has 'chosen' and 'rejected', and 'prompt' unless it is implicit"
    chosen, rejected = f.text("chosen", kind), f.text("rejected", kind)
    f.same_form(("prompt", "chosen", "rejected"))
    if "prompt" in f.record:
        prompt = f.text("prompt", kind)
    else:
        prompt, chosen, rejected = extract_prompt(chosen, rejected)
        if not isinstance(chosen, str) and not prompt:
            raise f.fail(
                "'chosen' and 'rejected' share no leading message, so no prompt to extract; give 'prompt'"
            )
    if not isinstance(chosen, str) and (not chosen or not rejected):
        raise f.fail("after the prompt, 'chosen' or 'rejected' holds no message: no completion to train on")
    f.ends_with_assistant("chosen", chosen)
    f.ends_with_assistant("rejected", rejected)
    return PairRecord(
        where=f.where,
        prompt=prompt,
        chosen=chosen,
        rejected=rejected,
        ref=f.refs(PAIRED_REF),
        template_kwargs=f.template_kwargs(),
    )


def _unpaired(f: RecordFields) -> UnpairedRecord:
    kind = "an unpaired preference record has 'prompt', 'completion' and 'label'"
    prompt, completion = f.text("prompt", kind), f.text("completion", kind)
    f.same_form(("prompt", "completion"))
    f.ends_with_assistant("completion", completion)
    if "label" not in f.record:
        raise f.fail(f"missing field 'label' ({kind}; true: the completion is desirable)")
    label = f.record["label"]
    if not isinstance(label, bool):
        raise f.fail(f"field 'label' is a {type(label).__name__}, not a boolean (true: desirable)")
    refs = f.refs(UNPAIRED_REF)
    if "ref_KL_logps" in refs and "ref_logps" not in refs:
        raise f.fail("field 'ref_KL_logps' is given without 'ref_logps'")
    return UnpairedRecord(
        where=f.where,
        prompt=prompt,
        completion=completion,
        label=label,
        ref=refs,
        template_kwargs=f.template_kwargs(),
    )


def parse_preference_record(record: Any, where: str) -> Record:
    """The record of one decoded JSON object (see the module docstring).

    Raises:
        ConfigError: naming ``where`` and the field.

    Example:
        >>> parse_preference_record({"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5"}, "a.jsonl:1")
        PairRecord(where='a.jsonl:1', prompt='2 + 2 =', chosen=' 4', rejected=' 5', ref={},
                   template_kwargs={})
        >>> parse_preference_record({"prompt": "2 + 2 =", "chosen": " 4"}, "a.jsonl:2")
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: a.jsonl:2: missing field 'rejected' (a paired preference record ...
    """
    if not isinstance(record, Mapping):
        raise ConfigError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    f = RecordFields(record, where, known=KNOWN_FIELDS)
    paired = "chosen" in record or "rejected" in record
    if paired and ("completion" in record or "label" in record):
        raise f.fail(
            "a record has 'chosen' and 'rejected' (paired) or 'completion' and 'label' (unpaired), not both"
        )
    if paired:
        return _paired(f)
    if "completion" in record or "label" in record:
        return _unpaired(f)
    raise f.fail(
        "not a preference record: it needs 'chosen' and 'rejected' (paired, with an optional 'prompt') or "
        f"'prompt', 'completion' and 'label' (unpaired, KTO); it has {sorted(record)}"
    )


def read_preference_jsonl(path: str) -> list[Record]:
    """The records of a JSONL file (blank lines skipped), each naming its ``file:line``.

    Example:
        >>> import json, pathlib, tempfile
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "prefs.jsonl"
        >>> _ = path.write_text(json.dumps({"chosen": "Sky? Blue.", "rejected": "Sky? Red."}) + "\\n")
        >>> (record,) = read_preference_jsonl(str(path))
        >>> record.where.endswith("prefs.jsonl:1"), record.prompt, record.chosen
        (True, 'Sky?', ' Blue.')
    """
    return [parse_preference_record(value, where) for value, where in jsonl_values(path)]


def check_records(records: list[Record]) -> None:
    """One kind (paired or unpaired) and one form (standard or conversational) per data set, and each
    precomputed reference field in every record or in none.

    Raises:
        ConfigError: naming the first record and the first one that differs.

    Example:
        >>> pair = {"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5"}
        >>> records = [parse_preference_record(pair | {"ref_chosen_logps": -1.0}, "a:1"),
        ...            parse_preference_record(pair, "a:2")]
        >>> check_records(records)
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: a:2: missing field 'ref_chosen_logps', which a:1 has; give ...
    """
    first = records[0]
    for record in records[1:]:
        if type(record) is not type(first):
            kinds = {PairRecord: "a paired record", UnpairedRecord: "an unpaired (KTO) record"}
            raise ConfigError(
                f"{record.where} is {kinds[type(record)]} but {first.where} is {kinds[type(first)]}; one "
                "kind of record per data set"
            )
        if record.conversational != first.conversational:
            forms = {True: "conversational (message lists)", False: "standard (text)"}
            raise ConfigError(
                f"{record.where} is {forms[record.conversational]} but {first.where} is "
                f"{forms[first.conversational]}; one form per data set"
            )
    for name in (*PAIRED_REF, *UNPAIRED_REF):
        having = [r for r in records if name in r.ref]
        if having and len(having) < len(records):
            missing = next(r for r in records if name not in r.ref)
            raise ConfigError(
                f"{missing.where}: missing field {name!r}, which {having[0].where} has; give the precomputed "
                "reference log-probabilities in every record or in none"
            )


def pair_kl_partners(records: Iterable[UnpairedRecord]) -> None:
    """Give each unpaired record its KL partner: the record before it (the first record takes the last),
    TRL's rotation of the completions by one, over the whole data set in file order.

    Example:
        >>> records = [UnpairedRecord(f"r{i}", "p", f"c{i}", label=True, ref={}) for i in range(3)]
        >>> pair_kl_partners(records)
        >>> [r.kl_partner.completion for r in records]
        ['c2', 'c0', 'c1']
    """
    records = list(records)
    for i, record in enumerate(records):
        record.kl_partner = records[i - 1]


def same_completion(record: Record) -> bool:
    """Whether a pair's chosen and rejected completions are the same (it trains with a zero margin).

    Example:
        >>> same_completion(PairRecord("a:1", "2 + 2 =", " 4", " 4", {}))
        True
    """
    return isinstance(record, PairRecord) and record.chosen == record.rejected
