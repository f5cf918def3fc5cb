"""`read_trl_config`: a TRL config file (``trl <trainer> --config x.yaml``) read and checked: which trainer's
it is, every field known to that trainer's TRL config, every value of its field's kind; one `ConfigError`
naming the file and the field otherwise."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import yaml

from lit_losses.cli.trl_schema import CONFIG_CLASSES, LOSS_TYPES, TRLTrainer, trainer_fields
from lit_losses.errors import ConfigError
from lit_losses.registry import closest
from lit_losses.trl_fields import TRL_OPTIONS

TRAINERS: tuple[str, ...] = get_args(TRLTrainer)
LEGACY: dict[str, tuple[str, ...]] = {
    "warmup_ratio": ("float", "none"),
    "torch_dtype": ("str", "none"),
    "max_seq_length": ("int", "none"),
    "max_prompt_length": ("int", "none"),
    "rpo_alpha": ("float", "none"),
}
"""Fields of older TRL and transformers configs that convert too (transformers 4's ``warmup_ratio``, TRL's
former ``torch_dtype``, ``max_seq_length``, ``max_prompt_length``, ``rpo_alpha``), with their kinds."""
TRUE, FALSE = ("true", "yes", "t", "y", "1"), ("false", "no", "f", "n", "0")
"""The strings that TRL's parser reads as booleans (transformers' ``string_to_bool``)."""


@dataclass(frozen=True)
class TRLConfig:
    """A checked TRL config.

    Attributes:
        trainer: the trainer whose config it is.
        given: the fields of the file, their values read as TRL reads them (``"1e-6"`` as a number).
        values: every field of the trainer's config: ``given`` over TRL's defaults.
        source: the file, for the messages.
    """

    trainer: TRLTrainer
    given: dict[str, Any]
    values: dict[str, Any]
    source: str

    @property
    def config_class(self) -> str:
        """The name of TRL's config class (``DPOConfig``)."""
        return CONFIG_CLASSES[self.trainer]

    def is_default(self, name: str) -> bool:
        """Whether field ``name`` is left at TRL's default (a former field, given, never is)."""
        if name not in self.given:
            return True
        spec = trainer_fields(self.trainer).get(name)
        return spec is not None and self.given[name] == spec[1]


def read_trl_config(path: str, trainer: str | None = None) -> TRLConfig:
    """The TRL config in the YAML file ``path``, of ``trainer`` (inferred from its fields when ``None``).

    Raises:
        ConfigError: naming ``path``: not readable, not YAML, not a mapping, a trainer that is not one of
            `TRAINERS`, fields that fit no trainer's config or several (give ``trainer``), a field that
            ``trainer``'s config does not have (with the closest name), a value of the wrong kind.

    Example:
        >>> import tempfile
        >>> file = Path(tempfile.mkdtemp()) / "dpo.yaml"
        >>> _ = file.write_text("model_name_or_path: Qwen/Qwen2.5-0.5B\\nbeta: 0.1\\nuse_weighting: true\\n")
        >>> config = read_trl_config(str(file))
        >>> config.trainer, config.given["beta"], config.values["learning_rate"]
        ('dpo', 0.1, 1e-06)
        >>> _ = file.write_text("learning_rate: 1e-6\\nbetta: 0.1\\n")
        >>> read_trl_config(str(file), "dpo")
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: ...: betta is not a field of TRL's DPOConfig ...; did you mean 'beta'?
    """
    fields = load_mapping(path)
    chosen = check_trainer(trainer, path) if trainer is not None else infer_trainer(fields, path)
    known = known_kinds(chosen)
    given = {}
    for name, value in fields.items():
        if name not in known:
            raise ConfigError(
                f"{path}: {name} is not a field of {where_known(chosen)}{other_hint(name, chosen)}"
            )
        given[name] = coerce(value, known[name], f"{path}: {name}")
    if "loss_type" in given:
        check_loss_type(given["loss_type"], chosen, path)
    defaults = {name: spec[1] for name, spec in trainer_fields(chosen).items()}
    return TRLConfig(trainer=chosen, given=given, values={**defaults, **given}, source=path)


