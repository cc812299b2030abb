"""Timing a training step of any model, and where the time goes (``onnxgrad bench``).

The step is forward + backward with an output gradient of ones; times are medians over steps
after a warm-up. The per-op breakdown comes from onnxruntime's own profiler, run on separate
sessions so that profiling does not slow the timed ones.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from ..autodiff.engine import build_gradient
from ..autodiff.graph import load_model, np_dtype
from .session import ForwardBackward, default_options


@dataclass
class StepProfile:
    """Median times (ms) of one training step and the per-op-type totals (ms per step)."""

    forward_ms: float
    backward_ms: float
    total_ms: float
    build_s: float
    ops: dict[str, dict[str, float]] = field(default_factory=dict)  # graph -> op type -> ms

    def report(self) -> str:
        lines = [
            f"gradient graphs built in {self.build_s:.2f} s",
            f"forward  {self.forward_ms:9.3f} ms",
            f"backward {self.backward_ms:9.3f} ms",
            f"step     {self.total_ms:9.3f} ms (median)",
        ]
        for graph, ops in self.ops.items():
            total = sum(ops.values()) or 1.0
            lines.append(f"\n{graph} graph, time per op type (onnxruntime profiler):")
            for op, ms in sorted(ops.items(), key=lambda kv: -kv[1])[:15]:
                lines.append(f"  {op:28s} {ms:9.3f} ms  {100 * ms / total:5.1f} %")
        return "\n".join(lines)


def random_feeds(
    model: onnx.ModelProto, batch: int = 1, seed: int = 0, shapes: Mapping[str, tuple[int, ...]] | None = None
) -> dict[str, np.ndarray]:
    """Random inputs for ``model``: symbolic dims become ``batch`` (or take ``shapes``)."""
    rng = np.random.default_rng(seed)
    inits = {i.name for i in model.graph.initializer}
    feeds = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        if shapes and vi.name in shapes:
            shape = tuple(shapes[vi.name])
        else:
            shape = tuple(d.dim_value if d.HasField("dim_value") else batch for d in tt.shape.dim)
        dtype = np_dtype(tt.elem_type)
        if dtype.kind == "f":
            feeds[vi.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind in "iu":
            feeds[vi.name] = rng.integers(0, 2, size=shape).astype(dtype)
        else:
            feeds[vi.name] = rng.integers(0, 2, size=shape).astype(dtype)
    return feeds


def profile_step(
    model: onnx.ModelProto | str | os.PathLike | bytes,
    feeds: Mapping[str, np.ndarray] | None = None,
    *,
    batch: int = 1,
    steps: int = 20,
    warmup: int = 3,
    threads: int | None = None,
    by_op: bool = True,
) -> StepProfile:
    """Time the training step of ``model`` and break it down by op type."""
    proto = load_model(model)
    feeds = dict(feeds) if feeds is not None else random_feeds(proto, batch)
    t0 = time.perf_counter()
    graphs = build_gradient(proto)
    build_s = time.perf_counter() - t0
    fb = ForwardBackward(graphs, session_options=_options(threads))
    fwd_ms, bwd_ms = [], []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        res = fb.forward(feeds)
        t1 = time.perf_counter()
        res.backward()
        t2 = time.perf_counter()
        if i >= warmup:
            fwd_ms.append((t1 - t0) * 1e3)
            bwd_ms.append((t2 - t1) * 1e3)
    totals = [f + b for f, b in zip(fwd_ms, bwd_ms)]
    prof = StepProfile(
        statistics.median(fwd_ms), statistics.median(bwd_ms), statistics.median(totals), build_s
    )
    if by_op:
        prof.ops = _per_op(graphs, feeds, threads, max(3, steps // 2))
    return prof


def _options(threads: int | None, profile_prefix: str | None = None) -> ort.SessionOptions:
    opts = default_options()  # the options a step runs with, so the profile shows the real step
    if threads:
        opts.intra_op_num_threads = threads
    if profile_prefix:
        opts.enable_profiling = True
        opts.profile_file_prefix = profile_prefix
    opts.log_severity_level = 3
    return opts


def _per_op(graphs: Any, feeds: Mapping[str, np.ndarray], threads: int | None, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        fb = ForwardBackward(graphs, session_options=_options(threads, os.path.join(tmp, "prof")))
        for _ in range(steps):
            fb.forward(feeds).backward()
        runner = fb._runner
        files = {"forward": runner.fwd.end_profiling(), "backward": runner.backward_session().end_profiling()}
        return {name: _op_times(path, steps) for name, path in files.items()}


def _op_times(path: str, steps: int) -> dict[str, float]:
    with open(path) as f:
        events = json.load(f)
    per_op: dict[str, float] = defaultdict(float)
    for ev in events:
        if ev.get("cat") == "Node" and ev.get("name", "").endswith("_kernel_time"):
            per_op[ev["args"].get("op_name", "?")] += ev["dur"] / 1e3 / steps
    return dict(per_op)
