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
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from ..errors import InputError
from ..model.graph import np_dtype, value_info_from_proto
from ..model.load import CheckedModel, load_checked
from .runner import Runner, default_options
from .session import ForwardBackward


@dataclass
class NodeTime:
    """One node of a graph as onnxruntime ran it: its name there, its op type, kernel ms per step,
    and the outputs of the node of onnxgrad's graph it runs (empty when onnxruntime made the node,
    e.g. by fusing several)."""

    name: str
    op_type: str
    ms: float
    outputs: list[str] = field(default_factory=list)


@dataclass
class StepProfile:
    """Median times (ms) of one training step, and where the time goes.

    ``ops``: graph ("forward", "backward") -> op type -> kernel ms per step, slowest first;
    ``nodes``: graph -> nodes, slowest first. Both come from onnxruntime's profiler on separate,
    profiled sessions and hold kernel time only: they say how a graph's time splits, not how long
    the timed step took.
    Names and op types are those of the graphs onnxruntime runs after its optimizations (a Gemm
    followed by a Relu runs as one ``FusedGemm`` node named ``fused ...``).
    """

    forward_ms: float
    backward_ms: float
    total_ms: float
    build_s: float  # gradient graphs built and forward session made (ForwardBackward's constructor)
    ops: dict[str, dict[str, float]] = field(default_factory=dict)
    nodes: dict[str, list[NodeTime]] = field(default_factory=dict)
    inputs: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> dtype and shape fed
    trainable: dict[str, int] = field(default_factory=dict)  # parameter -> number of values
    steps: int = 0
    warmup: int = 0
    threads: int | None = None  # intra-op threads; None: onnxruntime's default
    profiled_steps: int = 0
    forward_samples_ms: list[float] = field(default_factory=list)
    backward_samples_ms: list[float] = field(default_factory=list)

    def report(self, top_ops: int = 15, top_nodes: int = 10) -> str:
        """The times, then per graph the ``top_ops`` op types and the ``top_nodes`` slowest
        nodes of the backward, as text."""
        lines = [
            f"gradient graphs built (and forward session made) in {self.build_s:.2f} s",
            f"forward  {self.forward_ms:9.3f} ms",
            f"backward {self.backward_ms:9.3f} ms",
            f"step     {self.total_ms:9.3f} ms (median of {self.steps} steps after {self.warmup} warm-up)",
        ]
        for graph, ops in self.ops.items():
            lines += ["", *self._op_lines(graph, ops, top_ops)]
        if self.nodes.get("backward"):
            lines += ["", *self._node_lines("backward", top_nodes)]
        return "\n".join(lines)

    def _op_lines(self, graph: str, ops: dict[str, float], top: int) -> list[str]:
        total = sum(ops.values())
        lines = [
            f"{graph} graph: {total:.3f} ms of kernels per step "
            f"(onnxruntime profiler, {self.profiled_steps} steps), by op type:"
        ]
        for op, ms in sorted(ops.items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"  {op:28s} {ms:9.3f} ms  {100 * ms / (total or 1.0):5.1f} %")
        if len(ops) > top:
            lines.append(f"  ... and {len(ops) - top} more op types")
        return lines

    def _node_lines(self, graph: str, top: int) -> list[str]:
        nodes = self.nodes[graph]
        total = sum(n.ms for n in nodes) or 1.0
        width = min(48, max(len(n.name) for n in nodes[:top]))
        lines = [f"{graph} graph, slowest nodes:"]
        for n in nodes[:top]:
            outputs = f"  -> {', '.join(n.outputs)}" if n.outputs else ""
            lines.append(
                f"  {n.name:{width}s}  {n.op_type:20s} {n.ms:9.3f} ms  {100 * n.ms / total:5.1f} %{outputs}"
            )
        return lines

    def to_dict(self) -> dict[str, Any]:
        """Every figure as plain JSON-ready values."""
        return asdict(self)