def load_mapping(path: str) -> dict[str, Any]:
    """The mapping of field names to values in YAML file ``path``.

    Raises:
        ConfigError: the file cannot be read, is not YAML, or holds no mapping of names.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read it ({err})") from None
    try:
        fields = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else path
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{where}: not YAML ({problem})") from None
    if not isinstance(fields, dict):
        raise ConfigError(
            f"{path}: expected a mapping of TRL config fields (as trl <trainer> --config reads), got "
            f"{type(fields).__name__}"
        )
    names = [name for name in fields if not isinstance(name, str)]
    if names:
        raise ConfigError(f"{path}: {names[0]!r} is not a field name")
    return fields


def check_trainer(trainer: str, path: str) -> TRLTrainer:
    """``trainer`` if it is one of `TRAINERS`.

    Raises:
        ConfigError: naming the trainers, with the closest.
    """
    if trainer not in TRAINERS:
        raise ConfigError(
            f"{path}: --trainer {trainer!r} is not one of {', '.join(TRAINERS)}{closest(trainer, TRAINERS)}"
        )
    return trainer  # type: ignore[return-value]


def infer_trainer(fields: Mapping[str, Any], path: str) -> TRLTrainer:
    """The one trainer whose TRL config has every field of ``fields``.

    Raises:
        ConfigError: no trainer's config has them all (naming the first field that none has, or the
            trainers and what each lacks), or several do (naming them: give ``--trainer``).
    """
    fits = {t: misfits(fields, t) for t in TRAINERS}
    candidates = [t for t, missing in fits.items() if not missing]
    if len(candidates) > 1 and "loss_type" in fields:  # the loss type tells DPO's from KTO's or CPO's
        candidates = [t for t in candidates if takes_loss_type(fields["loss_type"], t)] or candidates
    if len(candidates) == 1:
        return candidates[0]  # type: ignore[return-value]
    if candidates:
        raise ConfigError(
            f"{path}: its fields fit the configs of several TRL trainers ({', '.join(candidates)}); give "
            f"--trainer {'|'.join(candidates)}"
        )
    everywhere = [n for n in fields if not any(n in known_kinds(t) for t in TRAINERS)]
    if everywhere:
        name = everywhere[0]
        known = set().union(*(trainer_fields(t) for t in TRAINERS))
        raise ConfigError(f"{path}: {name} is not a field of any TRL trainer's config{closest(name, known)}")
    lacks = "; ".join(f"{t}: {missing[0]}" for t, missing in fits.items())
    raise ConfigError(
        f"{path}: no TRL trainer's config takes all its fields (the first each does not take: {lacks}); give "
        "--trainer"
    )


def known_kinds(trainer: str) -> dict[str, tuple[str, ...]]:
    """The kinds of value of every field that ``trainer``'s config takes here (`former_fields` too)."""
    known = {name: spec[0] for name, spec in trainer_fields(trainer).items()}  # type: ignore[arg-type]
    return known | {name: LEGACY.get(name, ("any",)) for name in former_fields()}


def misfits(fields: Mapping[str, Any], trainer: str) -> list[str]:
    """The fields of ``fields`` that ``trainer``'s config does not take, or not with that kind of value."""
    known = known_kinds(trainer)
    wrong = []
    for name, value in fields.items():
        if name not in known:
            wrong.append(name)
            continue
        try:
            coerce(value, known[name], name)
        except ConfigError:
            wrong.append(name)
    return wrong


def takes_loss_type(value: Any, trainer: str) -> bool:
    """Whether ``value`` (a list for ``DPOConfig``) holds only loss types of ``trainer``'s config."""
    types = value if isinstance(value, list) else [value]
    return trainer in LOSS_TYPES and all(t in LOSS_TYPES[trainer] for t in types)


