"""Conv weight gradients: the forms onnxruntime can run, against torch's ``conv2d_weight``.

dW[m, c, ky, kx] = sum over n, y, x of dY[n, m, y, x] X[n, c, y + ky, x + kx] (padded X). Stock
onnxruntime has no weight-gradient kernel, so the gradient rule (``autodiff/rules/conv.py``) writes
it with ordinary ops; this script times each way of doing so on the layers of the benchmark models
(the VGG-style model of ``compare_torch.py`` and the anchor CNN), interleaved in one process:

* ``im2col``: X unfolded by a one-hot grouped Conv into patches (N, C K, L), one batched MatMul
  P[n] dY[n]^T, the sum over N as a product by ones(N) (what the rule writes for kernels of at most 9
  positions, or 25 on one channel);
* ``im2col, dY first``: the product as dY[n] P[n]^T, which makes onnxruntime repack the K-fold
  patches rather than dY at every call; ``ReduceSum``: the sum over N as one ``ReduceSum`` (both
  the rule before 2026-11-27);
* ``Conv of X by dY``: one Conv with batch and channels swapped, dY as the kernel (the rule's form
  for other kernels);
* ``slices, one Gemm``: X transposed and padded, K slices stacked, one Gemm with N folded into the
  product's inner dimension.

Usage::

    python bench/conv_weight_grad.py [--rounds 20] [--threads 2]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
from collections.abc import Callable

import numpy as np
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.compare_torch import BLOCK, SKIP, interleave, machine

# name: batch N, input channels C, output channels M, height H, width W, kernel k, pad
LAYERS = {
    "vgg 3->32 32x32": (32, 3, 32, 32, 32, 3, 1),
    "vgg 32->32 32x32": (32, 32, 32, 32, 32, 3, 1),
    "vgg 32->64 16x16": (32, 32, 64, 16, 16, 3, 1),
    "vgg 64->64 16x16": (32, 64, 64, 16, 16, 3, 1),
    "cnn 6->16 5x5 14x14": (64, 6, 16, 14, 14, 5, 0),
}
Layer = tuple[int, int, int, int, int, int, int]


def _ints(name: str, values: list[int]) -> TensorProto:
    return numpy_helper.from_array(np.array(values, np.int64), name)


def _session(nodes: list, inits: list, layer: Layer, threads: int) -> ort.InferenceSession:
    n, c, m, h, w, k, pad = layer
    ho, wo = h + 2 * pad - k + 1, w + 2 * pad - k + 1
    graph = helper.make_graph(
        nodes,
        "dw",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, c, h, w]),
            helper.make_tensor_value_info("dy", TensorProto.FLOAT, [n, m, ho, wo]),
        ],
        [helper.make_tensor_value_info("dw", TensorProto.FLOAT, None)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _onehot(c: int, k: int) -> np.ndarray:
    out = np.zeros((c * k * k, 1, k, k), np.float32)
    for ch in range(c):
        for j, (a, b) in enumerate(itertools.product(range(k), range(k))):
            out[ch * k * k + j, 0, a, b] = 1.0
    return out


def im2col(
    layer: Layer, threads: int, reduce_sum: bool = False, patches_first: bool = True
) -> ort.InferenceSession:
    n, c, m, h, w, k, pad = layer
    kk, length = k * k, (h + 2 * pad - k + 1) * (w + 2 * pad - k + 1)
    nodes = [
        helper.make_node("Conv", ["x", "onehot"], ["p"], group=c, kernel_shape=[k, k], pads=[pad] * 4),
        helper.make_node("Reshape", ["p", "p3_shape"], ["p3"]),
        helper.make_node("Reshape", ["dy", "d3_shape"], ["d3"]),
    ]
    if patches_first:  # P[n] dY[n]^T: (N, C K, M), the smaller dY repacked by the product
        nodes += [
            helper.make_node("Transpose", ["d3"], ["d3t"], perm=[0, 2, 1]),
            helper.make_node("MatMul", ["p3", "d3t"], ["per_sample"]),
        ]
    else:  # dY[n] P[n]^T: (N, M, C K)
        nodes += [
            helper.make_node("Transpose", ["p3"], ["p3t"], perm=[0, 2, 1]),
            helper.make_node("MatMul", ["d3", "p3t"], ["per_sample"]),
        ]
    if reduce_sum:
        nodes.append(helper.make_node("ReduceSum", ["per_sample", "axis0"], ["summed"], keepdims=0))
    else:
        nodes += [
            helper.make_node("Reshape", ["per_sample", "rows"], ["flat"]),
            helper.make_node("MatMul", ["ones", "flat"], ["summed"]),
        ]
    if patches_first:
        nodes += [
            helper.make_node("Reshape", ["summed", "ck_m"], ["summed2"]),
            helper.make_node("Transpose", ["summed2"], ["summed3"], perm=[1, 0]),
            helper.make_node("Reshape", ["summed3", "w_shape"], ["dw"]),
        ]
    else:
        nodes.append(helper.make_node("Reshape", ["summed", "w_shape"], ["dw"]))
    inits = [
        numpy_helper.from_array(_onehot(c, k), "onehot"),
        _ints("p3_shape", [0, c * kk, length]),
        _ints("d3_shape", [0, m, length]),
        _ints("axis0", [0]),
        _ints("rows", [n, -1]),
        numpy_helper.from_array(np.ones(n, np.float32), "ones"),
        _ints("ck_m", [c * kk, m]),
        _ints("w_shape", [m, c, k, k]),
    ]
    return _session(nodes, inits, layer, threads)


def conv_of_x_by_dy(layer: Layer, threads: int) -> ort.InferenceSession:
    pad = layer[6]
    nodes = [
        helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2, 3]),
        helper.make_node("Transpose", ["dy"], ["dyt"], perm=[1, 0, 2, 3]),
        helper.make_node("Conv", ["xt", "dyt"], ["r"], pads=[pad] * 4),
        helper.make_node("Transpose", ["r"], ["dw"], perm=[1, 0, 2, 3]),
    ]
    return _session(nodes, [], layer, threads)


def slices_one_gemm(layer: Layer, threads: int) -> ort.InferenceSession:
    _, c, m, h, w, k, pad = layer
    ho, wo = h + 2 * pad - k + 1, w + 2 * pad - k + 1
    nodes = [
        helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2, 3]),
        helper.make_node("Pad", ["xt", "pads"], ["xp"]),
        helper.make_node("Transpose", ["dy"], ["dyt"], perm=[1, 0, 2, 3]),
        helper.make_node("Reshape", ["dyt", "m_rows"], ["d2"]),
    ]
    inits = [_ints("pads", [0, 0, pad, pad, 0, 0, pad, pad]), _ints("hw", [2, 3]), _ints("m_rows", [m, -1])]
    inits += [_ints("axis1", [1]), _ints("ck_rows", [c * k * k, -1]), _ints("w_shape", [m, c, k, k])]
    stacked = []
    for j, (a, b) in enumerate(itertools.product(range(k), range(k))):
        inits += [_ints(f"start{j}", [a, b]), _ints(f"end{j}", [a + ho, b + wo])]
        nodes += [
            helper.make_node("Slice", ["xp", f"start{j}", f"end{j}", "hw"], [f"slice{j}"]),
            helper.make_node("Unsqueeze", [f"slice{j}", "axis1"], [f"stack{j}"]),
        ]
        stacked.append(f"stack{j}")
    nodes += [
        helper.make_node("Concat", stacked, ["p"], axis=1),
        helper.make_node("Reshape", ["p", "ck_rows"], ["p2"]),
        helper.make_node("Gemm", ["d2", "p2"], ["r"], transB=1),
        helper.make_node("Reshape", ["r", "w_shape"], ["dw"]),
    ]
    return _session(nodes, inits, layer, threads)


FORMS: dict[str, Callable[[Layer, int], ort.InferenceSession]] = {
    "im2col (the rule)": im2col,
    "im2col, dY first": lambda layer, threads: im2col(layer, threads, patches_first=False),
    "im2col, dY first, ReduceSum": lambda layer, threads: im2col(
        layer, threads, reduce_sum=True, patches_first=False
    ),
    "Conv of X by dY": conv_of_x_by_dy,
    "slices, one Gemm": slices_one_gemm,
}


def measure(name: str, layer: Layer, rounds: int, threads: int) -> None:
    """Print every form's median and fastest time on ``layer``, its ratio to torch's median and
    its largest difference from torch's float64 gradient (relative to the largest value)."""
    n, c, m, h, w, k, pad = layer
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, c, h, w), np.float32)
    dy = rng.standard_normal((n, m, h + 2 * pad - k + 1, w + 2 * pad - k + 1), np.float32)
    tx, tdy = torch.from_numpy(x), torch.from_numpy(dy)
    want = torch.nn.grad.conv2d_weight(tx.double(), (m, c, k, k), tdy.double(), padding=pad).numpy()
    fns: dict[str, Callable[[], object]] = {
        "torch conv2d_weight": lambda: torch.nn.grad.conv2d_weight(tx, (m, c, k, k), tdy, padding=pad)
    }
    errors: dict[str, float] = {}
    for form, make in FORMS.items():
        sess = make(layer, threads)
        got = sess.run(None, {"x": x, "dy": dy})[0]
        errors[form] = float(np.abs(got - want).max() / np.abs(want).max())
        fns[form] = lambda sess=sess: sess.run(None, {"x": x, "dy": dy})
    # blocks of 8 calls in turn, the first 3 of each not counted (compare_torch.time_steps says why)
    times = interleave(fns, rounds * (BLOCK - SKIP), block=BLOCK, skip=SKIP)
    ref = statistics.median(times["torch conv2d_weight"])
    print(f"\n{name} (batch {n})")
    for f, v in times.items():
        med = statistics.median(v)
        err = f"  error {errors[f]:.1e}" if f in errors else ""
        print(f"  {f:28s} median {med:7.3f} ms  min {min(v):7.3f} ms  {med / ref:5.2f}x torch{err}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(", ".join(f"{k}: {v}" for k, v in machine().items()), f"threads: {args.threads}")
    for name, layer in LAYERS.items():
        measure(name, layer, args.rounds, args.threads)


if __name__ == "__main__":
    main()
