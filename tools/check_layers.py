"""The layer contract of onnxgrad: every import looks down, and no module imports itself back.

Run by ``make lint`` (and by ``tests/test_layers.py``)::

    python tools/check_layers.py [SRC_DIR]

Every import statement counts, at module level or inside a function (a lazy import is still a
dependency). A module may import modules of its own layer or of a lower one; a package's
``__init__`` may also import its own submodules (it is their façade). Besides, the module graph must
have no cycle, inside a layer too. Exits 1 and lists the offending imports otherwise.
See docs/architecture.md for the picture.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

# Top to bottom. A module belongs to the layer of the longest prefix that names it.
LAYERS: list[tuple[str, list[str]]] = [
    ("command line", ["onnxgrad.cli", "onnxgrad.__main__"]),
    (
        "front ends",
        [
            "onnxgrad.torch",
            "onnxgrad.compat",
            "onnxgrad.sklearn",
            "onnxgrad.demo",
            "onnxgrad.testing",
            "onnxgrad.lora",
            "onnxgrad.federated",
        ],
    ),
    # the trainer runs one-graph steps that the artifacts build; the package façade re-exports it
    ("trainer", ["onnxgrad.train", "onnxgrad.train.trainer", "onnxgrad.train.onegraph"]),
    ("artifacts", ["onnxgrad.artifacts"]),
    (
        "training parts",
        [
            "onnxgrad.train.losses",
            "onnxgrad.train.optim",
            "onnxgrad.train.optimizers",
            "onnxgrad.train.schedules",
            "onnxgrad.train.data",
            "onnxgrad.train.plot",
        ],
    ),
    ("pythonop plug-in", ["onnxgrad.pythonop"]),
    ("runtime", ["onnxgrad.runtime"]),
    ("autodiff", ["onnxgrad.autodiff"]),
    ("model", ["onnxgrad.model", "onnxgrad.validate", "onnxgrad.storage"]),
    ("base", ["onnxgrad.errors", "onnxgrad.deps", "onnxgrad._version"]),
]
ROOT = "onnxgrad"  # the package façade: above everything, imported by nothing inside


def module_names(src: Path) -> dict[str, Path]:
    """Module name -> file, for every module of the package under ``src``."""
    found = {}
    for path in sorted((src / ROOT).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports_of(name: str, path: Path, known: set[str]) -> list[tuple[int, str]]:
    """(line, imported module) for every import of a package module in ``path``, lazy ones included."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # ``from pkg import sub`` imports the submodule; ``from pkg import name`` the package
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # ``import onnxgrad.a.b`` names the deepest module
                target = target.rpartition(".")[0]
            if target and (target == ROOT or target.startswith(ROOT + ".")):
                out.append((node.lineno, target))
    return sorted(set(out))


def layer_of(module: str) -> int | None:
    """Index of the layer of ``module`` in :data:`LAYERS` (0 is the top), None for the root."""
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    return rank


def check(src: Path) -> list[str]:
    """Every violation of the contract, as text (empty when the package keeps it)."""
    modules = module_names(src)
    known = set(modules)
    problems: list[str] = []
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        mine = layer_of(name)
        if mine is None and name != ROOT:
            problems.append(f"{path}: module {name} belongs to no layer (add it to tools/check_layers.py)")
            continue
        for line, target in imports_of(name, path, known):
            if target == name:
                continue
            edges[name].add(target)
            if name == ROOT or target.startswith(name + "."):
                continue  # the root façade, or a package importing its own submodules
            theirs = layer_of(target)
            if target == ROOT:
                problems.append(f"{path}:{line}: {name} imports the package root {ROOT} (import the module)")
            elif theirs is not None and mine is not None and theirs < mine:
                problems.append(
                    f"{path}:{line}: {name} ({LAYERS[mine][0]}) imports {target} ({LAYERS[theirs][0]}), "
                    "a higher layer"
                )
    problems.extend(f"import cycle: {' -> '.join(c)}" for c in cycles(edges))
    return problems


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of modules (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return [_one_cycle(sorted(g), edges) for g in groups]


def _one_cycle(group: list[str], edges: dict[str, set[str]]) -> list[str]:
    """A path from the group's first module back to itself, inside the group."""
    members, start = set(group), group[0]
    paths = {start: [start]}
    todo = [start]
    while todo:
        v = todo.pop(0)
        for w in sorted(edges[v] & members):
            if w == start:
                return [*paths[v], start]
            if w not in paths:
                paths[w] = [*paths[v], w]
                todo.append(w)
    return group  # pragma: no cover - a strongly connected group always has a cycle


def main(argv: list[str]) -> int:
    src = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent / "src"
    problems = check(src)
    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} layer contract violation(s); see docs/architecture.md")
        return 1
    print(f"layers kept: {len(module_names(src))} modules, {len(LAYERS)} layers, no import cycle")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