def check_loss_type(value: Any, trainer: str, path: str) -> None:
    """Refuse a ``loss_type`` that ``trainer``'s config does not take.

    Raises:
        ConfigError: naming the value, the choices and the closest.
    """
    if trainer not in LOSS_TYPES or takes_loss_type(value, trainer):
        return
    types = value if isinstance(value, list) else [value]
    wrong = next(t for t in types if t not in LOSS_TYPES[trainer])
    raise ConfigError(
        f"{path}: loss_type {wrong!r} is not one of {CONFIG_CLASSES[trainer]}'s: "
        f"{', '.join(LOSS_TYPES[trainer])}{closest(wrong, LOSS_TYPES[trainer])}"
    )


def former_fields() -> set[str]:
    """The fields of earlier TRL and transformers versions that this package knows (`LEGACY`, and the
    names of `TRL_OPTIONS` that no TRL 1.16 config has): every trainer's config takes them here."""
    current = set().union(*(trainer_fields(t) for t in TRAINERS))
    return (set(LEGACY) | set(TRL_OPTIONS)) - current


def where_known(trainer: TRLTrainer) -> str:
    """``TRL's DPOConfig (nor ModelConfig, ScriptArguments, …)``: the dataclasses of ``trl <trainer>``."""
    return f"TRL's {CONFIG_CLASSES[trainer]} (nor ModelConfig, ScriptArguments, DatasetMixtureConfig)"


def other_hint(name: str, trainer: TRLTrainer) -> str:
    """The closest field of ``trainer``'s config, or the other trainers whose config has ``name``."""
    others = [CONFIG_CLASSES[t] for t in TRAINERS if name in trainer_fields(t)]
    if others:
        return f"; it is a field of {', '.join(others)}: give --trainer accordingly"
    return closest(name, [*trainer_fields(trainer), *LEGACY])


def coerce(value: Any, kinds: tuple[str, ...], where: str) -> Any:
    """``value`` as TRL's parser reads a config value of a field of ``kinds``: strings of numbers and
    booleans become numbers and booleans (TRL converts string defaults with the field's type).

    Raises:
        ConfigError: naming ``where``, the kinds expected and the value.

    Example:
        >>> coerce("1e-6", ("float",), "lr"), coerce("true", ("bool",), "bf16"), coerce(2, ("float",), "x")
        (1e-06, True, 2)
        >>> coerce([1], ("float",), "dpo.yaml: beta")
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: dpo.yaml: beta: expected a number (float), got [1]
    """
    if "any" in kinds or (value is None and "none" in kinds):
        return value
    if isinstance(value, bool):
        if "bool" in kinds:
            return value
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        if "float" in kinds or ("int" in kinds and float(value).is_integer()):
            return int(value) if "float" not in kinds else value
        if "str" in kinds:
            return str(value)
    elif isinstance(value, str):
        parsed = _from_string(value, kinds)
        if parsed is not None:
            return parsed
    elif (isinstance(value, list) and "list" in kinds) or (isinstance(value, dict) and "dict" in kinds):
        return value
    raise ConfigError(f"{where}: expected {_expected(kinds)}, got {value!r}")


def _from_string(value: str, kinds: tuple[str, ...]) -> Any:
    """``value`` read as the first of ``kinds`` it parses as (``None``: none)."""
    lowered = value.strip().lower()
    if "bool" in kinds and lowered in TRUE + FALSE:
        return lowered in TRUE
    if "int" in kinds:
        try:
            return int(value)
        except ValueError:
            pass
    if "float" in kinds:
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not math.isnan(number):
            return number
    if "str" in kinds or "list" in kinds or "dict" in kinds:
        return value  # TRL takes a string for a list (one item) and JSON for a mapping
    return None


def _expected(kinds: tuple[str, ...]) -> str:
    words = {"bool": "true or false", "int": "a whole number", "list": "a list", "dict": "a mapping"}
    words |= {"str": "a string", "none": "null"}
    if "float" in kinds:
        return "a number (float)" + (" or null" if "none" in kinds else "")
    return " or ".join(words[kind] for kind in kinds)
