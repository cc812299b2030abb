"""Per-call overhead of a PythonOp: ``python -m onnxgrad.pythonop.bench [--sizes 16 1048576]``.

The graph is ``Relu -> X -> Relu`` where X is either an ``Identity`` (the baseline: one onnxruntime
session) or a PythonOp calling a Function that returns its input (the graph is then cut into two
onnxruntime stages around a Python call). The difference is what a PythonOp costs: the extra
session call, the DLPack crossings, ``Function.apply`` and, in training, the ctx bookkeeping and the
PythonOpGrad backward. Times are the best of ``--repeat`` rounds of ``--number`` calls.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

from ..autodiff.engine import build_gradient
from ..runtime.runner import Runner, make_session
from ..runtime.values import from_numpy, run
from . import gradient  # noqa: F401  (the PythonOp rule)
from .executor import PythonGraph, PythonOpRunner
from .registry import register_function


class Identity(torch.autograd.Function):
    """Returns its input; the gradient passes through."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        return g


def _model(n: int, python: bool) -> onnx.ModelProto:
    if python:
        middle = helper.make_node(
            "PythonOp",
            ["a"],
            ["ctx", "b"],
            domain="com.microsoft",
            func_name=f"{Identity.__module__}.Identity",
            input_convention="d",
            input_tensor_types=[TensorProto.FLOAT],
            input_tensor_ranks=[1],
            input_requires_grads=[1],
            output_tensor_types=[TensorProto.FLOAT],
            output_tensor_ranks=[1],
            output_tensor_requires_grads=[1],
            training_mode=1,
        )
    else:
        middle = helper.make_node("Identity", ["a"], ["b"])
    nodes = [helper.make_node("Relu", ["x"], ["a"]), middle, helper.make_node("Relu", ["b"], ["y"])]
    graph = helper.make_graph(
        nodes,
        "bench",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n])],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 9
    return model


def _time(fn: Callable[[], object], number: int, repeat: int) -> tuple[float, float]:
    """(wall, CPU) seconds per call, each the best of ``repeat`` rounds.

    The CPU time is this thread's (``time.thread_time``): with one onnxruntime and one torch thread
    all the work runs here, and the figure does not count the time other processes hold the cores.
    """
    fn()
    wall, cpu = [], []
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(number):
            fn()
        cpu.append((time.thread_time() - c0) / number)
        wall.append((time.perf_counter() - t0) / number)
    return min(wall), min(cpu)


def measure(n: int, number: int = 200, repeat: int = 7, threads: int = 1) -> dict[str, tuple[float, float]]:
    """(wall, CPU) microseconds per call for a tensor of ``n`` floats."""
    register_function(Identity)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    providers = ["CPUExecutionProvider"]
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    feeds = {"x": from_numpy(x)}
    plain = make_session(_model(n, False), providers, opts)
    partitioned = PythonGraph(_model(n, True), providers, opts)
    graphs = build_gradient(_model(n, True), inputs_requiring_grad=["x"])
    runner = PythonOpRunner(graphs, providers, opts)
    base_graphs = build_gradient(_model(n, False), inputs_requiring_grad=["x"])
    base_runner = Runner(base_graphs, providers, opts)
    ones = np.ones(n, np.float32)  # from_numpy borrows: the arrays must outlive the OrtValues
    dy = {"y": from_numpy(ones)}
    xt = torch.from_numpy(x).requires_grad_()

    def train_step(r: object) -> None:
        _, saved = r.forward(feeds, True)  # type: ignore[attr-defined]
        r.backward(saved, dy)  # type: ignore[attr-defined]

    results = {
        "onnxruntime, Identity (baseline)": _time(lambda: run(plain, feeds, ["y"]), number, repeat),
        "partitioned, PythonOp, inference": _time(
            lambda: partitioned.run(feeds, ["y"], False), number, repeat
        ),
        "Function.apply alone in torch eager": _time(lambda: Identity.apply(xt), number, repeat),
        "training step, Identity (baseline)": _time(lambda: train_step(base_runner), number, repeat),
        "training step, PythonOp + PythonOpGrad": _time(lambda: train_step(runner), number, repeat),
    }
    return {k: (w * 1e6, c * 1e6) for k, (w, c) in results.items()}


_ORTX_OP = "OnnxgradPyIdentity"
_ORTX: list = []  # the onnxruntime-extensions op, registered once per process


def measure_ortx(n: int, number: int = 200, repeat: int = 7, threads: int = 1) -> tuple[float, float] | None:
    """(wall, CPU) µs per call of ``Relu -> PyOp -> Relu`` with onnxruntime-extensions' Python custom
    op (the alternative to partitioning), or None when the package is not installed."""
    try:
        from onnxruntime_extensions import PyCustomOpDef, get_library_path, onnx_op
    except ImportError:
        return None
    if not _ORTX:
        # Registering further ops after a session exists crashed the process in our trials.
        dt = PyCustomOpDef.dt_float
        _ORTX.append(onnx_op(op_type=_ORTX_OP, inputs=[dt], outputs=[dt])(lambda x: x))
    model = _model(n, False)
    model.graph.node[1].op_type = _ORTX_OP
    model.graph.node[1].domain = "ai.onnx.contrib"
    model.opset_import.append(helper.make_opsetid("ai.onnx.contrib", 1))
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.register_custom_ops_library(get_library_path())
    sess = make_session(model, ["CPUExecutionProvider"], opts)
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)  # kept alive: from_numpy borrows
    feeds = {"x": from_numpy(x)}
    wall, cpu = _time(lambda: run(sess, feeds, ["y"]), number, repeat)
    return wall * 1e6, cpu * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 1 << 20])
    parser.add_argument("--number", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print("| floats | what | wall µs per call | CPU µs per call |")
    print("|---:|---|---:|---:|")
    for n in args.sizes:
        number = args.number if n < 100_000 else max(args.number // 10, 5)
        results = measure(n, number, args.repeat, args.threads)
        ortx = measure_ortx(n, number, args.repeat, args.threads)
        if ortx is not None:
            results["onnxruntime-extensions PyOp, inference"] = ortx
        for what, (wall, cpu) in results.items():
            print(f"| {n} | {what} | {wall:.1f} | {cpu:.1f} |")


if __name__ == "__main__":
    main()
