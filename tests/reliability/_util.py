"""Helpers of the reliability tests: broken models, isolated subprocesses, resident memory."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from tests.models import make_model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---- models with one defect each -----------------------------------------------------------------
def cyclic_model() -> onnx.ModelProto:
    """a = x + b; b = a * W: the two nodes read each other's output."""
    nodes = [
        helper.make_node("Add", ["x", "b"], ["a"], name="add"),
        helper.make_node("Mul", ["a", "W"], ["b"], name="mul"),
    ]
    return make_model(nodes, [("x", np.float64, [2])], [("b", np.float64, [2])], {"W": np.ones(2)})


def missing_value_model() -> onnx.ModelProto:
    """y = (x * W) + nowhere, where nothing defines ``nowhere``."""
    nodes = [
        helper.make_node("Mul", ["x", "W"], ["a"], name="mul"),
        helper.make_node("Add", ["a", "nowhere"], ["y"], name="add"),
    ]
    return make_model(nodes, [("x", np.float64, [2])], [("y", np.float64, [2])], {"W": np.ones(2)})


def shapes_model() -> onnx.ModelProto:
    """Reshape, Transpose, Unsqueeze, Concat, Slice, ReduceMean, Gather, Softmax: integer constants
    everywhere, for flips to turn into absurd shapes and axes."""
    i64 = np.int64
    nodes = [
        helper.make_node("Reshape", ["x", "shape"], ["r"]),
        helper.make_node("Transpose", ["r"], ["t"], perm=[0, 2, 1]),
        helper.make_node("Add", ["t", "bias"], ["s"]),
        helper.make_node("Unsqueeze", ["s", "axis1"], ["u"]),
        helper.make_node("Concat", ["u", "u"], ["c"], axis=1),
        helper.make_node("Slice", ["c", "start", "end", "axis1"], ["sl"]),
        helper.make_node("ReduceMean", ["sl", "axes"], ["m"], keepdims=0),
        helper.make_node("Gather", ["m", "idx"], ["g"], axis=1),
        helper.make_node("Mul", ["g", "w"], ["z"]),
        helper.make_node("Softmax", ["z"], ["y"], axis=-1),
    ]
    inits = {
        "shape": np.array([-1, 2, 3], i64), "bias": np.linspace(-1, 1, 2).astype(np.float32),
        "axis1": np.array([1], i64), "start": np.array([0], i64), "end": np.array([1], i64),
        "axes": np.array([1, 3], i64), "idx": np.array([2, 0], i64), "w": np.ones(2, np.float32),
    }  # fmt: skip
    return make_model(nodes, [("x", np.float32, ["N", 6])], [("y", np.float32, ["N", 2])], inits)


def conv_model() -> onnx.ModelProto:
    """Conv, Relu, MaxPool, Flatten, Gemm on images of 5 x 5."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Conv", ["x", "W", "B"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["p"], ["f"]),
        helper.make_node("Gemm", ["f", "Wf"], ["y"]),
    ]
    inits = {
        "W": rng.standard_normal((2, 1, 3, 3)).astype(np.float32),
        "B": np.zeros(2, np.float32),
        "Wf": rng.standard_normal((8, 3)).astype(np.float32),
    }
    return make_model(nodes, [("x", np.float32, ["N", 1, 5, 5])], [("y", np.float32, ["N", 3])], inits)


# ---- subprocesses ------------------------------------------------------------------------------------
@dataclass
class Isolated:
    """How a child process ended."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool

    @property
    def crashed(self) -> bool:
        """Killed by a signal (segfault, abort, the OOM killer)."""
        return self.returncode < 0


def limit_memory(max_bytes: int) -> None:
    """Cap this process's address space: a huge allocation then fails instead of exhausting the
    machine (which would call the OOM killer on whatever runs next to it)."""
    resource.setrlimit(resource.RLIMIT_AS, (max_bytes, max_bytes))


def run_isolated(code: str, *, timeout: float, max_bytes: int | None = None) -> Isolated:
    """Run Python ``code`` in a fresh interpreter (repository root on the path), with an address
    space limit when ``max_bytes`` is given, killed after ``timeout`` seconds."""
    prologue = ""  # the child runs in REPO: `tests` is importable
    if max_bytes is not None:
        prologue = f"from tests.reliability._util import limit_memory\nlimit_memory({max_bytes})\n"
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    try:
        proc = subprocess.run(
            [sys.executable, "-c", prologue + textwrap.dedent(code)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=REPO,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
        return Isolated(-9, out, err, timed_out=True)
    return Isolated(proc.returncode, proc.stdout, proc.stderr, timed_out=False)


# ---- memory --------------------------------------------------------------------------------------------
def rss_bytes() -> int:
    """Resident memory of this process now (Linux ``/proc/self/statm``; ``ru_maxrss`` elsewhere,
    which only grows, so a leak still shows)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # pragma: no cover - not Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
