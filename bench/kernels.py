"""Where the anchor models' training step goes: onnxruntime's dense kernels against the rest, and
the speed of the same matrix products in onnxruntime and in PyTorch.

For each anchor model, onnxgrad's step is profiled (onnxruntime's profiler, per op type) and split
into the dense kernels (Gemm, MatMul, Conv, ConvTranspose, MaxPool and their fused forms) and all
other ops; PyTorch eager's whole step is timed in the same process. When the dense kernels alone
take longer than 0.9x PyTorch's step, no graph change reaches the target: only faster kernels do.
The second table times the products of the transformer and MLP steps alone (onnxruntime ``Gemm``
against ``torch.mm``, 2 threads each).

    python bench/kernels.py [--models mlp cnn transformer] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import anchors
from onnxgrad.runtime.profile import profile_step
from onnxgrad.runtime.runner import default_options

THREADS = 2
DENSE = {"Gemm", "FusedGemm", "MatMul", "FusedMatMul", "Conv", "FusedConv", "ConvTranspose", "MaxPool"}
# (M, K, N) of C = A B: the weight gradients (K = rows of the batch) and input gradients of the
# transformer (2048 rows) and of the MLP (256 rows)
SHAPES = [
    (1024, 2048, 256),
    (256, 2048, 1024),
    (256, 2048, 256),
    (2048, 1024, 256),
    (512, 256, 784),
    (256, 512, 784),
]


def median_ms(fn: Callable[[], object], steps: int = 30, warmup: int = 5) -> float:
    """Median wall time of ``fn`` in milliseconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def split_step(name: str) -> dict[str, float]:
    """onnxgrad's step of anchor ``name``: dense kernels, other kernels, total; torch's step."""
    module, x = anchors.build(name), anchors.example_input(name)
    model = anchors.export(module, x[:1])
    prof = profile_step(model, {"input": x.numpy()}, threads=THREADS, steps=20)
    # The profiled run is slower than the timed one (per-node overhead): split the timed step
    # in the profile's proportions.
    dense = sum(ms for ops in prof.ops.values() for op, ms in ops.items() if op in DENSE)
    other = sum(ms for ops in prof.ops.values() for op, ms in ops.items() if op not in DENSE)
    dense, other = (prof.total_ms * v / (dense + other) for v in (dense, other))
    ones = torch.ones_like(module(x))

    def torch_step() -> None:
        module.zero_grad(set_to_none=True)
        module(x).backward(ones)

    return {"dense_ms": dense, "other_ms": other, "step_ms": prof.total_ms, "torch_ms": median_ms(torch_step)}


def gemm_rates(shape: tuple[int, int, int]) -> dict[str, float]:
    """GFLOP/s of one float32 product of ``shape`` in onnxruntime (Gemm) and in torch (mm)."""
    m, k, n = shape
    a = np.random.default_rng(0).standard_normal((m, k)).astype(np.float32)
    b = np.random.default_rng(1).standard_normal((k, n)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["a", "b"], ["c"])],
        "gemm",
        [helper.make_tensor_value_info(v, TensorProto.FLOAT, s) for v, s in (("a", [m, k]), ("b", [k, n]))],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, [m, n])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    opts = default_options()
    opts.intra_op_num_threads = THREADS
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    flop = 2 * m * k * n / 1e6  # MFLOP: / ms = GFLOP/s
    return {
        "onnxruntime": flop / median_ms(lambda: sess.run(None, {"a": a, "b": b}), 50),
        "torch": flop / median_ms(lambda: torch.mm(ta, tb), 50),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn", "transformer"])
    parser.add_argument("--json", help="write every figure to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(THREADS)
    steps = {}
    print(f"{'model':12s} {'dense':>8s} {'other':>8s} {'step':>8s} {'torch':>8s} {'dense/torch':>12s}")
    for name in args.models:
        s = steps[name] = split_step(name)
        print(
            f"{name:12s} {s['dense_ms']:8.2f} {s['other_ms']:8.2f} {s['step_ms']:8.2f} {s['torch_ms']:8.2f} "
            f"{s['dense_ms'] / s['torch_ms']:12.2f}"
        )
    print(f"\n{'M x K x N':>18s} {'onnxruntime GF/s':>17s} {'torch GF/s':>11s}")
    rates = {}
    for shape in SHAPES:
        r = rates["x".join(map(str, shape))] = gemm_rates(shape)
        print(f"{'x'.join(map(str, shape)):>18s} {r['onnxruntime']:17.0f} {r['torch']:11.0f}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"threads": THREADS, "steps": steps, "gemm_gflops": rates}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
