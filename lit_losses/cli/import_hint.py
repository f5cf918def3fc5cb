"""One line for a ``class_path`` whose module cannot be imported, saying how to make it importable.

``lit-losses fit --model.class_path mypkg.MyLM`` imports ``mypkg`` from Python's module search path, which
holds neither the current folder (for the ``lit-losses`` console script) nor your project unless it is
installed. Getting started: ``docs/getting-started.md`` ("Your own module").
"""

from __future__ import annotations

import re

_MISSING = re.compile(
    r'Parser key "([^"]+)".*?Problem with given class_path \'([^\']+)\':\s*No module named \'([^\']+)\'', re.S
)


def import_error_line(message: str) -> str | None:
    """The one-line error for jsonargparse's ``message`` when a ``class_path``'s module is missing, else
    ``None``.

    Example:
        >>> message = ('Parser key "model":\\n  Errors:\\n    - Problem with given class_path '
        ...            "'mypkg.MyLM':\\n        No module named 'mypkg'")
        >>> print(import_error_line(message))
        model.class_path 'mypkg.MyLM': No module named 'mypkg'; make it importable: run with
        PYTHONPATH=<the folder that holds mypkg/> (e.g. PYTHONPATH=$PWD lit-losses fit ...) or install your
        project (pip install -e .)
        >>> import_error_line('Parser key "model": something else') is None
        True
    """
    found = _MISSING.search(message)
    if found is None:
        return None
    key, class_path, missing = found.groups()
    where = f"{key}.class_path {class_path!r}: No module named {missing!r}"
    if class_path == missing or class_path.startswith(f"{missing}."):
        top = missing.partition(".")[0]
        return (
            f"{where}; make it importable: run with PYTHONPATH=<the folder that holds {top}/> "
            "(e.g. PYTHONPATH=$PWD lit-losses fit ...) or install your project (pip install -e .)"
        )
    return f"{where}, which {class_path!r} imports; install it (pip install {missing.partition('.')[0]})"
