"""The files of ``data.paths``: globs resolved to files, a file's UTF-8 text, and the JSON value of each line
of a JSONL file; every error names the file (and the line)."""

from __future__ import annotations

import glob
import json
import os
import re
from pathlib import Path
from typing import Any

from lit_losses.errors import ConfigError


def matching_files(pattern: str) -> list[str]:
    """The files that the glob ``pattern`` of ``data.paths`` matches (``~`` expanded, ``**`` recursive).

    Raises:
        ConfigError: it matches no file, naming the folder it matches instead and globs for its files.

    Example:
        >>> import tempfile
        >>> matching_files(tempfile.mkdtemp())  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: data.paths entry '/...' is a folder; name its files with a glob: ...
    """
    matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
    files = [p for p in matches if os.path.isfile(p)]
    if files:
        return files
    folders = [p.rstrip(os.sep) for p in matches if os.path.isdir(p)]
    if not folders:
        hub = re.fullmatch(r"[\w.-]+/[\w.-]+", pattern) and not os.path.splitext(pattern)[1]
        hint = (
            " (a Hugging Face Hub dataset name? nothing is downloaded: save it as JSONL first, e.g. "
            f"datasets.load_dataset({pattern!r}, split='train').to_json('train.jsonl'))"
            if hub
            else ""
        )
        raise ConfigError(f"data.paths entry {pattern!r} matches no file{hint}")
    globs = f"'{folders[0]}/*.txt' or '{folders[0]}/**/*.jsonl'"
    if len(matches) == 1 and not glob.has_magic(pattern):
        raise ConfigError(f"data.paths entry {pattern!r} is a folder; name its files with a glob: {globs}")
    raise ConfigError(
        f"data.paths entry {pattern!r} matches only folders ({', '.join(folders[:3])}), no file; name their "
        f"files with a glob: {globs}"
    )


def read_text_file(src: str) -> str:
    """The UTF-8 text of a data file.

    Raises:
        ConfigError: the file cannot be read, is binary (it holds NUL bytes) or is not UTF-8, naming it.

    Example:
        >>> import pathlib, tempfile
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "blob.bin"
        >>> _ = path.write_bytes(bytes(range(8)))
        >>> read_text_file(str(path))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: data.paths: /.../blob.bin is a binary file (it holds NUL bytes), ...
    """
    try:
        data = Path(src).read_bytes()
    except OSError as err:  # e.g. permission denied, or removed since the paths were resolved
        raise ConfigError(f"data.paths: {src} cannot be read ({err.strerror or err})") from None
    if b"\x00" in data[:8192]:
        raise ConfigError(f"data.paths: {src} is a binary file (it holds NUL bytes), not UTF-8 text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"data.paths: {src} is not UTF-8 text (byte {err.start}: {err.reason})") from None


def jsonl_values(path: str, prefix: str = "") -> list[tuple[Any, str]]:
    """The JSON value of each non-blank line of a JSONL file, with its ``file:line`` (the ``where`` that the
    record's own errors name); ``prefix`` starts the message of a line that is not JSON, as it starts the
    reader's other errors (``"data.paths: "``, or nothing: ``file:line`` first).

    Lines end at ``\\n`` only (JSON Lines; a ``\\r`` before it is whitespace), so a string that holds a
    Unicode line separator (U+2028, U+0085, ...) stays on its line.

    Raises:
        ConfigError: the file cannot be read as UTF-8 text (`read_text_file`), or a line is not valid JSON,
            naming ``file:line`` and the column.

    Example:
        >>> import pathlib, tempfile
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "a.jsonl"
        >>> _ = path.write_text('{"text": "a"}\\n\\n{"text": "b\\u2028c"}\\r\\n', encoding="utf-8")
        >>> [(value, where.rpartition("/")[2]) for value, where in jsonl_values(str(path))]
        [({'text': 'a'}, 'a.jsonl:1'), ({'text': 'b\\u2028c'}, 'a.jsonl:3')]
        >>> _ = path.write_text('{"text": "a"}\\n{"text": oops}\\n')
        >>> jsonl_values(str(path))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: /.../a.jsonl:2 is not valid JSON (Expecting value, column 10)
    """
    values = []
    for lineno, line in enumerate(read_text_file(path).split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            values.append((json.loads(line), where))
        except json.JSONDecodeError as err:
            raise ConfigError(f"{prefix}{where} is not valid JSON ({err.msg}, column {err.colno})") from None
    return values
