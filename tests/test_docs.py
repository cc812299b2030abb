"""Every page of docs/*.md does what it shows, and checks what it promises.

* Blocks fenced ``python`` run with this interpreter, blocks fenced ``bash`` or ``shell`` with bash
  (``set -e``, with this interpreter's ``onnxgrad`` command first on the PATH, as in an activated
  venv). Each block runs in its own
  subprocess; the blocks of one page share a fresh temporary directory as working directory and run
  in order, so a page can write a model in one block and train it from the command line in the next.
* A ``python`` block must check something (an ``assert``, or a call to an ``assert_*`` function such
  as ``np.testing.assert_allclose``): a block that only runs proves that it does not crash.
* Blocks fenced ``console`` show commands (lines starting with ``$ ``) and what they print. The
  ``onnxgrad ...`` and ``python -m onnxgrad ...`` commands run, in order with the page's other
  blocks, and print exactly what the page shows (numbers in scientific notation, such as finite
  difference errors, may differ in their digits); other commands (``torchrun``, ``pip install``)
  are shown only.
* ``pip install`` lines (README and pages, blocks and inline code) cannot run here (no network):
  they belong in ``console`` blocks or prose, never in a block that runs, and each must name
  something that exists: this checkout (``.`` or a path to it) or the wheel it builds, with extras
  ``pyproject.toml`` declares, and ``torch`` at the locked release; never ``onnxgrad`` from a package
  index, which serves none.
* A page that imports a module of the ``zoo`` extra (transformers, onnxscript) is skipped where that
  extra is not installed (the latest and oldest legs install ``dev`` only).
* ``text`` blocks (code that cannot run here, sample output that depends on the machine) are not run.
* docs/coverage.md is what ``onnxgrad coverage --markdown`` prints, under the page's introduction.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
FENCE = re.compile(r"^([ \t]*)```(\w*)[^\n]*\n(.*?)^\1```", re.M | re.S)  # indented in lists too
RUNNERS = {"python": [sys.executable, "-"], "bash": ["bash", "-e", "-s"], "shell": ["bash", "-e", "-s"]}
PAGES = sorted(DOCS.glob("*.md"))
ONNXGRAD_COMMAND = re.compile(r"^(onnxgrad|python -m onnxgrad)\b")
SCIENTIFIC = re.compile(r"\d\.\d+e[-+]\d+")


def blocks(page: Path) -> list[tuple[str, str, int]]:
    """(language, code, first line) of each fenced block of ``page``."""
    text = page.read_text()
    return [
        (m.group(2), textwrap.dedent(m.group(3)), text.count("\n", 0, m.start()) + 2)
        for m in FENCE.finditer(text)
    ]


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


def pyproject() -> dict[str, Any]:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def requirement_name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].strip().lower()


def zoo_modules() -> set[str]:
    """Top-level modules of the zoo extra's packages that the dev extra lacks (transformers...)."""
    extras = pyproject()["project"]["optional-dependencies"]
    dev = {requirement_name(r) for r in extras["dev"]}
    return {requirement_name(r).replace("-", "_") for r in extras["zoo"]} - dev


def imported_modules(page: Path) -> set[str]:
    """Top-level modules the python blocks of ``page`` import."""
    found = set()
    for lang, code, _ in blocks(page):
        if lang != "python":
            continue
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module.split(".")[0])
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
    missing = sorted(m for m in zoo_modules() & imported_modules(page) if importlib.util.find_spec(m) is None)
    if missing:
        pytest.skip(f"{page.name} needs {', '.join(missing)} (the zoo extra), not installed here")
    env = command_env()
    for lang, code, line in runnable:
        if lang == "console":
            run_console(page.name, code, line, tmp_path, env)
            continue
        done = _run(RUNNERS[lang], tmp_path, env, code)
        assert done.returncode == 0, (
            f"{page.name}, {lang} block at line {line} failed (exit {done.returncode}):\n"
            f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )


def command_env() -> dict[str, str]:
    """The environment of the blocks: this interpreter's ``onnxgrad`` command first on the PATH."""
    return {
        **os.environ,
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
        "MPLBACKEND": "Agg",
        "PYTHONWARNINGS": "ignore::DeprecationWarning",
        "COLUMNS": "100",
    }


