"""Package-level promises: no torch at import, one version, README examples that run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

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
