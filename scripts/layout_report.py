"""Sizes and imports of the capsctl package: the figures tests/test_layout.py holds to.

    python scripts/layout_report.py          # largest modules and functions, import cycles

A function's length counts the lines of its body (from the first statement after the
docstring to the end), so a long option list of a command or a docstring does not count.
Imports inside functions count as edges of the import graph just as top-level ones do.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "capsctl"


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


def imports(mod: str, path: Path, tree: ast.Module, known: set[str]) -> set[str]:
    """capsctl modules that ``mod`` imports (anywhere in the file)."""
    found: set[str] = set()
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from package import module`` imports the module, not the package's names
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != mod:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    src = sources()
    known = set(src)
    return {m: imports(m, p, ast.parse(p.read_text()), known) for m, p in src.items()}


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
    return {"sizes": sizes, "functions": funcs, "cycles": cycles(graph), "graph": graph}


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


if __name__ == "__main__":
    main()
