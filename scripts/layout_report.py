"""Sizes and imports of the capsctl package: the figures tests/test_house.py holds to.

    python scripts/layout_report.py          # largest modules and functions, import cycles,
                                             # the floors of capsctl/layers/ and any violation

A function's length counts the lines of its body (from the first statement after the
docstring to the end), so a long option list of a command or a docstring does not count.
Imports inside functions count as edges of the import graph just as top-level ones do.

The routing code (capsctl/layers/) has floors, lowest first: ``backend`` (how a pass runs),
``passes`` (the vote-sized passes), ``layers`` (the modules of capsctl/layers/ itself: the
interface and the capsule layers), ``routers`` (the algorithms) and the face
(``capsctl/layers/__init__.py``). A module imports only from its own floor or below; code
outside capsctl/layers/ imports only the face or ``capsctl.layers.routers``; no module imports
another module's private (``_name``) names.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "capsctl"
SCRIPTS = ROOT / "scripts"
LAYERS = "capsctl.layers"
#: The floors of capsctl/layers/, lowest first.
FLOORS = ("backend", "passes", "layers", "routers", "face")
#: What code outside capsctl/layers/ may import of it.
FACE = (LAYERS, f"{LAYERS}.routers")
#: Private names imported across modules outside capsctl/layers/ that are tolerated: none (each
#: is a public name of its module or stays inside it).
PRIVATE_LEFT: frozenset[str] = frozenset()
#: Source files besides Python that the line cap covers.
NATIVE_SUFFIXES = (".cpp", ".h")


@dataclass
class Function:
    module: str
    name: str
    lines: int


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = node.body
    if (
        len(body) > 1
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        body = body[1:]
    end = node.end_lineno or node.lineno
    return end - body[0].lineno + 1


def functions(mod: str, tree: ast.Module) -> list[Function]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            out.append(Function(mod, node.name, body_lines(node)))
    return out


def _imported(
    mod: str, path: Path, tree: ast.Module, known: set[str]
) -> Iterator[tuple[ast.stmt, str, str | None]]:
    """``(node, module, name)`` for every capsctl module an import in ``tree`` reaches: the
    module, and the name imported from it (None for ``import x`` and for a module imported
    from its package)."""
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                name = _known(a.name, known)
                if name:
                    yield node, name, None
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for a in node.names:
                # ``from package import module`` imports the module, not the package's names
                if f"{base}.{a.name}" in known:
                    yield node, f"{base}.{a.name}", None
                elif _known(base, known):
                    yield node, _known(base, known), a.name  # type: ignore[misc]


def _known(name: str, known: set[str]) -> str:
    """The longest known module that ``name`` is or lies in ("" for none)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name


def imports(mod: str, path: Path, tree: ast.Module, known: set[str]) -> set[str]:
    """capsctl modules that ``mod`` imports (anywhere in the file)."""
    return {m for _, m, _ in _imported(mod, path, tree, known) if m != mod}


def import_graph() -> dict[str, set[str]]:
    src = sources()
    known = set(src)
    return {m: imports(m, p, ast.parse(p.read_text()), known) for m, p in src.items()}


def floor_of(module: str) -> int | None:
    """The floor (index in :data:`FLOORS`) of a module of capsctl/layers/, None outside it."""
    if module == LAYERS:
        return FLOORS.index("face")
    if not module.startswith(LAYERS + "."):
        return None
    part = module.split(".")[2]
    return (
        FLOORS.index(part) if part in ("backend", "passes", "routers") else FLOORS.index("layers")
    )


