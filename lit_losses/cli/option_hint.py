"""The one-line error for an option that a class does not take: its full path, the class, and the closest
option the class takes, or where the field of a TRL trainer config with that name is set here.

jsonargparse reports ``--model.init_args.dpo.betta=0.1`` as ``Option 'betta' is not accepted`` under the
class it was given to (``lit_losses.DPOPreset``); `unknown_option_line` turns it into
``model.init_args.dpo.betta: not an option of DPOPreset; did you mean 'beta'?``. A user bringing a TRL
config (``DPOConfig``, ``SFTConfig``, ``GKDConfig``, ``GRPOConfig``) learns where each of its training
fields lives (`lit_losses.trl_fields`).
"""

from __future__ import annotations

import dataclasses
import re

from lit_losses.cli.class_options import accepted_options, import_class, option_class
from lit_losses.registry import closest
from lit_losses.trl_fields import TRL_OPTIONS, trl_hint

_UNKNOWN = re.compile(r"Option '([^']+)' is not accepted")
_UNRECOGNIZED = re.compile(r"unrecognized arguments: --([\w.]+)")
_NOT_ACCEPTED = re.compile(r"does not accept option '([\w.]+)'")
_CLASS = re.compile(r"Problem with given class_path '([^']+)'")
_SUBTYPES = re.compile(r"Subtypes: \[(.*)\]")
_UNLOADABLE = re.compile(r"Unable to load config [\"']([^\"']*)[\"']")


def unknown_option_line(path: str, message: str) -> str | None:
    """The one-line error when jsonargparse's ``message`` (about option ``path``) says that a class does not
    take an option, else ``None``.

    Example:
        >>> message = ("Problem with given class_path 'lit_losses.DPOPreset':\\n"
        ...            "        Option 'betta' is not accepted")
        >>> unknown_option_line("model.init_args.dpo", message)
        "model.init_args.dpo.betta: not an option of DPOPreset; did you mean 'beta'?"
        >>> print(unknown_option_line("model.init_args.dpo", message.replace("betta", "max_length")))
        model.init_args.dpo.max_length: not an option of DPOPreset; TRL's max_length is
        data.init_args.max_length here for preference data (PreferenceDataModule), data.init_args.seq_len
        for text data (TextDataModule and its subclasses)
    """
    found = _UNKNOWN.findall(message) or _UNRECOGNIZED.findall(message)
    if not found:
        return None
    *owners, name = found[-1].split(".")
    classes = _CLASS.findall(message)
    cls = import_class(classes[-1]) if classes else None
    for owner in owners:
        cls = option_class(cls, owner) if cls is not None else None
    where = ".".join([path, *owners, name])
    return _line(where, name, cls=cls, options=accepted_options(cls) if cls is not None else [])


def unknown_key_line(message: str) -> str | None:
    """The one-line error when jsonargparse's top-level ``message`` names an option that does not exist
    (``unrecognized arguments: --trainer.gradient_accumulation_steps=4``), else ``None``.

    Example:
        >>> print(unknown_key_line("unrecognized arguments: --trainer.gradient_accumulation_steps=4"))
        trainer.gradient_accumulation_steps: not an option of Trainer; TRL's gradient_accumulation_steps is
        trainer.accumulate_grad_batches here
        >>> unknown_key_line("Subcommand 'fit' does not accept option 'trainer.max_step'")
        "trainer.max_step: not an option of Trainer; did you mean 'max_steps'?"
    """
    found = _UNRECOGNIZED.findall(message) or _NOT_ACCEPTED.findall(message)
    if not found:
        return None
    key = found[0]
    name = key.rpartition(".")[2]
    if key.startswith("trainer.") and key.count(".") == 1:
        from lightning.pytorch import Trainer

        return _line(key, name, cls=Trainer, options=accepted_options(Trainer))
    return _line(key, name, cls=None, options=[])


def _line(where: str, name: str, cls: type | None, options: list[str]) -> str:
    """``<where>: not an option of <cls>`` and where TRL's field of that name is set here, the closest
    option, or the options."""
    line = f"{where}: not an option" + (f" of {cls.__name__}" if cls is not None else "")
    if trl_hint(name) and TRL_OPTIONS[name].option != where:  # not the very option this class lacks
        return line + trl_hint(name)
    hint = closest(name, options)
    if hint or not options:
        return line + hint
    return f"{line}; its options: {', '.join(options)}"


def fields_expected_line(path: str, message: str, value: str, whole: str = "") -> str | None:
    """The one-line error when jsonargparse's ``message`` (about option ``path``; ``whole``: the message
    it is part of) refuses ``value`` for an option whose type is a dataclass (``model.dpo: sigmoid``), else
    ``None``.

    Example:
        >>> message = ("Subtypes: [<class 'lit_losses.objectives.preference_presets.DPOPreset'>, "
        ...            "<class 'NoneType'>]\\n  Errors:\\n  - Expected a dot import path string: sigmoid")
        >>> print(fields_expected_line("model.init_args.dpo", message, "sigmoid"))
        model.init_args.dpo: expected a mapping of DPOPreset's fields (loss_type, beta, label_smoothing,
        loss_weights, reference_free, precompute_ref_log_probs, use_weighting, ld_alpha, discopop_tau,
        f_divergence_type, f_alpha_divergence_coef) or null, got 'sigmoid'
    """
    subtypes = _SUBTYPES.search(message)
    if subtypes is not None:
        classes = [import_class(name) for name in re.findall(r"<class '([\w.]+)'>", subtypes.group(1))]
    elif _UNLOADABLE.search(message) and _CLASS.findall(whole):  # a dataclass option that is not optional
        value = _UNLOADABLE.search(message).group(1)
        owner = import_class(_CLASS.findall(whole)[-1])
        classes = [option_class(owner, path.rpartition(".")[2]) if owner is not None else None]
    else:
        return None
    fields = [cls for cls in classes if cls is not None and dataclasses.is_dataclass(cls)]
    if len(fields) != 1:
        return None
    (cls,) = fields
    optional = " or null" if any(cls is type(None) for cls in classes) else ""
    names = ", ".join(accepted_options(cls))
    return f"{path}: expected a mapping of {cls.__name__}'s fields ({names}){optional}, got {value!r}"
