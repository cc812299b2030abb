"""tests/_node.py installs js/'s dependencies once, even when several pytest-xdist workers ask at
the same time: here two processes run the installer at once on a package folder whose "npm ci" is a
slow fake that counts its runs and, like npm ci, removes node_modules before writing it again."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests._node import NodeInstallError, install_once

ROOT = Path(__file__).resolve().parents[1]

# the fake npm ci: one line per run in runs.txt, node_modules removed, then written slowly
FAKE_NPM_CI = textwrap.dedent(
    """
    import pathlib, shutil, time
    here = pathlib.Path.cwd()
    with open(here / "runs.txt", "a") as runs:
        runs.write("run\\n")
    shutil.rmtree(here / "node_modules", ignore_errors=True)
    package = here / "node_modules" / "onnxruntime-node"
    package.mkdir(parents=True)
    time.sleep(1.0)
    (package / "index.js").write_text("export default 1;")
    """
)

# one worker: install, then say whether it sees a complete package
WORKER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from tests._node import install_once
    folder = Path(sys.argv[1])
    install_once(folder, [sys.executable, str(folder / "fake_npm_ci.py")])
    print((folder / "node_modules" / "onnxruntime-node" / "index.js").is_file())
    """
)


def _package(tmp_path: Path) -> Path:
    (tmp_path / "package-lock.json").write_text('{"lockfileVersion": 3}')
    (tmp_path / "fake_npm_ci.py").write_text(FAKE_NPM_CI)
    return tmp_path


def test_two_processes_install_once_and_both_see_a_complete_install(tmp_path):
    folder = _package(tmp_path)
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(folder)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [worker.communicate(timeout=60) for worker in workers]
    for worker, (out, err) in zip(workers, outputs, strict=True):
        assert worker.returncode == 0, err
        assert out.strip() == "True"
    assert (folder / "runs.txt").read_text().splitlines() == ["run"]
    # a later call finds the stamp and runs nothing
    assert install_once(folder, [sys.executable, str(folder / "fake_npm_ci.py")]) is False
    assert (folder / "runs.txt").read_text().splitlines() == ["run"]


def test_a_changed_lock_file_installs_again(tmp_path):
    folder = _package(tmp_path)
    command = [sys.executable, str(folder / "fake_npm_ci.py")]
    assert install_once(folder, command) is True
    (folder / "package-lock.json").write_text('{"lockfileVersion": 3, "packages": {}}')
    assert install_once(folder, command) is True
    assert (folder / "runs.txt").read_text().splitlines() == ["run", "run"]


def test_a_failed_install_raises_with_its_output_and_leaves_no_stamp(tmp_path):
    folder = _package(tmp_path)
    failing = [sys.executable, "-c", "import sys; sys.exit('npm ERR! 404 Not Found')"]
    with pytest.raises(NodeInstallError, match=r"(?s)failed in .*exit 1.*npm ERR! 404 Not Found"):
        install_once(folder, failing)
    assert not (folder / "node_modules").exists()
