"""``make mutate MODULES=...``: mutation testing of onnxgrad's modules with mutmut 3.8.

mutmut changes one thing at a time in a module (an operator, a constant, a returned value) and
runs the tests that cover the function it changed; a change no test notices (a *survivor*) is a
behaviour no test holds. Usage::

    python tools/mutate.py src/onnxgrad/model/limits.py [onnxgrad.model.fold ...]
        [--tests tests/reliability/test_untrusted.py ...] [--max-children 2] [--work out/mutate]

A module is a path under ``src/onnxgrad`` or a dotted name. The tests default to every test file
that names the module (``onnxgrad.model.limits``) or imports one of its public names (its
``__all__``, else its functions and classes not starting with ``_``); ``--tests`` chooses them.

It runs in a scratch copy of ``src``, ``tests`` and ``pyproject.toml`` (``--work``, under the
git-ignored ``out/``), with a ``setup.cfg`` saying what to mutate, so the checkout is not touched:
mutmut copies the package to ``mutants/`` there (``also_copy``, without which the tests cannot
import the rest of the package) and puts it first on the path. Prints mutmut's survivors, then one
line per module: mutants, killed (a timeout counts as killed), survived, others, and the score
(killed / all). Exit status: mutmut's, or 2 for a bad argument. ``mutmut show NAME`` in the work
folder shows a survivor. Facts measured on this repository: ``../shared/reference/mutation-testing.md``.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "onnxgrad"


def module_path(name: str) -> Path:
    """The source file of ``name`` (a path, relative to the checkout or not, or a dotted name)."""
    path = Path(name)
    if "/" not in name and not name.endswith(".py"):  # a dotted name
        path = ROOT / "src" / Path(*name.split(".")).with_suffix(".py")
    path = (path if path.is_absolute() else ROOT / path).resolve()
    if not path.is_file() or PACKAGE not in path.parents:
        raise SystemExit(f"mutate: {name!r} is not a module of src/onnxgrad")
    return path


def dotted(path: Path) -> str:
    """``src/onnxgrad/model/limits.py`` -> ``onnxgrad.model.limits``."""
    parts = path.relative_to(ROOT / "src").with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def public_names(path: Path) -> list[str]:
    """The module's ``__all__``, else its top-level functions and classes not starting with ``_``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            try:
                return [str(v) for v in ast.literal_eval(node.value)]
            except ValueError:
                break
    defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return [n.name for n in tree.body if isinstance(n, defs) and not n.name.startswith("_")]


def covering_tests(paths: list[Path]) -> list[str]:
    """Test files that name one of the modules or import one of their public names."""
    patterns = []
    for path in paths:
        patterns.append(re.escape(dotted(path)) + r"\b")
        names = "|".join(re.escape(n) for n in public_names(path))
        if names:
            parent = re.escape(dotted(path).rsplit(".", 1)[0])
            patterns.append(rf"from {parent}[\w.]* import [^\n]*\b({names})\b")
            patterns.append(rf"from {parent}[\w.]* import \([^)]*\b({names})\b")
    found = re.compile("|".join(patterns))
    tests = []
    for test in sorted((ROOT / "tests").rglob("test_*.py")):
        if found.search(test.read_text(encoding="utf-8")):
            tests.append(str(test.relative_to(ROOT)))
    return tests


def write_config(work: Path, sources: list[str], tests: list[str]) -> None:
    """The scratch copy of the checkout and its mutmut configuration."""
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis")
    for part in ("src", "tests", "tools"):  # tools: tests/test_mutate_tool.py reads tools/mutate.py
        shutil.copytree(ROOT / part, work / part, ignore=ignore)
    shutil.copy2(ROOT / "pyproject.toml", work / "pyproject.toml")

    def lines(values: list[str]) -> str:
        return "".join(f"\n    {v}" for v in values)

    (work / "setup.cfg").write_text(
        "[mutmut]\n"
        f"source_paths ={lines(sources)}\n"
        f"also_copy ={lines(['src/onnxgrad', 'tools'])}\n"
        f"pytest_add_cli_args ={lines(['-p', 'no:cacheprovider'])}\n"
        f"pytest_add_cli_args_test_selection ={lines(tests)}\n",
        encoding="utf-8",
    )


def scores(results: str, modules: list[str]) -> list[str]:
    """One line per module from ``mutmut results --all true``: counts and the score."""
    by_module: dict[str, Counter[str]] = {m: Counter() for m in modules}
    for line in results.splitlines():
        key, _, status = line.strip().rpartition(": ")
        owner = next((m for m in sorted(modules, key=len, reverse=True) if key.startswith(m + ".")), None)
        if owner is not None:
            by_module[owner][status] += 1
    rows = []
    for module, counts in by_module.items():
        total = sum(counts.values())
        killed = counts["killed"] + counts["timeout"] + counts["caught by type check"]
        others = total - killed - counts["survived"]
        score = f"{100 * killed / total:.1f} %" if total else "-"
        rows.append(
            f"{module}: {total} mutants, {killed} killed, {counts['survived']} survived, {others} other "
            f"({dict(counts)}), score {score}"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make mutate", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "modules", nargs="+", metavar="MODULE", help="paths under src/onnxgrad, or dotted names"
    )
    parser.add_argument(
        "--tests", nargs="*", default=None, help="the test files (default: those covering them)"
    )
    parser.add_argument("--max-children", type=int, default=2, help="mutants tested at once (default 2)")
    parser.add_argument("--work", default=str(ROOT / "out" / "mutate"), help="the scratch folder")
    args = parser.parse_args(argv)
    paths = [module_path(m) for m in args.modules]
    tests = args.tests or covering_tests(paths)
    if not tests:
        print("mutate: no test file names these modules; give them with TESTS=...", file=sys.stderr)
        return 2
    work = Path(args.work).resolve()
    sources = [str(p.relative_to(ROOT)) for p in paths]
    write_config(work, sources, tests)
    print(f"mutating {', '.join(sources)} with {len(tests)} test file(s): {' '.join(tests)}", flush=True)
    mutmut = [sys.executable, "-m", "mutmut"]
    # child interpreters the tests start (run_isolated) import the mutated package too, not the
    # checkout's (installed editable); the mutant to activate reaches them in the environment. The
    # folder exists before mutmut starts: Python caches a path entry that does not exist as empty.
    (work / "mutants" / "src").mkdir(parents=True)
    env = {
        **os.environ,
        "PYTHONPATH": str(work / "mutants" / "src"),
    }
    ran = subprocess.run([*mutmut, "run", "--max-children", str(args.max_children)], cwd=work, env=env)
    results = subprocess.run([*mutmut, "results", "--all", "true"], cwd=work, capture_output=True, text=True)
    survivors = [line.strip() for line in results.stdout.splitlines() if line.strip().endswith(": survived")]
    if survivors:
        print("survivors (mutmut show NAME in " + str(work) + "):")
        print("\n".join(f"  {s}" for s in survivors))
    print("\n".join(scores(results.stdout, [dotted(p) for p in paths])))
    return ran.returncode or results.returncode


if __name__ == "__main__":
    sys.exit(main())
