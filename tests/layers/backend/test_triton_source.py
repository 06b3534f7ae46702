"""What the Triton kernels' source promises the GPU, read without compiling: no atomics at all
(a program owns its parent sites and writes each sum once; an atomic with Triton's default
semantics, acq_rel, would also put a GPU-wide fence and an L1 invalidation on each add), and
should one come back, it must be relaxed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import capsctl.layers.backend.triton as triton_pkg

KERNEL_FILES = sorted(Path(triton_pkg.__file__).parent.glob("*.py"))


def _atomic_calls(tree: ast.AST) -> list[ast.Call]:
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr.startswith("atomic_")
    ]


def _sem(call: ast.Call) -> str | None:
    for kw in call.keywords:
        if kw.arg == "sem" and isinstance(kw.value, ast.Constant):
            return str(kw.value.value)
    return None


@pytest.mark.parametrize("path", KERNEL_FILES, ids=lambda p: p.name)
def test_every_atomic_is_relaxed(path: Path) -> None:
    calls = _atomic_calls(ast.parse(path.read_text()))
    bad = [f"{path.name}:{c.lineno}" for c in calls if _sem(c) != "relaxed"]
    assert not bad, f"atomics without sem='relaxed': {bad}"


def test_the_check_finds_an_acq_rel_atomic() -> None:
    src = "tl.atomic_add(p, v, mask=m)\ntl.atomic_add(p, v, sem='relaxed')\n"
    calls = _atomic_calls(ast.parse(src))
    assert [_sem(c) for c in calls] == [None, "relaxed"]


def test_no_kernel_has_an_atomic() -> None:
    # the files of the kernels are there to read: a silent glob would pass anything
    assert {"kernels.py", "em.py", "tiles.py"} <= {p.name for p in KERNEL_FILES}
    found = [
        f"{p.name}:{c.lineno}"
        for p in KERNEL_FILES
        for c in _atomic_calls(ast.parse(p.read_text()))
    ]
    assert found == []
