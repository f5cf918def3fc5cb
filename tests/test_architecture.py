"""The package's shape, as rules that help a reader: no import cycle, a torch-only autograd toolkit, simple
functions (ruff's McCabe limit), the formatter's layout everywhere."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lit_losses"
MAX_COMPLEXITY = 10  # ruff's C901, as torchmetrics


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(name: str) -> set[str]:
    """The lit_losses modules ``name`` imports (anywhere in the file, ``TYPE_CHECKING`` blocks included),
    plus the sub-package ``__init__`` each of them runs first (the root package excepted)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + [base]
                ).strip(".")
            for alias in node.names:
                full = f"{base}.{alias.name}"
                targets.add(full if full in MODULES else base)
    edges = set()
    for target in targets:
        while target and target not in MODULES:
            target = target.rpartition(".")[0]
        parts = target.split(".")
        for depth in range(2, len(parts) + 1):  # lit_losses.x, lit_losses.x.y, ...
            edges.add(".".join(parts[:depth]))
    edges.discard(name)
    return {e for e in edges if not name.startswith(e + ".")}  # a module's own parent packages


GRAPH = {name: imported_modules(name) for name in MODULES}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_graph_parser_sees_imports():
    assert "lit_losses.loss.objective" in GRAPH["lit_losses.module"]
    assert "lit_losses.regularizers" in GRAPH["lit_losses.loss.objective"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_import_graph_has_no_cycle():
    graph = {
        name: {t for t in targets if t != "lit_losses"}
        for name, targets in GRAPH.items()
        if name != "lit_losses"
    }
    assert find_cycle(graph) is None


def test_autograd_depends_on_torch_only():
    for name, targets in GRAPH.items():
        if name.startswith("lit_losses.autograd"):
            outside = {t for t in targets if not t.startswith("lit_losses.autograd")}
            assert not outside, f"{name} imports {sorted(outside)}"


def loaded_packages(code: str, packages: tuple[str, ...]) -> str:
    """The modules of ``packages`` in ``sys.modules`` after ``code`` ran in a fresh interpreter (the
    repository on its path), as the printed sorted list: ``"[]"`` when it loaded none."""
    probe = f"{code}\nimport sys\nprint(sorted(m for m in sys.modules if m.split('.')[0] in {packages!r}))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True
    )
    return result.stdout.strip()


def test_the_head_and_aggregation_from_the_top_level_load_no_lightning():
    """``from lit_losses import …`` of the names a custom training loop uses (the fused head, `aggregate`,
    `GlobalStatsLoader`) loads neither Lightning, torchmetrics nor transformers (lazy top-level names)."""
    code = "from lit_losses import FusedLMHead, GlobalStatsLoader, aggregate, linear_logprobs"
    loaded = loaded_packages(code, ("lightning", "pytorch_lightning", "torchmetrics", "transformers"))
    assert loaded == "[]", loaded


APPLICATION = "lit_losses.cli"
MAX_TOP_LEVEL_MODULES = 13


def test_the_library_never_imports_the_application():
    """`lit_losses.cli` (the ``lit-losses`` command, its console, run folders, end record and report) sits
    on top of the library: no module outside it imports it."""
    for name, targets in GRAPH.items():
        if name == APPLICATION or name.startswith(APPLICATION + "."):
            continue
        inside = sorted(t for t in targets if t == APPLICATION or t.startswith(APPLICATION + "."))
        assert not inside, f"{name} imports the application's {inside}"


