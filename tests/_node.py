"""The Node tools the JavaScript tests need: node and npm, with js/'s dependencies installed once.

pytest-xdist runs the JavaScript tests in several workers at once. Each of them may find js/'s
``node_modules`` missing, and two ``npm ci`` runs in one folder leave a half-installed package behind
(one removes what the other is writing). So the install runs under an exclusive lock on a file beside
``node_modules``, and counts as done only once a stamp written after a successful ``npm ci`` holds the
hash of ``package-lock.json``: a worker that waited for the lock finds the stamp and installs nothing.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

try:
    import fcntl
except ImportError:  # Windows: the tests run there in one process (no pytest-xdist in CI)
    fcntl = None  # type: ignore[assignment]

JS = Path(__file__).resolve().parents[1] / "js"

#: written into node_modules after a successful install; ``npm ci`` removes node_modules first, so a
#: stamp never outlives the install it describes
STAMP = ".onnxgrad-installed"


class NodeInstallError(RuntimeError):
    """``npm ci`` failed: the message holds the end of its output."""


def _lock_digest(folder: Path) -> str:
    """What a complete install of ``folder`` was made from: the hash of its package-lock.json."""
    lock = folder / "package-lock.json"
    return hashlib.sha256(lock.read_bytes() if lock.exists() else b"").hexdigest()


def _installed(folder: Path, digest: str) -> bool:
    stamp = folder / "node_modules" / STAMP
    return stamp.is_file() and stamp.read_text() == digest


def install_once(folder: Path, command: Sequence[str], timeout: float = 600) -> bool:
    """Run ``command`` (``npm ci``) in ``folder`` unless a complete install of the current
    package-lock.json is already there; safe to call from several processes at once (the first one
    installs, the others wait for it and then find the stamp). Returns whether this call installed.
    Raises :class:`NodeInstallError` with the command's output when it fails."""
    digest = _lock_digest(folder)
    if _installed(folder, digest):
        return False
    with open(folder / ".npm-install.lock", "w") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if _installed(folder, digest):  # another process installed while this one waited
                return False
            done = subprocess.run(list(command), cwd=folder, capture_output=True, text=True, timeout=timeout)
            if done.returncode != 0:
                raise NodeInstallError(
                    f"{' '.join(command)} failed in {folder} (exit {done.returncode}):\n"
                    f"{done.stdout[-1000:]}\n{done.stderr[-2000:]}"
                )
            (folder / "node_modules").mkdir(exist_ok=True)
            (folder / "node_modules" / STAMP).write_text(digest)
            return True
        finally:
            if fcntl is not None:
                fcntl.flock(lock, fcntl.LOCK_UN)


def node_with_js_dependencies() -> str:
    """The path of ``node``, once js/'s dependencies are installed. Skips the test only when node or
    npm is missing; a failed ``npm ci`` (offline, say) fails the test with npm's error."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("node and npm are needed for the JavaScript tests")
    try:
        install_once(JS, [npm, "ci", "--no-audit", "--no-fund"])
    except NodeInstallError as error:
        pytest.fail(str(error), pytrace=False)
    return node