def random_feeds(
    model: onnx.ModelProto, batch: int = 1, seed: int = 0, shapes: Mapping[str, tuple[int, ...]] | None = None
) -> dict[str, np.ndarray]:
    """Random values for the inputs of ``model``, to time or check it without data.

    Floats are standard normal, booleans random, integers 0 or 1 (valid indices for any axis of
    size 2 or more, and valid class labels). Symbolic or unnamed dimensions become ``batch``
    unless ``shapes`` (input name -> shape) gives the input's whole shape. :class:`InputError` for
    a name of ``shapes`` that is not an input, an input that is not a tensor, or one whose rank
    neither the model nor ``shapes`` gives.
    """
    shapes = shapes or {}
    rng = np.random.default_rng(seed)
    inits = {i.name for i in model.graph.initializer}
    inputs = {i.name: value_info_from_proto(i) for i in model.graph.input if i.name not in inits}
    unknown = [n for n in shapes if n not in inputs]
    if unknown:
        raise InputError(f"shapes given for {unknown}, which are not inputs of the model ({list(inputs)})")
    feeds = {}
    for name, info in inputs.items():
        if info is None or info.sequence:
            raise InputError(f"input {name!r} is not a tensor: onnxgrad makes random tensors only")
        if name in shapes:
            shape = tuple(shapes[name])
        elif info.shape is None:
            raise InputError(
                f"input {name!r} has no shape in the model: give one "
                f"(shapes={{{name!r}: DIMS}}, or --shape {name}=DIMS on the command line)"
            )
        else:
            shape = tuple(d if isinstance(d, int) else batch for d in info.shape)
        dtype = np_dtype(info.dtype)
        if dtype.kind == "f":
            feeds[name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind == "b":
            feeds[name] = rng.random(shape) < 0.5
        else:
            feeds[name] = rng.integers(0, 2, size=shape).astype(dtype)
    return feeds


def profile_step(
    model: CheckedModel | onnx.ModelProto | str | os.PathLike | bytes,
    feeds: Mapping[str, np.ndarray] | None = None,
    *,
    batch: int = 1,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
    steps: int = 20,
    warmup: int = 3,
    threads: int | None = None,
    by_op: bool = True,
) -> StepProfile:
    """Time the training step of ``model`` (forward + backward, output gradient of ones, gradients
    of every trainable initializer) and break it down by op type and node.

    ``feeds``: the inputs (default: :func:`random_feeds` with ``batch`` and ``shapes``);
    ``threads``: intra-op threads (default: onnxruntime's). Dropout and BatchNormalization run in
    training mode, as in :class:`ForwardBackward`.
    """
    if steps < 1 or warmup < 0:
        raise InputError(f"steps must be >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    if threads is not None and threads < 1:
        raise InputError(f"threads must be >= 1 (or None for onnxruntime's default), got {threads}")
    checked = load_checked(model)
    proto = checked.proto
    feeds = dict(feeds) if feeds is not None else random_feeds(proto, batch, shapes=shapes)
    t0 = time.perf_counter()
    fb = ForwardBackward(checked, session_options=_options(threads))
    build_s = time.perf_counter() - t0
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
    prof = StepProfile(
        statistics.median(fwd_ms),
        statistics.median(bwd_ms),
        statistics.median([f + b for f, b in zip(fwd_ms, bwd_ms)]),
        build_s,
        inputs={k: {"dtype": str(v.dtype), "shape": list(v.shape)} for k, v in feeds.items()},
        trainable={k: int(v.size) for k, v in fb.parameters.items()},
        steps=steps,
        warmup=warmup,
        threads=threads,
        forward_samples_ms=fwd_ms,
        backward_samples_ms=bwd_ms,
    )
    if by_op:
        # Graphs without Dropout/BatchNormalization are reused as built; the others are rebuilt
        # from the model so that they run in training mode again.
        source = proto if fb.follows_training else fb.graphs
        prof.profiled_steps = max(3, steps // 2)
        prof.ops, prof.nodes = _profiled(source, feeds, threads, prof.profiled_steps)
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


def _profiled(
    source: Any, feeds: Mapping[str, np.ndarray], threads: int | None, steps: int
) -> tuple[dict[str, dict[str, float]], dict[str, list[NodeTime]]]:
    """Per graph: kernel ms per step by op type, and by node (slowest first)."""
    with tempfile.TemporaryDirectory() as tmp:
        options = _options(threads, os.path.join(tmp, "forward"))
        fb = ForwardBackward(source, session_options=options)
        runner = fb._runner
        if not isinstance(runner, Runner):  # PythonOp graphs run as several sessions per graph
            return {}, {}
        # A session copies its options when made: the backward session, made now with another
        # prefix, writes its own file (profile names differ only by a millisecond time stamp).
        options.profile_file_prefix = os.path.join(tmp, "backward")
        runner.backward_session()
        for _ in range(1 + steps):  # the first step is a warm-up, left out in _node_times
            fb.forward(feeds).backward()
        files = {"forward": runner.fwd.end_profiling(), "backward": runner.backward_session().end_profiling()}
        models = {"forward": runner.graphs.forward, "backward": runner.graphs.backward}
        nodes = {graph: _node_times(path, models[graph]) for graph, path in files.items()}
    ops: dict[str, dict[str, float]] = {}
    for graph, times in nodes.items():
        per_op: dict[str, float] = defaultdict(float)
        for n in times:
            per_op[n.op_type] += n.ms
        ops[graph] = dict(sorted(per_op.items(), key=lambda kv: -kv[1]))
    return ops, nodes


def _node_times(path: str, model: onnx.ModelProto) -> list[NodeTime]:
    """Kernel ms per run of each node in an onnxruntime profile of ``model``, the first run left
    out (it allocates and is several times slower), slowest first."""
    with open(path) as f:
        events = json.load(f)
    runs = sorted((ev["ts"], ev["ts"] + ev["dur"]) for ev in events if ev.get("name") == "model_run")
    if len(runs) < 2:
        return []
    first_end = runs[0][1]
    total: dict[str, float] = defaultdict(float)
    op_type: dict[str, str] = {}
    for ev in events:
        name = ev.get("name", "")
        if ev.get("cat") == "Node" and name.endswith("_kernel_time") and ev["ts"] >= first_end:
            node = name.removesuffix("_kernel_time")
            total[node] += ev["dur"] / 1e3  # µs -> ms
            op_type[node] = ev.get("args", {}).get("op_name", "?")
    per_run = len(runs) - 1
    # onnxruntime names a node without a name "<op type>_<index>"; its fusions ("fused <name>")
    # run no node of ours alone and are left without outputs
    by_name = {n.name or f"{n.op_type}_{i}": n for i, n in enumerate(model.graph.node)}
    times = []
    for node, ms in total.items():
        proto = by_name.get(node)
        outputs = list(proto.output) if proto is not None and proto.op_type == op_type[node] else []
        times.append(NodeTime(node, op_type[node], ms / per_run, [o for o in outputs if o]))
    return sorted(times, key=lambda n: -n.ms)