def test_the_top_level_shows_the_layers_at_a_glance():
    """A few modules at the top of the package, everything else in subpackages named after its concept."""
    modules = sorted(p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(modules) <= MAX_TOP_LEVEL_MODULES, modules
    assert (PACKAGE / "cli" / "__init__.py").is_file()


def test_old_module_paths_of_moved_modules_still_import():
    """Config ``class_path``s and imports written against the flat layout keep working."""
    import importlib

    from lit_losses.moved import MOVED

    for old, new in MOVED.items():
        assert importlib.import_module(old) is importlib.import_module(new), old


def test_heads_and_autograd_load_torch_alone():
    """A user of the fused head (or of the custom-gradient toolkit) in their own loop needs neither
    Lightning nor transformers: importing them loads neither (a fresh interpreter, its ``sys.modules``)."""
    code = "import lit_losses.heads, lit_losses.heads.functional, lit_losses.autograd"
    loaded = loaded_packages(code, ("lightning", "pytorch_lightning", "transformers", "jsonargparse"))
    assert loaded == "[]", loaded


HEAVY = ("torch", "lightning", "pytorch_lightning", "torchmetrics", "transformers", "jsonargparse")


@pytest.mark.parametrize("command", [["report", "{run}"], ["--version"]], ids=["report", "version"])
def test_the_report_and_the_version_start_without_torch(command, tmp_path):
    """``lit-losses report`` reads run folders (event files, ``metrics.csv``, ``run_end.json``) and
    ``lit-losses --version`` prints the version: through the console script's own entry (``lit_losses.cli``'s
    `main`, a fresh interpreter), neither loads torch, Lightning or jsonargparse."""
    (tmp_path / "metrics.csv").write_text("epoch,step,train/loss_total\n0,0,4.0\n0,1,3.0\n")
    argv = ["lit-losses", *(arg.format(run=tmp_path) for arg in command)]
    code = f"import sys\nsys.argv = {argv!r}\nfrom lit_losses.cli import main\nmain()"
    *printed, loaded = loaded_packages(code, HEAVY).splitlines()
    assert loaded == "[]", loaded[:500]
    if command[0] == "report":
        assert printed[-1].startswith("lit-losses: report written to")
        assert (tmp_path / "report.html").is_file()
    else:
        import lit_losses

        assert printed == [f"lit-losses {lit_losses.__version__}"]


def test_the_cli_resolves_short_class_names_despite_the_lazy_top_level():
    """``lit_losses`` imports its API on first use; the CLI imports it up front, so that jsonargparse
    finds ``TinyLM`` and ``TrainingController`` by their short names (a fresh interpreter: nothing
    imported them before)."""
    controller = (
        '{controllers: [{name: c, triggers: [on_log], rule: "True", operations: [lightning.should_log]}]}'
    )
    args = [
        "fit",
        "--model=TinyLM",
        "--trainer.callbacks+=TrainingController",
        f"--trainer.callbacks.config={controller}",
        "--print_config",
    ]
    code = f"from lit_losses.cli.app import cli_main\ncli_main({args!r})"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "class_path: lit_losses.TinyLM" in result.stdout
    assert "class_path: lit_losses.TrainingController" in result.stdout


def reachable(name: str) -> set[str]:
    """Every module ``name`` imports, directly or through others."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        for target in GRAPH.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_lightning_native_controller_imports_nothing_from_the_fms_adapter():
    adapter = "lit_losses.controller.fms"
    assert "lit_losses.controller.events" in GRAPH[adapter]  # the adapter builds on the native modules
    native = sorted(n for n in MODULES if n.startswith("lit_losses.controller.") and n != adapter)
    assert "lit_losses.controller.perform" in native
    for name in native:
        assert adapter not in reachable(name), f"{name} reaches the fms-hf-tuning adapter"


def test_one_event_reads_the_callback_through_its_public_api():
    """``perform`` (one event) uses the callback's public names only, no ``callback._x``."""
    tree = ast.parse(MODULES["lit_losses.controller.perform"].read_text())
    private = sorted(
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
    )
    assert not private, private


def test_no_module_imports_another_modules_private_names():
    found = [
        f"{name}: {node.module}.{alias.name}"
        for name, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("lit_losses"))
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]
    assert not found, found


KEYWORD_AREAS = ("lit_losses",)
"""Packages whose internal calls are checked by `test_internal_calls_name_their_fourth_argument_on`: all of
lit_losses."""


def fixed_arity_names() -> set[str]:
    """Functions and classes defined in lit_losses whose calls have a fixed number of positional arguments
    (no ``*args`` in the function or the class's ``__init__``)."""
    names: dict[str, bool] = {}
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                fixed = node.args.vararg is None
            elif isinstance(node, ast.ClassDef):
                inits = [b for b in node.body if isinstance(b, ast.FunctionDef) and b.name == "__init__"]
                fixed = not inits or inits[0].args.vararg is None
            else:
                continue
            names[node.name] = names.get(node.name, True) and fixed
    return {name for name, fixed in names.items() if fixed}


