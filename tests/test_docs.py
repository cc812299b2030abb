"""Every page of docs/*.md does what it shows, and checks what it promises.

* Blocks fenced ``python`` run with this interpreter, blocks fenced ``bash`` with bash (``set -e``,
  with this interpreter's ``onnxgrad`` command first on the PATH). Each block runs in its own
  subprocess; the blocks of one page share a fresh temporary directory as working directory and run
  in order, so a page can write a model in one block and train it from the command line in the next.
* A ``python`` block must check something (an ``assert``, or a call to an ``assert_*`` function such
  as ``np.testing.assert_allclose``): a block that only runs proves that it does not crash.
* Blocks fenced ``console`` show commands (lines starting with ``$ ``) and what they print. The
  ``onnxgrad ...`` and ``python -m onnxgrad ...`` commands run, in order with the page's other
  blocks, and print exactly what the page shows (numbers in scientific notation, such as finite
  difference errors, may differ in their digits); other commands (``torchrun``) are shown only.
* ``text`` blocks (code that cannot run here, sample output that depends on the machine) are not run.
* docs/coverage.md is what ``onnxgrad coverage --markdown`` prints, under the page's introduction.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
RUNNERS = {"python": [sys.executable, "-"], "bash": ["bash", "-e", "-s"]}
PAGES = sorted(DOCS.glob("*.md"))
ONNXGRAD_COMMAND = re.compile(r"^(onnxgrad|python -m onnxgrad)\b")
SCIENTIFIC = re.compile(r"\d\.\d+e[-+]\d+")


def blocks(page: Path) -> list[tuple[str, str, int]]:
    """(language, code, first line) of each fenced block of ``page``."""
    text = page.read_text()
    return [(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 2) for m in FENCE.finditer(text)]


def console_commands(code: str) -> list[tuple[str, str]]:
    """(command, output shown after it) for each ``$ `` line of a console block."""
    found: list[tuple[str, list[str]]] = []
    lines = code.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("$ "):
            command = line[2:]
            while command.endswith("\\") and i + 1 < len(lines):  # continuation lines
                i += 1
                command = command[:-1] + " " + lines[i].strip()
            found.append((command, []))
        elif found:
            found[-1][1].append(line)
        i += 1
    return [(command, "\n".join(output)) for command, output in found]


def normalized(text: str) -> str:
    """Lines without trailing blanks, no trailing empty lines, scientific numbers masked."""
    lines = [SCIENTIFIC.sub("<x.xxe-xx>", line.rstrip()) for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def checks_something(code: str) -> bool:
    """Whether a python block holds an ``assert`` or calls an ``assert_*`` function."""
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Assert):
            return True
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name.startswith("assert"):
                return True
    return False


def python_blocks() -> list[tuple[str, str, int]]:
    """(where, code, first line) of every python block of the docs and the README."""
    found = []
    for page in [*PAGES, ROOT / "README.md"]:
        found += [(page.name, code, line) for lang, code, line in blocks(page) if lang == "python"]
    return found


def _run(args: list[str], cwd: Path, env: dict[str, str], code: str | None = None) -> Any:
    return subprocess.run(args, input=code, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_every_task_has_a_page():
    names = {p.stem for p in PAGES}
    assert {"finetune", "torch_layer", "custom_function", "sklearn", "migrate_onnxcustom"} <= names


@pytest.mark.parametrize(("where", "code", "line"), python_blocks(), ids=lambda v: str(v)[:40])
def test_python_blocks_check_what_they_show(where, code, line):
    assert checks_something(code), f"{where}, python block at line {line} asserts nothing"


def test_console_blocks_are_parsed():
    code = "$ onnxgrad info a.onnx \\\n    --x 1\nline 1\n  line 2  \n\n$ torchrun x.py\n"
    assert console_commands(code) == [
        ("onnxgrad info a.onnx  --x 1", "line 1\n  line 2  \n"),
        ("torchrun x.py", ""),
    ]
    assert normalized("error  1.02e-09   ok  \n\n") == "error  <x.xxe-xx>   ok"


@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_page_runs(page, tmp_path):
    found = blocks(page)
    runnable = [(lang, code, line) for lang, code, line in found if lang in RUNNERS or lang == "console"]
    unknown = {lang for lang, _, _ in found} - {*RUNNERS, "text", "console"}
    assert not unknown, f"{page.name}: fences {unknown} are neither run nor marked text/console"
    if not runnable:
        pytest.skip(f"{page.name} has no runnable block")
    env = {
        **os.environ,
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
        "MPLBACKEND": "Agg",
        "PYTHONWARNINGS": "ignore::DeprecationWarning",
        "COLUMNS": "100",
    }
    for lang, code, line in runnable:
        if lang == "console":
            for command, shown in console_commands(code):
                if not ONNXGRAD_COMMAND.match(command):
                    continue  # shown only (torchrun...)
                command = re.sub(r"^python\b", f'"{sys.executable}"', command)
                done = _run(["bash", "-c", command], tmp_path, env)
                assert done.returncode == 0, (
                    f"{page.name}, console block at line {line}: {command!r} failed "
                    f"(exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
                )
                if shown.strip():
                    assert normalized(done.stdout) == normalized(shown), (
                        f"{page.name}, console block at line {line}: {command!r} prints something else "
                        "than the page shows"
                    )
            continue
        done = _run(RUNNERS[lang], tmp_path, env, code)
        assert done.returncode == 0, (
            f"{page.name}, {lang} block at line {line} failed (exit {done.returncode}):\n"
            f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )


def test_coverage_page_is_what_the_command_prints():
    """docs/coverage.md = its introduction + ``onnxgrad coverage --markdown``, exactly. Regenerate
    it with ``make docs-coverage``."""
    page = (DOCS / "coverage.md").read_text()
    intro, table_start, _ = page.partition("\n| op |")
    assert table_start, "docs/coverage.md has no table"
    assert "Generated by `onnxgrad coverage --markdown`" in intro
    done = subprocess.run(
        [sys.executable, "-m", "onnxgrad", "coverage", "--markdown"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    assert page == f"{intro}\n{done.stdout}", "docs/coverage.md is stale: run `make docs-coverage`"


# The public API as /work/shared/API.md fixes it (names users, docs and outside checks call), with the
# members it names; every other public module is covered through its ``__all__`` (or its public
# functions and classes when it has none).
API_NAMES = [
    "onnxgrad.build_gradient",
    "onnxgrad.GradientGraphs",
    "onnxgrad.GradientGraphs.forward",
    "onnxgrad.GradientGraphs.backward",
    "onnxgrad.GradientGraphs.trainable",
    "onnxgrad.GradientGraphs.saved",
    "onnxgrad.GradientGraphs.save",
    "onnxgrad.gradients",
    "onnxgrad.supported_ops",
    "onnxgrad.ForwardBackward",
    "onnxgrad.ForwardBackward.forward",
    "onnxgrad.ForwardBackward.parameters",
    "onnxgrad.ForwardBackward.set_parameters",
    "onnxgrad.ForwardBackward.to_onnx",
    "onnxgrad.torch.OnnxModule",
    "onnxgrad.torch.OnnxModule.forward",
    "onnxgrad.torch.OnnxModule.to_onnx",
    "onnxgrad.export",
    "onnxgrad.register_function",
    "onnxgrad.compat.OrtGradientForwardBackward",
    "onnxgrad.compat.OrtGradientForwardBackwardFunction",
]
REFERENCE_MODULES = [
    "onnxgrad",
    "onnxgrad.torch",
    "onnxgrad.train",
    "onnxgrad.sklearn",
    "onnxgrad.lora",
    "onnxgrad.artifacts",
    "onnxgrad.compat",
    "onnxgrad.testing",
    "onnxgrad.errors",
]


def public_names(module_name: str) -> list[str]:
    """Dotted public names of a module: its ``__all__``, else the functions and classes it defines."""
    import importlib
    import inspect

    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None)
    if names is None:
        names = [
            n
            for n, obj in vars(module).items()
            if not n.startswith("_")
            and (inspect.isfunction(obj) or inspect.isclass(obj))
            and obj.__module__ == module_name
        ]
    return [f"{module_name}.{n}" for n in names if not n.startswith("__")]


def reference_ids(name: str) -> set[str]:
    """The anchors that document ``name``: its dotted public path, the same object in another public
    module (``onnxgrad.register_function`` is ``onnxgrad.torch.register_function``), or where it is
    defined, seen from any package above its module (``onnxgrad.export`` is
    ``onnxgrad.torch.export.export``)."""
    import importlib

    parts = name.split(".")
    obj: Any = importlib.import_module(parts[0])
    for part in parts[1:]:
        obj = getattr(obj, part, None)  # None: a dataclass field, documented under its own name
    ids = {name}
    if obj is not None:
        short = parts[-1]
        ids |= {
            f"{m}.{short}"
            for m in REFERENCE_MODULES
            if getattr(importlib.import_module(m), short, None) is obj
        }
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str):
        packages = module.split(".")
        ids |= {".".join([*packages[:i], qualname]) for i in range(1, len(packages) + 1)}
    return ids


def test_reference_has_a_page_per_public_module():
    """docs/reference/ has one page per public module, each in the site's navigation."""
    pages = {p.stem for p in (DOCS / "reference").glob("*.md")} - {"index"}
    assert {p if p == "onnxgrad" else f"onnxgrad.{p}" for p in pages} == set(REFERENCE_MODULES)
    nav = (ROOT / "mkdocs.yml").read_text()
    assert all(f"reference/{p}.md" in nav for p in [*pages, "index"])


def test_api_reference_builds_and_lists_every_public_name(tmp_path):
    """``mkdocs build --strict`` (what ``make docs`` runs) succeeds, and the built reference holds an
    anchor for every public name: those of the API page and every public module's."""
    pytest.importorskip("mkdocstrings_handlers.python", reason="the docs extra is not installed")
    site = tmp_path / "site"
    build = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml")]
    done = _run([*build, "-d", str(site)], ROOT, dict(os.environ))
    assert done.returncode == 0, f"mkdocs build --strict:\n{done.stdout[-3000:]}\n{done.stderr[-4000:]}"
    anchors = set()
    for page in (site / "reference").rglob("*.html"):
        anchors |= set(re.findall(r'id="(onnxgrad[\w.]*)"', page.read_text()))
    names = API_NAMES + [n for module in REFERENCE_MODULES for n in [module, *public_names(module)]]
    missing = [n for n in names if not reference_ids(n) & anchors]
    assert not missing, f"the API reference (docs/reference/) does not document {missing}"
