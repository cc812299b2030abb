"""The JavaScript runner (js/) on onnxruntime-node: the digits MLP's 200 losses equal the Python
runner's. Skipped when node or npm is missing; fails when js/'s dependencies cannot be installed
(tests/_node.py installs them once, under a lock)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests._node import JS, node_with_js_dependencies


def test_node_runner_matches_python(tmp_path):
    pytest.importorskip("sklearn")
    node = node_with_js_dependencies()
    fixture = tmp_path / "fixture"
    subprocess.run(
        [sys.executable, str(JS / "test" / "make_fixture.py"), str(fixture)], check=True, timeout=300
    )
    env = {**os.environ, "ONNXGRAD_JS_FIXTURE": str(fixture)}
    done = subprocess.run(
        # not test/package.test.js: make test-js packs and installs the package from the registry
        [node, "--test", "test/train.test.js", "test/shapes.test.js", "test/checks.test.js"],
        cwd=JS,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "# fail 0" in done.stdout