def test_internal_calls_name_their_fourth_argument_on():
    """A call of a lit_losses function with more than three arguments names the fourth and later ones:
    two swapped positional arguments go unnoticed, two swapped keywords cannot happen."""
    internal = fixed_arity_names()
    found = []
    for name, path in MODULES.items():
        if not name.startswith(KEYWORD_AREAS):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or any(isinstance(a, ast.Starred) for a in node.args):
                continue
            func = node.func
            callee = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if callee in internal and len(node.args) > 3:
                found.append(f"{name}:{node.lineno} {callee}(...{len(node.args)} positional)")
    assert not found, found


def test_loss_context_imports_nothing_above_heads_and_aggregation():
    allowed = (
        "lit_losses.heads",
        "lit_losses.aggregation",
        "lit_losses.errors",
        "lit_losses.choices",
        "lit_losses.registry",
    )
    for target in GRAPH["lit_losses.loss.context"]:
        assert target.startswith(allowed), target


def test_ruff_limits_complexity():
    tomllib = pytest.importorskip("tomllib")
    lint = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]
    assert any("C901".startswith(rule) for rule in lint["select"]), lint["select"]
    assert lint["mccabe"]["max-complexity"] <= MAX_COMPLEXITY
    assert not any("C90" in str(rules) for rules in lint.get("per-file-ignores", {}).values())
    exempted = [
        f"{path.relative_to(ROOT)}:{i + 1}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for i, line in enumerate(path.read_text().splitlines())
        if "noqa" in line and "C901" in line
    ]
    assert not exempted, exempted


def test_no_formatter_exemptions():
    markers = ("fmt: " + "skip", "fmt: " + "off")  # split: this file is searched by the same rule
    found = [
        f"{path.relative_to(ROOT)}:{i + 1}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for i, line in enumerate(path.read_text().splitlines())
        if any(marker in line for marker in markers)
    ]
    assert not found, found


def packed_attribute_assignments(source: str) -> list[int]:
    """Lines of ``source`` that assign a tuple of values to a tuple of attributes (``self.a, self.b = a, b``),
    except a hand-off that reads one of its targets (``old, self.x = self.x, None``)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Assign) or not isinstance(node.value, ast.Tuple):
            continue
        targets = [t for target in node.targets if isinstance(target, ast.Tuple) for t in target.elts]
        if not targets or not all(isinstance(t, ast.Attribute) for t in targets):
            continue
        read = {ast.unparse(n) for n in ast.walk(node.value) if isinstance(n, (ast.Name, ast.Attribute))}
        if not read & {ast.unparse(t) for t in targets}:
            lines.append(node.lineno)
    return lines


def test_packed_attribute_assignment_sees_packing_but_not_hand_offs():
    assert packed_attribute_assignments("self.a, self.b = a, b\nold, self.x = self.x, None\na, b = f()") == [
        1
    ]


def test_one_attribute_assignment_per_statement():
    """Unrelated attributes are assigned one per line, where a reader (and a diff) sees each."""
    found = [
        f"{name}:{line}"
        for name, path in MODULES.items()
        for line in packed_attribute_assignments(path.read_text())
    ]
    assert not found, found


def test_public_top_level_is_small_and_importable():
    import lit_losses

    assert len(lit_losses.__all__) <= 44
    for name in lit_losses.__all__:
        assert getattr(lit_losses, name) is not None


def test_every_public_class_and_function_has_a_runnable_example():
    import inspect

    import lit_losses

    for name in lit_losses.__all__:
        obj = getattr(lit_losses, name)
        if inspect.ismodule(obj) or not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue  # the autograd subpackage (its members have their own), Literal aliases
        if inspect.isclass(obj) and issubclass(obj, Exception):
            continue
        assert ">>>" in (obj.__doc__ or ""), f"lit_losses.{name} has no docstring example"
