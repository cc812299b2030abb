"""Every code block of docs/*.md runs as written.

Blocks fenced ``python`` run with this interpreter, blocks fenced ``bash`` with bash (``set -e``,
with this interpreter's ``onnxgrad`` command first on the PATH); other fences (``text``,
``console``) are not run. Each block runs in its own subprocess; the blocks of one page share a
fresh temporary directory as working directory and run in order, so a page can write a model in
one block and train it from the command line in the next.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
RUNNERS = {"python": [sys.executable, "-"], "bash": ["bash", "-e", "-s"]}
PAGES = sorted(DOCS.glob("*.md"))


def blocks(page: Path) -> list[tuple[str, str, int]]:
    """(language, code, first line) of each fenced block of ``page``."""
    text = page.read_text()
    return [(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 2) for m in FENCE.finditer(text)]


def test_every_task_has_a_page():
    names = {p.stem for p in PAGES}
    assert {"finetune", "torch_layer", "custom_function", "sklearn", "migrate_onnxcustom"} <= names


@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_page_runs(page, tmp_path):
    found = blocks(page)
    runnable = [(lang, code, line) for lang, code, line in found if lang in RUNNERS]
    unknown = {lang for lang, _, _ in found} - {*RUNNERS, "text", "console"}
    assert not unknown, f"{page.name}: fences {unknown} are neither run nor marked text/console"
    if not runnable:
        pytest.skip(f"{page.name} has no runnable block")
    env = {
        **os.environ,
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
        "MPLBACKEND": "Agg",
        "PYTHONWARNINGS": "ignore::DeprecationWarning",
    }
    for lang, code, line in runnable:
        done = subprocess.run(
            RUNNERS[lang], input=code, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, (
            f"{page.name}, {lang} block at line {line} failed (exit {done.returncode}):\n"
            f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
