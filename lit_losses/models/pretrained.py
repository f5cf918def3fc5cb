"""Where a pretrained Hugging Face model or tokenizer is read from: a local directory, or a Hub id
(``org/name``) whose files are already in the local Hugging Face cache. Nothing is downloaded at run time.

A Hub id is looked up with ``huggingface_hub.snapshot_download(repo_id, local_files_only=True)``: the
snapshot folder of its ``main`` revision in ``$HF_HUB_CACHE`` (by default ``~/.cache/huggingface/hub``),
where ``hf download org/name`` and ``from_pretrained("org/name")`` put it. Needs the ``[hf]`` extra.
"""

from __future__ import annotations

import os

from lit_losses.errors import ConfigError


def is_hub_id(source: str) -> bool:
    """Whether ``source``, which names no existing file, reads as a Hub id (``org/name`` or ``name``, in
    Hugging Face's repo-id characters) rather than a path (``/…``, ``./…``, ``~/…``, two or more ``/``, a
    ``.ckpt`` file). Without ``huggingface_hub`` (the ``[hf]`` extra) nothing is a Hub id.

    Example:
        >>> is_hub_id("tiny-org/tiny-llama"), is_hub_id("runs/a/last.ckpt"), is_hub_id("runs/last.ckpt")
        (True, False, False)
    """
    if source.startswith(("/", ".", "~")) or source.count("/") > 1 or source.endswith(".ckpt"):
        return False
    try:
        from huggingface_hub.errors import HFValidationError
        from huggingface_hub.utils import validate_repo_id
    except ImportError:  # pragma: no cover - depends on the optional extra
        return False
    try:
        validate_repo_id(source)
    except HFValidationError:
        return False
    return True


def local_pretrained(source: str, where: str, saved_with: str = "save_pretrained") -> str:
    """The local directory to load ``source`` from: ``source`` itself when it is a directory, else the
    cached snapshot of the Hub id ``source``.

    Args:
        source: a directory (written by ``save_pretrained``, ``hf download … --local-dir``) or a Hub id.
        where: the option that gave it, for errors (``model.init_args.model_name_or_path``).
        saved_with: how such a directory is written, for errors.

    Raises:
        ConfigError: one line naming ``where`` and ``source``: a path that is no directory, or a Hub id that
            is not in the local cache (with the command that downloads it).

    Example:
        >>> local_pretrained("no-such-org/no-such-model", "model.init_args.model_name_or_path")
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: model.init_args.model_name_or_path 'no-such-org/no-such-model' is ...
    """
    if os.path.isdir(source):
        return source
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
        from huggingface_hub.utils import validate_repo_id
    except ImportError as err:  # pragma: no cover - depends on the optional extra
        raise ConfigError(f"{where} needs the optional extra: pip install 'lit_losses[hf]'") from err
    try:
        validate_repo_id(source)
    except HFValidationError:
        raise ConfigError(
            f"{where} {source!r} is not a local directory (one written by {saved_with}, or a Hub id such as "
            "'org/name' in the local Hugging Face cache; nothing is downloaded at run time)"
        ) from None
    try:
        return snapshot_download(source, local_files_only=True)
    except LocalEntryNotFoundError as err:
        incomplete = type(err).__name__ == "IncompleteSnapshotError"  # huggingface_hub >= 1.x
        found = "is only partly in" if incomplete else "is neither a local directory nor a Hub id in"
        raise ConfigError(
            f"{where} {source!r} {found} the local Hugging Face cache ({constants.HF_HUB_CACHE}); nothing is "
            f"downloaded at run time: download it once with `hf download {source}` (the cache, or "
            "HF_HUB_CACHE), or give a local directory"
        ) from None
