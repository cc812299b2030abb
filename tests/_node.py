"""The Node tools the JavaScript tests need: node and npm, with js/'s dependencies installed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

JS = Path(__file__).resolve().parents[1] / "js"


def node_with_js_dependencies() -> str:
    """The path of ``node``, once js/'s dependencies are installed; skips the test when node or npm
    is missing or ``npm ci`` fails (offline)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("node and npm are needed for the JavaScript tests")
    if not (JS / "node_modules" / "onnxruntime-node").is_dir():
        done = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund"], cwd=JS, capture_output=True, text=True, timeout=600
        )
        if done.returncode != 0:
            pytest.skip(f"npm ci failed in js/ (offline?): {done.stderr[-500:]}")
    return node
