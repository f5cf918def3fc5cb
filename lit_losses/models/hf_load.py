"""Loading Hugging Face causal LMs for lit_losses: the optional ``transformers`` import, its refusals as
one-line `ConfigError` s, the causal LM inside a ``peft`` model, and a causal LM from a local checkpoint
directory or a config dict (`load_causal_lm`: frozen auxiliary models, `lit_losses.models.frozen`).
Nothing is downloaded."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lit_losses.errors import ConfigError
from lit_losses.registry import closest

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["causal_lm_of", "check_plain_head", "import_transformers", "load_causal_lm", "refused_as"]


def import_transformers(user: str) -> Any:
    """The ``transformers`` package, or a `ConfigError` saying that ``user`` needs the ``[hf]`` extra."""
    try:
        import transformers
    except ImportError as err:  # pragma: no cover - depends on the optional extra
        raise ConfigError(f"{user} needs the optional extra: pip install 'lit_losses[hf]'") from err
    return transformers


OPTION_WORDS = {
    "attn_implementation": (
        "attn_implementation",
        "attention implementation",
        "flashattention",
        "flash_attention",
        "flex_attention",
        "scaled_dot_product_attention",
        "sdpa",
    ),
    "dtype": ("dtype", "float16", "bfloat16", "half precision"),
}
"""Words of a ``transformers`` refusal that tell which option it is about (lower case)."""


@contextlib.contextmanager
def refused_as(option: str, options: Mapping[str, Any]) -> Iterator[None]:
    """Re-raise what ``transformers`` or ``peft`` refuse (their own exception types, often on several lines)
    as one-line `ConfigError` s naming the option the user gave: ``option``, or ``attn_implementation`` /
    ``dtype`` with its value when the message is about them (`OPTION_WORDS`: ``FlashAttention2 has been
    toggled on, but …`` is about ``attn_implementation=flash_attention_2``).

    Example:
        >>> with refused_as("model.init_args.config", {}):
        ...     raise ValueError("head dim\\n  must divide")
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: model.init_args.config: head dim must divide
    """
    try:
        yield
    except ConfigError:
        raise
    except Exception as err:  # their types vary (ValueError, huggingface_hub's validation errors, ...)
        message = (
            " ".join(line.strip() for line in str(err).splitlines() if line.strip()) or type(err).__name__
        )
        lowered = message.lower()
        named = [n for n in options if any(w in lowered for w in OPTION_WORDS.get(n, (n,)))]
        where = option
        if named:
            value = options[named[0]]
            value = str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value
            where = f"model.init_args.{named[0]}={value}"
        raise ConfigError(f"{where}: {message}") from err


def causal_lm_of(model: nn.Module) -> nn.Module:
    """The ``transformers`` causal LM inside ``model`` (``model`` itself, or a ``peft`` model's base)."""
    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):  # not the base model it wraps
        if (
            getattr(model, "active_peft_config", None) is not None
            and model.active_peft_config.is_prompt_learning
        ):
            raise ConfigError(
                "HFCausalLM: prompt-learning peft adapters (prompt/prefix tuning) change the inputs and "
                "are not supported; use LoRA-style adapters"
            )
        return model.get_base_model()
    return model


def check_plain_head(model: nn.Module, owner: str = "HFCausalLM") -> None:
    """Raise a `ConfigError` unless the logits of ``model`` are ``linear(base hidden states, W, b)`` with
    ``get_output_embeddings()`` a plain ``nn.Linear`` (checked on a 4-token probe, in eval mode)."""
    lm = causal_lm_of(model)
    head = lm.get_output_embeddings()
    if type(head) is not nn.Linear:
        raise ConfigError(
            f"{owner}: the output layer of {type(lm).__name__} is a {type(head).__name__}, not a plain "
            "nn.Linear (e.g. a LoRA adapter on lm_head): leave lm_head out of the adapter's target_modules"
        )
    body = lm.base_model
    if body is lm:
        raise ConfigError(f"{owner}: {type(lm).__name__} has no base model separate from its head")
    ids = torch.arange(4, device=head.weight.device)[None] % head.weight.shape[0]
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            hidden = body(input_ids=ids, use_cache=False).last_hidden_state
            logits = model(input_ids=ids, use_cache=False).logits
            expected = nn.functional.linear(hidden, head.weight, head.bias).float()
    finally:
        model.train(training)
    error = float((logits.float() - expected).abs().max() / expected.abs().max().clamp_min(1e-12))
    if error > 1e-3:
        hints = [
            a
            for a in ("final_logit_softcapping", "logit_scale", "logits_scaling")
            if getattr(lm.config, a, None)
        ]
        raise ConfigError(
            f"{owner}: the logits of {type(lm).__name__} are not linear(hidden, lm_head) (relative "
            f"difference {error:.1e} on a probe{'; config sets ' + ', '.join(hints) if hints else ''}): "
            "the fused head would compute another loss"
        )


def load_causal_lm(
    source: str | Mapping[str, Any], where: str, dtype: torch.dtype | None = None
) -> PreTrainedModel:
    """A causal LM from a local checkpoint directory (``save_pretrained``; ``from_pretrained`` with
    ``local_files_only``) or from a config dict with ``model_type`` (random weights from the current seed).

    Raises:
        ConfigError: naming ``where``: not a directory, an unknown ``model_type``, or what ``transformers``
            refuses.

    Example:
        >>> load_causal_lm({"model_type": "lama"}, "model.teacher")
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: model.teacher.model_type 'lama' is not a transformers model type...
    """
    transformers = import_transformers(where)
    options = {} if dtype is None else {"dtype": dtype}
    if isinstance(source, Mapping):
        config = dict(source)
        model_type = config.pop("model_type", None)
        known = sorted(transformers.CONFIG_MAPPING.keys())
        if model_type not in known:
            hint = closest(str(model_type), known)
            raise ConfigError(f"{where}.model_type {model_type!r} is not a transformers model type{hint}")
        with refused_as(where, {}):
            hf_config = transformers.AutoConfig.for_model(model_type, **config)
            return transformers.AutoModelForCausalLM.from_config(hf_config, **options)
    if not os.path.isdir(source):
        raise ConfigError(
            f"{where}={source!r} is not a local directory (a checkpoint saved with save_pretrained; "
            "nothing is downloaded at run time)"
        )
    with refused_as(where, {}):
        return transformers.AutoModelForCausalLM.from_pretrained(source, local_files_only=True, **options)
