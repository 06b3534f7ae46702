"""The house holds: sizes a reader can hold (Python, C++ and headers), no import cycles,
dependencies pointing one way (between the rooms and between the floors of capsctl/layers/),
capsctl/layers/ entered through its face, no private names across modules.

The figures come from ``scripts/layout_report.py`` (run it to see the largest modules and
functions, the floors and any cycle or violation).
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
            "capsctl.outputs",
            "capsctl.events",
            "capsctl.devices",
            "capsctl.version",
            "capsctl.memory",
            "capsctl.threads",
            "capsctl.user_cache",
            "capsctl.environment",
            "capsctl.numbers",
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


def test_no_cpp_source_or_header_is_too_long(report: dict) -> None:
    assert report["native_sizes"], "no C++ sources found"
    long = {f: n for f, n in report["native_sizes"].items() if n > MAX_MODULE_LINES}
    assert not long, f"C++ sources and headers over {MAX_MODULE_LINES} lines: {long}"


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


# -- the floors of capsctl/layers/ ------------------------------------------------------------


def test_the_routing_code_has_its_floors(report: dict) -> None:
    floors = report["floors"]
    assert list(floors) == ["backend", "passes", "layers", "routers", "face"]
    assert "capsctl.layers.backend.dispatch" in floors["backend"]
    assert "capsctl.layers.passes.routed" in floors["passes"]
    assert "capsctl.layers.capsules" in floors["layers"]
    assert "capsctl.layers.routers.em" in floors["routers"]
    assert floors["face"] == ["capsctl.layers"]


def test_floors_import_only_their_own_or_lower(report: dict) -> None:
    """routers -> layers -> passes -> backend, and backend imports nothing else of it."""
    wrong = layout_report.floor_violations(report["graph"])
    assert not wrong, "imports up the floors of capsctl/layers/: " + "; ".join(wrong)


def test_the_floor_check_finds_an_upward_import() -> None:
    graph = {
        "capsctl.layers.backend.native": {"capsctl.layers.passes.routed"},
        "capsctl.layers.passes.routed": {"capsctl.layers.backend.native"},
        "capsctl.layers.capsules": {"capsctl.layers.routers.idpa", "capsctl.layers.poses"},
    }
    wrong = layout_report.floor_violations(graph)
    assert len(wrong) == 2 and wrong[0].startswith("capsctl.layers.backend.native ->")


def test_code_outside_the_layers_enters_by_the_face() -> None:
    """Outside capsctl/layers/ (the package and scripts/) only ``capsctl.layers`` and
    ``capsctl.layers.routers`` are imported."""
    wrong = layout_report.face_violations()
    assert not wrong, "imports past the face of capsctl/layers/: " + "; ".join(wrong)


def test_no_module_imports_another_modules_private_names() -> None:
    wrong = layout_report.private_imports()
    assert not wrong, "private names imported across modules: " + "; ".join(wrong)


def test_the_private_name_check_finds_both_forms(tmp_path: Path, monkeypatch) -> None:
    pkg = tmp_path / "capsctl"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("_x = 1\ny = 2\n")
    (pkg / "b.py").write_text("from capsctl.sub.a import _x, y\n")
    (pkg / "c.py").write_text("from capsctl.sub import a\nprint(a._x, a.y)\n")
    (pkg / "d.py").write_text("from capsctl.sub.a import y\n")
    monkeypatch.setattr(layout_report, "ROOT", tmp_path)
    monkeypatch.setattr(layout_report, "PACKAGE", pkg)
    assert layout_report.private_imports() == [
        "capsctl/b.py:1: capsctl.sub.a._x",
        "capsctl/c.py:2: capsctl.sub.a._x",
    ]


def test_no_module_imports_another_modules_private_name() -> None:
    """The rule holds in the whole package, not only in capsctl/layers/: a name another module
    needs is public (in its module's ``__all__``)."""
    assert layout_report.private_imports(left=True) == []
    assert not layout_report.PRIVATE_LEFT
