"""Module paths that moved, still importable under their old names.

The command-line application moved into `lit_losses.cli` and the checkpoint modules into
`lit_losses.checkpoint`. A ``class_path`` or import that names an old path (e.g.
``lit_losses.preemption.PreemptionCheckpoint`` in a config's ``trainer.callbacks``) keeps working: the
old name is an alias of the module at its new path (the same module object, imported on first use).

Example:
    >>> import lit_losses.preemption, lit_losses.checkpoint.preemption
    >>> lit_losses.preemption is lit_losses.checkpoint.preemption
    True
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

MOVED = {
    **{
        f"lit_losses.{name}": f"lit_losses.cli.{name}"
        for name in (
            "console",
            "run_dir",
            "run_end",
            "report",
            "report_data",
            "trainer_errors",
            "import_hint",
        )
    },
    **{
        f"lit_losses.{name}": f"lit_losses.checkpoint.{name}"
        for name in ("resume", "stopped_epoch", "preemption")
    },
}
"""Old module path → its path now."""


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old path of `MOVED` as the module at its new path."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module was imported at its new path."""


def install() -> None:
    """Put the finder on ``sys.meta_path`` once."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
