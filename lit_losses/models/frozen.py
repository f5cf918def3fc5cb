"""`FrozenModel`: a frozen auxiliary model of a `RegularizedLM` (a preference reference policy, a
distillation teacher), and where it comes from (`FrozenSource`).

A frozen model gives the hidden states of a batch and its output projection, and the per-token
log-probabilities of the batch's labels through the fused head (no ``[tokens × V]`` logits). It

- has no gradient: its own weights do not require one, and every call runs under ``torch.no_grad()``;
- runs in eval mode (no dropout), whatever mode the policy is in;
- is no submodule of the policy: it is not in ``module.parameters()`` (no optimizer state), not in the
  checkpoint's ``state_dict`` (the hyper-parameters name its source only), and Lightning's ``train()``
  and DDP never touch it;
- follows the policy to its device and dtype (`FrozenModel.follow`, before each use);
- under FSDP2 (``ModelParallelStrategy``) is **replicated**: every data-parallel rank holds the whole
  frozen model on its device, as DDP would. The disabled-adapters source is the policy itself, sharded
  as the policy is.

Sources (`load_frozen`):

- a local Hugging Face checkpoint directory (``save_pretrained``): ``AutoModelForCausalLM.from_pretrained``
  with ``local_files_only`` (nothing is downloaded); or a Hub id (``org/name``) whose files are in the
  local Hugging Face cache, as `lit_losses.HFCausalLM`'s ``model_name_or_path`` takes it
  (`lit_losses.models.pretrained.local_pretrained`: its cached snapshot directory);
- a ``transformers`` config dict with ``model_type`` (random weights from the seed: tests, shapes);
- a `RegularizedLM` checkpoint file (``.ckpt``): the class its hyper-parameters name (``_class_path``,
  written by LightningCLI), else the policy's class, with ``load_from_checkpoint``;
- ``"initial_policy"``: a copy of the policy's weights when the frozen model is built
  (`RegularizedLM.initial_copy`; TRL's reference when there is no reference model and no PEFT);
- ``"disabled_adapters"``: the policy itself with its PEFT adapters disabled
  (`RegularizedLM.adapters_disabled`, ``peft_model.disable_adapter()``): the base model, no second copy.

A `RegularizedLM` names its frozen models with `RegularizedLM.add_frozen_model` (the source is checked
then, a `ConfigError` naming the option), builds them when a trainer sets it up (before training, after
which a failure to load is a `ConfigError` too) or at first use, and hands them out with
`RegularizedLM.frozen_model` (on its device and dtype). Every rank builds the same weights: a checkpoint
is read, and the random-weight sources (a config dict, the initial policy of a model built from a config)
need the same seed on every rank (the CLI's ``seed_everything``).

**A distillation teacher** is one such model:

```python
# in the module's __init__ (the source checked now, loaded when training starts)
self.add_frozen_model("teacher", source, where="model.distillation.teacher")
# in the loss of a micro-batch
teacher = self.frozen_model("teacher")  # on the policy's device and dtype
teacher_hidden = teacher.hidden_states(batch)  # [B, T, Dt], no gradient
teacher_weight, teacher_bias = teacher.output_projection()  # detached
```
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
from torch import Tensor, nn

from lit_losses.aggregation.stats import batch_segment_ids
from lit_losses.errors import ConfigError
from lit_losses.heads import Backend, MatmulPrecision, head_for
from lit_losses.models.hf_batch import body_inputs, packing_leak, packing_tolerance
from lit_losses.models.hf_load import causal_lm_of, check_plain_head, load_causal_lm, refused_as
from lit_losses.models.pretrained import is_hub_id, local_pretrained
from lit_losses.registry import closest, import_object

__all__ = [
    "DISABLED_ADAPTERS",
    "INITIAL_POLICY",
    "CausalLMRunner",
    "FrozenModel",
    "FrozenRunner",
    "FrozenSource",
    "check_frozen_source",
    "describe_source",
    "load_frozen",
    "local_path",
]

INITIAL_POLICY = "initial_policy"
"""Source keyword: a copy of the policy's weights when the frozen model is built."""
DISABLED_ADAPTERS = "disabled_adapters"
"""Source keyword: the policy itself with its PEFT adapters disabled."""
SourceKeyword = Literal["initial_policy", "disabled_adapters"]
FrozenSource = str | dict[str, Any]
"""Where a frozen model comes from: a `SourceKeyword`, a local path (a Hugging Face checkpoint directory or
a `RegularizedLM` checkpoint file), a Hub id in the local Hugging Face cache, or a ``transformers`` config
dict with ``model_type``."""