def floors(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """The modules of capsctl/layers/ on each floor, lowest first."""
    out: dict[str, list[str]] = {f: [] for f in FLOORS}
    for module in sorted(graph):
        floor = floor_of(module)
        if floor is not None:
            out[FLOORS[floor]].append(module)
    return out


def floor_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports inside capsctl/layers/ that point up a floor (backend imports only backend)."""
    wrong = []
    for module, deps in sorted(graph.items()):
        mine = floor_of(module)
        for dep in sorted(deps):
            theirs = floor_of(dep)
            if mine is not None and theirs is not None and theirs > mine:
                wrong.append(f"{module} -> {dep} ({FLOORS[mine]} imports {FLOORS[theirs]})")
    return wrong


def _files() -> dict[str, Path]:
    """The package's modules and the scripts (as ``scripts.<name>``)."""
    return {**sources(), **{f"scripts.{p.stem}": p for p in sorted(SCRIPTS.glob("*.py"))}}


def face_violations() -> list[str]:
    """Imports of capsctl/layers/ from outside it (package and scripts) that pass by the face:
    anything but ``capsctl.layers`` and ``capsctl.layers.routers``."""
    known = set(sources())
    wrong = []
    for mod, path in _files().items():
        if floor_of(mod) is not None:
            continue
        for node, target, _ in _imported(mod, path, ast.parse(path.read_text()), known):
            if floor_of(target) is not None and target not in FACE:
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: imports {target}")
    return sorted(set(wrong))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(*, left: bool = False) -> list[str]:
    """Private names (``_name``) of one capsctl module imported or used by another: ``from m
    import _x``, or ``m._x`` for a module ``m`` imported by name; those of
    :data:`PRIVATE_LEFT` only where ``left``, else all others."""
    known = set(sources())
    wrong = []
    for mod, path in sources().items():
        tree = ast.parse(path.read_text())
        aliases: dict[str, str] = {}
        for node, target, name in _imported(mod, path, tree, known):
            if target == mod:
                continue
            if name is not None and _private(name) and (f"{target}.{name}" in PRIVATE_LEFT) == left:
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: {target}.{name}")
            for a in node.names:  # type: ignore[attr-defined]
                if name is None:  # a module bound to a name
                    bound = a.asname or a.name.split(".")[0]
                    if target.endswith("." + a.name.split(".")[-1]) or a.asname:
                        aliases[bound] = target
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and _private(node.attr)
                and (f"{aliases[node.value.id]}.{node.attr}" in PRIVATE_LEFT) == left
            ):
                wrong.append(
                    f"{path.relative_to(ROOT)}:{node.lineno}: {aliases[node.value.id]}.{node.attr}"
                )
    return sorted(set(wrong))


def native_sizes() -> dict[str, int]:
    """Lines of the package's C++ sources and headers."""
    found = (p for p in sorted(PACKAGE.rglob("*")) if p.suffix in NATIVE_SUFFIXES)
    return {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in found}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def report() -> dict[str, object]:
    src = sources()
    sizes = {m: len(p.read_text().splitlines()) for m, p in src.items()}
    funcs = [f for m, p in src.items() for f in functions(m, ast.parse(p.read_text()))]
    graph = import_graph()
    return {
        "sizes": sizes,
        "native_sizes": native_sizes(),
        "functions": funcs,
        "cycles": cycles(graph),
        "graph": graph,
        "floors": floors(graph),
        "violations": floor_violations(graph) + face_violations() + private_imports(),
        "private_left": private_imports(left=True),
    }


def main() -> None:
    r = report()
    sizes: dict[str, int] = r["sizes"]  # type: ignore[assignment]
    funcs: list[Function] = r["functions"]  # type: ignore[assignment]
    print("largest modules (lines):")
    for m, n in sorted(sizes.items(), key=lambda kv: -kv[1])[:8]:
        print(f"  {n:5d}  {m}")
    print("longest functions (body lines):")
    for f in sorted(funcs, key=lambda f: -f.lines)[:8]:
        print(f"  {f.lines:5d}  {f.module}.{f.name}")
    print(f"modules: {len(sizes)}, functions: {len(funcs)}")
    print(f"import cycles: {len(r['cycles'])}")  # type: ignore[arg-type]
    for c in r["cycles"]:  # type: ignore[attr-defined]
        print("  " + " <-> ".join(c))
    native: dict[str, int] = r["native_sizes"]  # type: ignore[assignment]
    print("C++ sources and headers (lines):")
    for name, n in sorted(native.items(), key=lambda kv: -kv[1]):
        print(f"  {n:5d}  {name}")
    print("floors of capsctl/layers/ (lowest first; each imports only its own floor or below):")
    for floor, modules in r["floors"].items():  # type: ignore[attr-defined]
        names = ", ".join(m.removeprefix(LAYERS + ".") or "capsctl.layers" for m in modules)
        print(f"  {floor:8s} {names}")
    violations: list[str] = r["violations"]  # type: ignore[assignment]
    print(f"house-rule violations: {len(violations)}")
    for v in violations:
        print("  " + v)
    left: list[str] = r["private_left"]  # type: ignore[assignment]
    print(f"private imports outside capsctl/layers/ left to their rooms' owners: {len(left)}")
    for v in left:
        print("  " + v)


if __name__ == "__main__":
    main()
