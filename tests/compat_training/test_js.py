"""onnxruntime-web's former training API in js/ (src/ort_training.js) on onnxruntime-node: the
numbers of the Python API on the same folder. Skipped when node or npm is missing; fails when js/'s
dependencies cannot be installed (tests/_node.py installs them once, under a lock)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests._node import JS, node_with_js_dependencies


def test_js_training_session_matches_python(tmp_path):
    node = node_with_js_dependencies()
    fixture = tmp_path / "fixture"
    subprocess.run(
        [sys.executable, str(JS / "test" / "make_ort_training_fixture.py"), str(fixture)],
        check=True,
        timeout=300,
    )
    env = {**os.environ, "ONNXGRAD_ORT_TRAINING_FIXTURE": str(fixture)}
    done = subprocess.run(
        [node, "--test", "test/ort_training.test.js"],
        cwd=JS,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "# pass 12" in done.stdout and "# fail 0" in done.stdout
