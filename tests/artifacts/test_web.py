"""The browser example (examples/web/): the digits MLP and CNN trained by onnxruntime-web in headless
chromium (wasm, then WebGPU on the software adapter) give the Python runner's losses. Skipped
without node, chromium or the example's installed dependencies (``make test-web`` installs them)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WEB = ROOT / "examples" / "web"


def test_browser_training_matches_python(tmp_path):
    pytest.importorskip("sklearn")
    node = shutil.which("node")
    chromium = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if node is None or chromium is None:
        pytest.skip("node and chromium are needed for the browser test")
    if (
        not (WEB / "node_modules" / "onnxruntime-web").is_dir()
        or not (WEB / "node_modules" / "puppeteer-core").is_dir()
    ):
        pytest.skip("examples/web has no node_modules: run make test-web (npm ci) first")
    fixture = WEB / "fixture"
    subprocess.run(
        [sys.executable, str(ROOT / "js" / "test" / "make_fixture.py"), str(fixture)], check=True, timeout=300
    )
    shot = tmp_path / "screenshot.png"
    env = {**os.environ, "CHROMIUM": chromium, "SCREENSHOT": str(shot)}
    done = subprocess.run(
        [node, "test-web.mjs"], cwd=WEB, env=env, capture_output=True, text=True, timeout=1500
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    assert "chromium, onnxruntime-web (wasm): 200 losses" in done.stdout
    for model in ("mlp", "cnn"):
        assert f"{model}: chromium, onnxruntime-web (webgpu): " in done.stdout, done.stdout[-3000:]
    assert shot.stat().st_size > 10_000