def run_console(where: str, code: str, line: int, cwd: Path, env: dict[str, str]) -> None:
    """Run the ``onnxgrad`` commands of a console block; each must print what the block shows."""
    for command, shown in console_commands(code):
        if not ONNXGRAD_COMMAND.match(command):
            continue  # shown only (torchrun, pip install...)
        command = re.sub(r"^python\b", f'"{sys.executable}"', command)
        done = _run(["bash", "-c", command], cwd, env)
        assert done.returncode == 0, (
            f"{where}, console block at line {line}: {command!r} failed "
            f"(exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
        if shown.strip():
            assert normalized(done.stdout) == normalized(shown), (
                f"{where}, console block at line {line}: {command!r} prints something else "
                "than the page shows"
            )


def test_readme_console_commands_run(tmp_path):
    """The README's ``onnxgrad`` console commands (``onnxgrad --version`` after the install) run and
    print what it shows; its pip and make lines are shown only."""
    found = [(code, line) for lang, code, line in blocks(ROOT / "README.md") if lang == "console"]
    assert any(ONNXGRAD_COMMAND.match(c) for code, _ in found for c, _ in console_commands(code))
    for code, line in found:
        run_console("README.md", code, line, tmp_path, command_env())


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
    "onnxgrad.federated",
    "onnxgrad.compat",
    "onnxgrad.compat.training",
    "onnxgrad.testing",
    "onnxgrad.errors",
]
# modules documented on their package's page
REFERENCE_SUBMODULES = [
    "onnxgrad.compat.training.artifacts",
    "onnxgrad.compat.training.api",
    "onnxgrad.compat.training.onnxblock",
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
    """docs/reference/ has one page per public module, each listed on its index page."""
    pages = {p.stem for p in (DOCS / "reference").glob("*.md")} - {"index"}
    assert {p if p == "onnxgrad" else f"onnxgrad.{p}" for p in pages} == set(REFERENCE_MODULES)
    index = (DOCS / "reference" / "index.md").read_text()
    assert all(f"]({p}.md)" in index for p in pages)


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
    modules = REFERENCE_MODULES + REFERENCE_SUBMODULES
    names = API_NAMES + [n for module in modules for n in [module, *public_names(module)]]
    missing = [n for n in names if not reference_ids(n) & anchors]
    assert not missing, f"the API reference (docs/reference/) does not document {missing}"


PIP_INSTALL = re.compile(r"pip install ([^`\n]*)")
OPTIONS_WITH_VALUE = {"-c", "--constraint", "-r", "--requirement", "-i", "--index-url", "--extra-index-url"}


def pip_install_requirements(text: str) -> list[str]:
    """The requirements of every ``pip install`` line in ``text`` (blocks and inline code alike)."""
    import shlex

    found = []
    for match in PIP_INSTALL.finditer(text):
        args = shlex.split(match.group(1), comments=True)
        i = 0
        while i < len(args):
            arg = args[i]
            if arg in OPTIONS_WITH_VALUE:
                i += 1
            elif not arg.startswith("-"):
                found.append(arg)
            i += 1
    return found


def install_problem(requirement: str, extras_declared: set[str], torch_locked: str) -> str | None:
    """What is wrong with one ``pip install`` requirement of the docs, or None."""
    import onnxgrad

    source, _, url = requirement.partition(" @ ")
    where, _, extras = source.partition("[")
    asked = {e.strip() for e in extras.rstrip("]").split(",") if e.strip()}
    name = requirement_name(where)
    wheel = f"onnxgrad-{onnxgrad.__version__}-py3-none-any.whl"
    if name == "torch":
        return None if where == f"torch=={torch_locked}" else f"torch is installed as torch=={torch_locked}"
    if url:
        if name != "onnxgrad":
            return None  # another project's package
        if not url.startswith(("git+", "file:")):
            return f"{url!r} is neither a git URL nor a file URL"
    elif name == "onnxgrad":
        return "no package index serves onnxgrad: install this checkout (a path) or the wheel it builds"
    elif where.endswith(".whl"):
        if where != f"dist/{wheel}":
            return f"the wheel is dist/{wheel}"
    elif where != "." and not where.endswith("/onnxgrad"):
        return None  # another project's package, from PyPI
    if asked - extras_declared:
        return f"extras {sorted(asked - extras_declared)} are not declared in pyproject.toml"
    return None


def locked_torch() -> str:
    """The torch release of the lock, without its local tag (``2.13.0+cpu`` -> ``2.13.0``)."""
    lock = (ROOT / "requirements" / "lock.txt").read_text()
    return re.search(r"^torch==([^+\s]+)", lock, re.M).group(1)


def test_install_rules():
    """The rules catch the lines users met (issue 25) and accept the ways that work."""
    declared = set(pyproject()["project"]["optional-dependencies"])
    torch = locked_torch()
    text = "needs `pip install 'onnxgrad[train]'`\n$ pip install -c lock.txt torch==9.0 --upgrade  # first\n"
    assert pip_install_requirements(text) == ["onnxgrad[train]", "torch==9.0"]
    assert "no package index serves onnxgrad" in install_problem("onnxgrad[train]", declared, torch)
    assert "no package index serves onnxgrad" in install_problem("onnxgrad==0.1", declared, torch)
    assert "torch is installed as" in install_problem("torch==9.0", declared, torch)
    assert "not declared" in install_problem("path/to/onnxgrad[torch,gpu]", declared, torch)
    assert "the wheel is dist/" in install_problem("dist/onnxgrad-9.9-py3-none-any.whl", declared, torch)
    assert "neither a git URL" in install_problem("onnxgrad[torch] @ https://x/y.zip", declared, torch)
    import onnxgrad

    wheel = f"dist/onnxgrad-{onnxgrad.__version__}-py3-none-any.whl[torch,sklearn,train]"
    for good in [".[train]", "path/to/onnxgrad[sklearn]", wheel, f"torch=={torch}", "onnxruntime-extensions"]:
        assert install_problem(good, declared, torch) is None, good
    assert install_problem("onnxgrad[train] @ git+https://example.org/onnxgrad.git", declared, torch) is None


def test_pip_install_lines_name_what_exists():
    """Every ``pip install`` of the README and the pages names this checkout or its wheel with declared
    extras, or torch at the locked release."""
    declared = set(pyproject()["project"]["optional-dependencies"])
    torch = locked_torch()
    problems = []
    for page in [ROOT / "README.md", *PAGES]:
        for requirement in pip_install_requirements(page.read_text()):
            problem = install_problem(requirement, declared, torch)
            if problem:
                problems.append(f"{page.name}: pip install {requirement}: {problem}")
    assert not problems, "\n".join(problems)


def test_pip_install_lines_are_shown_not_run():
    """``pip install`` needs a network: such lines go in console blocks (shown) or prose."""
    for page in [ROOT / "README.md", *PAGES]:
        for lang, code, line in blocks(page):
            if lang in RUNNERS:
                assert "pip install" not in code, f"{page.name}, {lang} block at line {line} runs pip install"


def test_readme_says_how_to_install():
    """The README's install section: the extras users pick from, torch first, the API reference."""
    readme = (ROOT / "README.md").read_text()
    section = readme.partition("## Use it in your own project")[2].partition("\n## ")[0]
    assert section, "the README has no 'Use it in your own project' section"
    requirements = pip_install_requirements(section)
    assert requirements and requirements[0].startswith("torch=="), "torch is installed first"
    extras = pyproject()["project"]["optional-dependencies"]
    for extra in ("torch", "sklearn", "train"):
        assert extra in extras and f"`{extra}`" in section, f"the extra {extra} is not explained"
    assert "docs/reference/" in section


def test_reference_shows_sphinx_roles_as_code():
    """The API reference's griffe extension (tools/griffe_sphinx_roles.py) turns the docstrings'
    Sphinx roles into code spans and ``::`` literal markers into ``:``."""
    pytest.importorskip("griffe", reason="the docs extra is not installed")
    path = ROOT / "tools" / "griffe_sphinx_roles.py"
    spec = importlib.util.spec_from_file_location("griffe_sphinx_roles", path)
    roles = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(roles)
    text = "Uses :func:`~onnxgrad.autodiff.engine.build_gradient` and :class:`ValueError`::\n\n    x = 1\n"
    assert roles.markdown(text) == "Uses `build_gradient` and `ValueError`:\n\n    x = 1\n"
    field = ":param x: a :py:meth:`Runner.step`, not a::b"
    assert roles.markdown(field) == ":param x: a `Runner.step`, not a::b"


def test_ci_builds_the_reference():
    """CI has a docs leg, and ``make docs`` installs the docs extra from the lock and builds strictly
    (mkdocs.yml also sets ``strict``, so a plain ``mkdocs build`` fails on warnings too)."""
    assert re.search(r"^leg docs make docs$", (ROOT / ".ci" / "run").read_text(), re.M)
    target = re.search(r"^docs: .*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M)
    assert target, "the Makefile has no docs target"
    assert '-c $(LOCK) -e ".[docs]"' in target.group(1) and "mkdocs build --strict" in target.group(1)
    assert re.search(r"^strict: true$", (ROOT / "mkdocs.yml").read_text(), re.M)
    extras = pyproject()["project"]["optional-dependencies"]
    lock = (ROOT / "requirements" / "lock.txt").read_text().splitlines()
    locked = {requirement_name(line) for line in lock}
    for requirement in [*extras["docs"], "mypy"]:
        assert requirement_name(requirement) in locked, f"{requirement} is not in requirements/lock.txt"


def test_zoo_pages_are_recognised():
    """The pages that need the zoo extra are found by their imports (skipped where it is missing)."""
    assert zoo_modules() == {"transformers", "onnxscript"}
    assert "transformers" in imported_modules(DOCS / "finetune_big.md")
    assert not zoo_modules() & imported_modules(DOCS / "finetune.md")
