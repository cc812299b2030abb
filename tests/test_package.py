"""Package-level promises: no torch at import, one version, README examples that run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import onnxgrad

ROOT = Path(__file__).resolve().parents[1]


def test_import_does_not_load_torch():
    code = "import sys, onnxgrad; onnxgrad.supported_ops(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_version_is_defined_once():
    from importlib.metadata import version

    assert onnxgrad.__version__ == version("onnxgrad")
    defined = [p for p in (ROOT / "src").rglob("*.py") if "__version__ =" in p.read_text()]
    assert [p.name for p in defined] == ["_version.py"]
    assert 'dynamic = ["version"]' in (ROOT / "pyproject.toml").read_text()


def test_readme_python_blocks_run(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert blocks, "the README has no python example"
    for block in blocks:
        script = tmp_path / "example.py"
        script.write_text(block)
        res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path)
        assert res.returncode == 0, res.stderr


def test_readme_counts_the_ops_with_rules():
    """The README's "N ops with rules" is the number of standard-domain ops with a rule or formula."""
    claim = re.search(r"(\d+) ops with rules", (ROOT / "README.md").read_text())
    assert claim, "the README no longer says how many ops have rules"
    ops = onnxgrad.supported_ops()
    standard = [op for op, how in ops.items() if "." not in op and how in ("rule", "formula")]
    assert int(claim.group(1)) == len(standard)


def test_package_is_typed_for_users():
    """py.typed (PEP 561) sits in the package and pyproject ships it in the wheel; the wheel itself is
    checked by tools/wheel_smoke.py (make test-wheel)."""
    import tomllib

    assert (Path(onnxgrad.__file__).parent / "py.typed").is_file()
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "py.typed" in setuptools["package-data"]["onnxgrad"]


USER_SCRIPT = """\
import numpy as np
import onnxgrad

reveal_type(onnxgrad.gradients)
reveal_type(onnxgrad.build_gradient)
reveal_type(onnxgrad.ForwardBackward)
grads = onnxgrad.gradients("model.onnx", {"x": np.zeros(3)})
reveal_type(grads)
onnxgrad.gradients("model.onnx", feeds=3)
"""


def test_mypy_sees_onnxgrad_types(tmp_path):
    """mypy on a user's script finds onnxgrad as an installed, typed package (not ``Any``) and reports
    a wrong argument type."""
    pytest.importorskip("mypy", reason="mypy is in the dev extra")
    (tmp_path / "user.py").write_text(USER_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(onnxgrad.__file__).parent.parent)}  # the onnxgrad under test
    env.pop("MYPYPATH", None)  # found as an installed package: mypy then requires py.typed
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "--cache-dir", os.devnull, "user.py"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=600,
    )
    out = done.stdout + done.stderr
    assert "import-untyped" not in out and "missing library stubs" not in out, out
    revealed = re.findall(r'^user\.py:(\d+): note: Revealed type is "(.*)"$', out, re.M)
    assert [line for line, _ in revealed] == ["4", "5", "6", "8"], out
    types = dict(revealed)
    assert types["4"] != "Any" and types["4"].startswith("def (model:"), types["4"]
    assert "-> dict[str, numpy.ndarray" in types["4"], types["4"]
    assert types["5"].endswith("GradientGraphs"), types["5"]
    assert types["6"].endswith(".ForwardBackward"), types["6"]
    assert re.match(r"(builtins\.)?dict\[(builtins\.)?str, numpy\.ndarray\[", types["8"]), types["8"]
    wrong = r'^user\.py:9: error: Argument "feeds" to "gradients" has incompatible type "int"'
    assert re.search(wrong, out, re.M), out
    assert done.returncode == 1, out  # the one error above, nothing else


def test_readme_supported_releases_are_the_declared_bounds():
    """The README's "Supported releases" line says what pyproject.toml declares (pyproject is the
    truth), for onnx, onnxruntime, numpy, torch and any other it names."""
    import tomllib

    readme = " ".join((ROOT / "README.md").read_text().split())
    line = re.search(r"Supported releases: (.*?)\(the `torch` extra\)", readme)
    assert line, "the README no longer says which releases it supports"
    claimed = dict(re.findall(r"([\w-]+) >= ([\d.]+)", line.group(1)))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {}
    for req in [*project["dependencies"], *project["optional-dependencies"]["torch"]]:
        name, bound = re.fullmatch(r"([\w-]+)>=([\d.]+)", req).groups()
        declared[name] = bound
    assert {"onnx", "onnxruntime", "numpy", "torch"} <= claimed.keys()
    assert {name: declared.get(name) for name in claimed} == claimed