class FrozenRunner(Protocol):
    """What a frozen model runs: the hidden states ``[B, T, D]`` of a batch and the output projection
    ``(weight [V, D], bias [V] | None)`` (a `RegularizedLM` is one; `CausalLMRunner` wraps a Hugging Face
    causal LM)."""

    def hidden_states(self, batch: dict[str, Any]) -> Tensor: ...

    def output_projection(self) -> tuple[Tensor, Tensor | None]: ...


class CausalLMRunner(nn.Module):
    """A Hugging Face causal LM (or a ``peft`` model around one) as a `FrozenRunner`: the last hidden states
    of its base model (for the batch's ``input_ids``, ``attention_mask``, positions and packed rows,
    `body_inputs`) and its output layer.

    Its logits must be ``linear(hidden, lm_head)`` (`check_plain_head`, on a probe, unless ``checked``: a
    copy of a model checked already, such as the initial policy). Packed rows (``segment_ids``) are checked
    once, on a probe, to keep their documents apart (`packing_leak`); a model that does not is a
    `ConfigError`.

    Example:
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> lm = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16,
        ...     num_hidden_layers=1, num_attention_heads=2))
        >>> runner = CausalLMRunner(lm)
        >>> hidden = runner.hidden_states({"input_ids": torch.tensor([[1, 2, 3]])})
        >>> hidden.shape, runner.output_projection()[0].shape
        (torch.Size([1, 3, 8]), torch.Size([32, 8]))
    """

    def __init__(self, lm: nn.Module, where: str = "frozen model", checked: bool = False) -> None:
        super().__init__()
        if not checked:  # a copy of a checked model (the initial policy) is not probed again
            check_plain_head(lm, owner=where)
        self.lm = lm
        self.where = where
        self.packing_checked = False

    @property
    def attn_implementation(self) -> str:
        """The attention implementation the model runs (``sdpa``, ``eager``, ...)."""
        return str(getattr(causal_lm_of(self.lm).config, "_attn_implementation", None) or "eager")

    def hidden_states(self, batch: dict[str, Any]) -> Tensor:
        body = causal_lm_of(self.lm).base_model
        dtype = next(body.parameters()).dtype
        if batch_segment_ids(batch) is not None and not self.packing_checked:
            vocab = self.output_projection()[0].shape[0]
            leak = packing_leak(body, vocab, self.attn_implementation, dtype=dtype)
            if leak > packing_tolerance(body):
                raise ConfigError(
                    f"{self.where}: with attn_implementation={self.attn_implementation!r}, packed documents "
                    f"attend to each other (relative difference {leak:.1e} on a probe); use unpacked rows"
                )
            self.packing_checked = True
        return body(**body_inputs(batch, self.attn_implementation, dtype)).last_hidden_state

    def output_projection(self) -> tuple[Tensor, Tensor | None]:
        head = causal_lm_of(self.lm).get_output_embeddings()
        return head.weight, head.bias


