"""Child process of the corruption fuzzer: runs onnxgrad on model bytes it is sent, one at a time.

A crash (segfault, abort) or a hang here must not take the test session with it: the parent
(:class:`Worker`) sends one model, waits for the answer with a timeout, and restarts the child when
it died or stopped answering. Requests and answers are length-prefixed pickles on stdin / stdout.
The child caps its own address space, so a huge allocation fails instead of exhausting the machine.
"""

from __future__ import annotations

import os
import pickle
import select
import struct
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, BinaryIO

MEMORY_LIMIT = 3 << 30


@dataclass
class Outcome:
    """What one model did: ``ok`` (it trained), ``onnxgrad`` (an OnnxGradError: the expected
    refusal), ``other`` (any other exception), ``crash`` (the child died) or ``hang`` (no answer)."""

    kind: str
    error: str = ""
    detail: str = ""


def _send(stream: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _receive(stream: BinaryIO) -> Any:
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError
    (size,) = struct.unpack("<Q", head)
    return pickle.loads(stream.read(size))


def train_once(data: bytes, feeds: dict[str, Any], validate: bool) -> None:
    """What a user does with a model file: build the graphs, one forward and one backward; with
    ``validate``, after reading the file with :func:`onnxgrad.model.load_untrusted`."""
    import onnxgrad
    from onnxgrad.model.validate import load_untrusted

    fb = onnxgrad.ForwardBackward(load_untrusted(data) if validate else data)
    result = fb.forward(feeds)
    result.backward()


def main() -> None:  # the child
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    import onnxgrad  # noqa: F401  # imported once, before the first request
    from onnxgrad.errors import OnnxGradError

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # anything printed by the libraries must not corrupt the protocol
    _send(stdout, "ready")
    while True:
        try:
            request = _receive(stdin)
        except EOFError:
            return
        try:
            train_once(*request)
            outcome = Outcome("ok")
        except OnnxGradError as exc:
            outcome = Outcome("onnxgrad", type(exc).__name__, str(exc)[:500])
        except BaseException as exc:
            outcome = Outcome("other", type(exc).__name__, traceback.format_exc()[-3000:])
        _send(stdout, vars(outcome))  # a dict: the parent does not know this module as __main__


class Worker:
    """The parent's handle on one child; restarts it after a crash or a hang."""

    def __init__(self, cwd: str, timeout: float) -> None:
        self.cwd, self.timeout = cwd, timeout
        self.proc: subprocess.Popen | None = None

    def _start(self) -> None:
        path = os.pathsep.join(p for p in (self.cwd, os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.reliability._corruption_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            cwd=self.cwd,
            env=env,
        )
        ready = self._read(timeout=max(self.timeout, 120.0))  # imports take long on a busy machine
        if ready != "ready":
            raise RuntimeError(f"the fuzzing worker did not start: {ready}")

    def _read(self, timeout: float) -> Any:
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0.01))
            if ready:
                try:
                    answer = _receive(self.proc.stdout)
                    return Outcome(**answer) if isinstance(answer, dict) else answer
                except EOFError:
                    code = self.proc.wait()
                    return Outcome("crash", f"exit code {code}", _signal_name(code))
        return Outcome("hang", f"no answer in {timeout:.0f} s")

    def run(self, data: bytes, feeds: dict[str, Any], validate: bool = False) -> Outcome:
        """The outcome of :func:`train_once` in the child."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        assert self.proc is not None and self.proc.stdin is not None
        try:
            _send(self.proc.stdin, (data, feeds, validate))
        except BrokenPipeError:
            self.close()
            return Outcome("crash", "the worker died before reading the model")
        outcome = self._read(self.timeout)
        if outcome.kind in ("crash", "hang"):
            self.close()
        return outcome

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            self.proc = None


def _signal_name(code: int) -> str:
    if code >= 0:
        return ""
    import signal

    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


if __name__ == "__main__":
    main()
