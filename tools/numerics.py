"""Run onnxgrad's numerical tests on this machine and record the machine beside the results.

Float32 gradients depend on the order in which the kernels sum: vector width (AVX2, AVX-512, AMX),
thread count and the versions of onnxruntime and numpy. A result from another machine can be
compared with ours only with those written next to it. This script runs the tests that measure
accuracy (gradients against float64 and torch, rounding bounds) and writes one JSON file:

- ``machine``: CPU model, the vector extensions among its flags, logical CPUs, the CPUs this
  process may use, and the thread settings in the environment;
- ``versions``: python, numpy, onnx, onnxruntime, torch, and onnxgrad's supported range;
- ``tests``: each test's id, outcome, duration and, where it did not pass, the message;
- ``summary``: counts by outcome.

It runs from a checkout, without installing the project (``src`` is put on the path when
``onnxgrad`` is not importable). With a torch outside onnxgrad's supported range, the tests that
use torch (:func:`uses_torch`) are skipped with the reason (the range check's own message), so that the rest
still run; without torch, those modules skip themselves.

Usage (from the repository root): ``python tools/numerics.py --out out/numerics.json`` (also
``make test-numerics``). Extra arguments after ``--`` go to pytest. Exit status: pytest's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

#: The numerical tests: accuracy against float64 and torch, and the rounding bounds of the
#: float32 computations that depend on the CPU's summation order.
NUMERIC_TESTS = [
    "tests/torch/test_batchnorm_accuracy.py",
    "tests/autodiff/test_rewrite.py",
    "tests/zoo/test_blocks.py::test_gradients_match_torch",
]

#: /proc/cpuinfo flags that change which kernels onnxruntime, numpy and torch run.
VECTOR_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx_vnni",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",  # arm64 (NEON)
    "sve",
)

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "PYTEST_XDIST_WORKER_COUNT")


def cpu_info() -> dict[str, Any]:
    """The CPU model and its vector extensions: from /proc/cpuinfo on Linux, else ``platform``."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "hardware", "cpu model") and value.strip():
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "model": model,
        "architecture": platform.machine(),
        "vector_extensions": [f for f in VECTOR_FLAGS if f in flags],
        "logical_cpus": os.cpu_count(),
        "usable_cpus": affinity,
        "thread_environment": {v: os.environ[v] for v in THREAD_VARIABLES if v in os.environ},
        "system": platform.platform(),
    }


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # not installed, or fails to import: recorded as absent
        return None


def versions() -> dict[str, Any]:
    """Versions of python and the libraries that compute, and the range onnxgrad supports."""
    from onnxgrad import deps

    out: dict[str, Any] = {"python": platform.python_version()}
    for name in ("numpy", "onnx", "onnxruntime", "torch", "onnxgrad"):
        out[name] = _version(name)
    out["supported_minimum"] = dict(deps.SUPPORTED)
    out["torch_outside_range"] = torch_problem()
    return out


def torch_problem() -> str | None:
    """Why torch-dependent tests cannot count here (outside the supported range), else None.
    An absent torch is not a problem of this kind: those modules skip themselves."""
    if _version("torch") is None:
        return None
    from onnxgrad import deps

    try:
        deps.require_torch()
    except deps.DependencyError as exc:
        return str(exc)
    return None


def _is_torch(value: Any) -> bool:
    name = getattr(value, "__module__", None) or getattr(value, "__name__", "")
    return isinstance(name, str) and (name == "torch" or name.startswith("torch."))


def uses_torch(function: Any, depth: int = 4, seen: set[int] | None = None) -> bool:
    """Whether ``function`` reads torch: a global name it (or a function it calls, ``depth``
    levels down, or a fixture it takes) reads is torch or one of its objects. A test module that
    imports torch for some tests keeps its other tests running."""
    seen = set() if seen is None else seen
    code = getattr(function, "__code__", None)
    if code is None or id(code) in seen or depth < 0:
        return False
    seen.add(id(code))
    names: set[str] = set()
    stack = [code]
    while stack:  # nested functions and comprehensions: their code objects are constants
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(k for k in c.co_consts if hasattr(k, "co_names"))
    scope = getattr(function, "__globals__", {})
    for name in names:
        value = scope.get(name)
        if value is None:
            continue
        if _is_torch(value):
            return True
        if callable(value) and uses_torch(value, depth - 1, seen):
            return True
    return False


class Recorder:
    """A pytest plugin: skips torch-dependent tests when torch is outside the range, and records
    every test's outcome."""

    def __init__(self, torch_reason: str | None) -> None:
        self.torch_reason = torch_reason
        self.results: dict[str, dict[str, Any]] = {}

    def pytest_collection_modifyitems(self, items: list) -> None:
        if self.torch_reason is None:
            return
        import pytest

        for item in items:
            function = getattr(item, "function", None)
            if function is not None and uses_torch(function):
                item.add_marker(
                    pytest.mark.skip(reason=f"torch outside the supported range: {self.torch_reason}")
                )

    def pytest_runtest_logreport(self, report: Any) -> None:
        entry = self.results.setdefault(
            report.nodeid, {"test": report.nodeid, "outcome": "passed", "duration_s": 0.0}
        )
        entry["duration_s"] = round(entry["duration_s"] + report.duration, 3)
        if report.skipped:
            entry["outcome"] = "skipped"
            longrepr = report.longrepr
            entry["message"] = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        elif report.failed:
            entry["outcome"] = "failed" if report.when == "call" else "error"
            crash = getattr(report.longrepr, "reprcrash", None)
            entry["message"] = crash.message if crash is not None else str(report.longrepr)[-2000:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="out/numerics.json", help="the JSON file to write")
    parser.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments")
    args = parser.parse_args(argv)
    os.chdir(ROOT)
    for path in (ROOT, ROOT / "src"):  # tests import tests.*; onnxgrad from the checkout
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    import pytest

    import onnxgrad

    recorder = Recorder(torch_problem())
    started = time.time()
    # -p no:xdist: one process, so the thread counts recorded are those the tests ran with
    code = pytest.main(
        ["-q", "-p", "no:xdist", "-p", "no:cacheprovider", *NUMERIC_TESTS, *args.pytest_args],
        plugins=[recorder],
    )
    tests = sorted(recorder.results.values(), key=lambda r: r["test"])
    summary: dict[str, int] = {}
    for r in tests:
        summary[r["outcome"]] = summary.get(r["outcome"], 0) + 1
    record = {
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "wall_s": round(time.time() - started, 1),
        "onnxgrad_path": str(Path(onnxgrad.__file__).parent),
        "machine": cpu_info(),
        "versions": versions(),
        "pytest_exit_status": int(code),
        "summary": summary,
        "tests": tests,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    cpu = record["machine"]
    print(
        f"{cpu['model']} ({', '.join(cpu['vector_extensions']) or 'no vector flags read'}), "
        f"{cpu['usable_cpus']} CPUs: {summary} -> {out}"
    )
    return int(code)


if __name__ == "__main__":
    raise SystemExit(main())