class FrozenModel:
    """A frozen auxiliary model (see the module docstring): a `FrozenRunner` run without gradient, in eval
    mode, on the policy's device and dtype.

    Args:
        runner: what computes the hidden states and holds the output projection.
        source: where it comes from, as saved in the hyper-parameters (`describe_source`).
        shared: the runner is the policy itself (disabled adapters): its weights are not frozen, moved or
            copied here; only ``context`` and eval mode apply during each call.
        context: entered around every call (e.g. ``peft_model.disable_adapter``).

    Example:
        >>> import torch
        >>> from lit_losses import TinyLM
        >>> policy = TinyLM(vocab_size=16, d_model=8, n_layers=1, n_heads=2)
        >>> frozen = FrozenModel(policy.initial_copy(), source="initial_policy")
        >>> batch = {"input_ids": torch.tensor([[1, 2, 3]]), "labels": torch.tensor([[2, 3, -100]])}
        >>> logprobs = frozen.logprobs(batch, batch["labels"])
        >>> logprobs.requires_grad, logprobs.shape, float(logprobs[0, 2])
        (False, torch.Size([1, 3]), 0.0)
        >>> torch.allclose(logprobs, policy.predict_step(batch, 0).detach())  # the policy's, before training
        True
        >>> any(p.requires_grad for p in frozen.runner.parameters()), frozen.runner.training
        (False, False)
    """

    def __init__(
        self,
        runner: nn.Module,
        *,
        source: str,
        shared: bool = False,
        context: Callable[[], AbstractContextManager[Any]] | None = None,
    ) -> None:
        self.runner = runner
        self.source = source
        self.shared = shared
        self.context = context or contextlib.nullcontext
        if not shared:
            runner.requires_grad_(False)
            runner.eval()

    def __repr__(self) -> str:
        return f"FrozenModel(source={self.source!r}, runner={type(self.runner).__name__})"

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """No gradient, eval mode and ``context`` (every module's mode is restored afterwards)."""
        modes = [(m, m.training) for m in self.runner.modules()]
        try:
            with torch.no_grad(), self.context():
                self.runner.eval()
                yield
        finally:
            for module, training in modes:
                module.training = training

    def follow(self, like: Tensor) -> None:
        """Move the frozen weights to ``like``'s device and floating dtype (nothing when shared or there)."""
        if self.shared:
            return
        param = next((p for p in self.runner.parameters() if p.is_floating_point()), None)
        if param is not None and (param.device != like.device or param.dtype != like.dtype):
            self.runner.to(device=like.device, dtype=like.dtype)

    def hidden_states(self, batch: dict[str, Any]) -> Tensor:
        """The hidden states ``[B, T, D]`` of ``batch`` (no gradient, eval mode)."""
        with self.active():
            return self.runner.hidden_states(batch)

    def output_projection(self) -> tuple[Tensor, Tensor | None]:
        """The output projection ``(weight [V, D], bias [V] | None)``, detached (no copy)."""
        weight, bias = self.runner.output_projection()
        return weight.detach(), None if bias is None else bias.detach()

    def logprobs(
        self,
        batch: dict[str, Any],
        labels: Tensor,
        *,
        backend: Backend = "auto",
        chunk_size: int | None = None,
        ignore_index: int = -100,
        matmul_precision: MatmulPrecision = "auto",
    ) -> Tensor:
        """``log p(labels)`` ``[B, T]`` under the frozen model, 0 where ``labels == ignore_index``, through
        the fused head (`head_for`: no logits; the policy's head options, so that a reference equal to the
        policy gives its log-probabilities exactly); no gradient."""
        with self.active():
            hidden = self.runner.hidden_states(batch)
            weight, bias = self.runner.output_projection()
            head = head_for(
                weight,
                bias,
                backend=backend,
                chunk_size=chunk_size,
                ignore_index=ignore_index,
                matmul_precision=matmul_precision,
            )
            return head(hidden, labels, ("logprobs",)).logprobs


def describe_source(source: FrozenSource) -> str:
    """The source as one string (what the hyper-parameters and messages show).

    Example:
        >>> describe_source({"model_type": "llama", "hidden_size": 16})
        "config(model_type='llama')"
    """
    if isinstance(source, Mapping):
        return f"config(model_type={source.get('model_type')!r})"
    return str(source)


def check_frozen_source(source: Any, where: str) -> FrozenSource:
    """``source`` if it names a frozen model that can be loaded (without loading it).

    Raises:
        ConfigError: naming ``where``: not a string or mapping, a config without ``model_type``, a path that
            does not exist, a Hub id that is not in the local Hugging Face cache (with the command that
            downloads it), a directory without ``config.json``.

    Example:
        >>> check_frozen_source("initial_policy", "model.dpo.ref_model")
        'initial_policy'
        >>> check_frozen_source("no/such/dir", "model.dpo.ref_model")
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: model.dpo.ref_model='no/such/dir': no such file or directory ...
    """
    if isinstance(source, Mapping):
        if "model_type" not in source:
            raise ConfigError(f"{where}: a config dict needs model_type (a transformers model type)")
        return dict(source)
    if not isinstance(source, str) or not source:
        raise ConfigError(
            f"{where}={source!r} must be a path, a transformers config dict, {INITIAL_POLICY!r} or "
            f"{DISABLED_ADAPTERS!r}"
        )
    if source in (INITIAL_POLICY, DISABLED_ADAPTERS):
        return source
    path = local_path(source, where)
    if path.is_dir() and not (path / "config.json").is_file():
        raise ConfigError(
            f"{where}={source!r} is a directory without config.json: not a Hugging Face checkpoint (save it "
            "with save_pretrained; a sharded Lightning checkpoint must be consolidated into one file first)"
        )
    return source


