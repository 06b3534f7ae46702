"""The layout holds: sizes a reader can hold, no import cycles, dependencies pointing one way.

The figures come from ``scripts/layout_report.py`` (run it to see the largest modules and
functions and any cycle).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import layout_report  # noqa: E402

MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60

# Layers of the house, lowest first: a module may import only from its own layer or below.
LAYERS = [
    (
        "leaves",
        [
            "capsctl.errors",
            "capsctl.atomic",
            "capsctl.events",
            "capsctl.devices",
            "capsctl.version",
            "capsctl.memory",
            "capsctl.threads",
        ],
    ),
    ("layers", ["capsctl.layers"]),
    ("models", ["capsctl.models", "capsctl.registry"]),
    ("config", ["capsctl.config", "capsctl.data.catalog"]),
    (
        "foundations",
        ["capsctl.data", "capsctl.checkpoint", "capsctl.losses"],
    ),
]
PRESENTATION = ("capsctl.cli", "capsctl.views", "capsctl.__main__")


@pytest.fixture(scope="module")
def report() -> dict:
    return layout_report.report()


def test_no_module_is_too_long(report: dict) -> None:
    long = {m: n for m, n in report["sizes"].items() if n > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_is_too_long(report: dict) -> None:
    long = [f"{f.module}.{f.name} ({f.lines})" for f in report["functions"]]
    long = [
        f"{f.module}.{f.name} ({f.lines})"
        for f in report["functions"]
        if f.lines > MAX_FUNCTION_LINES
    ]
    assert not long, f"function bodies over {MAX_FUNCTION_LINES} lines: {long}"


def test_no_import_cycles(report: dict) -> None:
    assert report["cycles"] == []


def test_no_hidden_imports() -> None:
    for path in (ROOT / "capsctl").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "import_module":
                pytest.fail(f"{path.relative_to(ROOT)}:{node.lineno}: importlib.import_module")


def _layer_of(module: str) -> int | None:
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return None


def test_dependencies_point_down(report: dict) -> None:
    """Leaves < layers < models < config < data/checkpoint/losses < everything else < CLI."""
    wrong = []
    for module, deps in report["graph"].items():
        mine = _layer_of(module)
        for dep in deps:
            if dep == "capsctl":
                continue  # the package's lazy public API
            theirs = _layer_of(dep)
            if mine is not None and (theirs is None or theirs > mine):
                wrong.append(f"{module} -> {dep}")
            if dep.startswith(PRESENTATION) and not module.startswith(PRESENTATION):
                wrong.append(f"{module} -> {dep}")
    assert not wrong, "imports pointing up the layers: " + ", ".join(sorted(wrong))


def test_the_library_never_imports_typer_or_rich() -> None:
    for path in (ROOT / "capsctl").rglob("*.py"):
        module = layout_report.module_name(path)
        if module.startswith(PRESENTATION):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                assert name.split(".")[0] not in ("typer", "rich"), f"{module} imports {name}"