def local_path(source: str, where: str) -> Path:
    """The local file or directory that the source string ``source`` names: the path itself, or the cached
    snapshot directory of a Hub id (`lit_losses.models.pretrained.local_pretrained`).

    Raises:
        ConfigError: naming ``where``: no such path (with what a misspelled keyword or ``None`` meant), or a
            Hub id that is not in the local Hugging Face cache.

    Example:
        >>> local_path("initial-policy", "model.ref_model")
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: model.ref_model='initial-policy': no such file or directory; ...
    """
    path = Path(source)
    if path.exists():
        return path
    typo = _typo_hint(source)
    if typo or not is_hub_id(source):
        hint = typo or (
            " (give a Hugging Face checkpoint directory or a Hub id in the local Hugging Face cache, a "
            f"RegularizedLM checkpoint file, a config dict, {INITIAL_POLICY!r} or {DISABLED_ADAPTERS!r})"
        )
        raise ConfigError(f"{where}={source!r}: no such file or directory{hint}")
    return Path(local_pretrained(source, where, saved_with="save_pretrained"))


def _typo_hint(source: str) -> str:
    """What a source that is no path may have meant: a keyword misspelled, or ``None`` (YAML's ``null``);
    empty when neither.

    Example:
        >>> _typo_hint("initial-policy")
        "; did you mean 'initial_policy'?"
        >>> _typo_hint("None")
        "; for none write null, not the string 'None'"
    """
    if source.strip().lower() in ("none", "null", "~"):
        return f"; for none write null, not the string {source!r}"
    keyword = "/" not in source and "." not in source  # a path is never taken for a misspelled keyword
    return closest(source, (INITIAL_POLICY, DISABLED_ADAPTERS)) if keyword else ""


def load_frozen(source: FrozenSource, *, where: str, policy: Any) -> FrozenModel:
    """The `FrozenModel` of ``source`` (see the module docstring) for ``policy`` (a `RegularizedLM`).

    Raises:
        ConfigError: naming ``where``: a source that cannot be loaded, a policy without adapters to disable.
    """
    source = check_frozen_source(source, where)
    description = describe_source(source)
    if source == INITIAL_POLICY:
        return FrozenModel(policy.initial_copy(), source=description)
    if source == DISABLED_ADAPTERS:
        return FrozenModel(policy, source=description, shared=True, context=policy.adapters_disabled(where))
    if isinstance(source, Mapping):
        return FrozenModel(CausalLMRunner(load_causal_lm(source, where), where=where), source=description)
    path = str(local_path(source, where))
    if os.path.isdir(path):
        return FrozenModel(CausalLMRunner(load_causal_lm(path, where), where=where), source=description)
    return FrozenModel(
        load_checkpoint_model(path, where=where, default_class=type(policy)), source=description
    )


def load_checkpoint_model(path: str, *, where: str, default_class: type) -> nn.Module:
    """The `RegularizedLM` of a checkpoint file: the class its hyper-parameters name (``_class_path``), else
    ``default_class``, with ``load_from_checkpoint`` on the CPU.

    Raises:
        ConfigError: naming ``where``: not a Lightning checkpoint, or a class that cannot load it.
    """
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # EOFError, RuntimeError, UnpicklingError: all mean "not a checkpoint"
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(f"{where}={path!r} is not a readable checkpoint ({reason})") from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise ConfigError(f"{where}={path!r} is not a Lightning checkpoint (no 'state_dict')")
    class_path = (checkpoint.get("hyper_parameters") or {}).get("_class_path")
    model_class = import_object(class_path, where, "model class") if class_path else default_class
    del checkpoint
    with refused_as(where, {}):
        return model_class.load_from_checkpoint(path, map_location="cpu")
