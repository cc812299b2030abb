"""What bounds onnxgrad's CPU step against PyTorch eager: each part of the step alone, both ways.

``compare_torch.py`` times whole steps; this script times the parts that make the difference, each
alone, onnxruntime against PyTorch on the same shapes, interleaved in one process (blocks of a few
calls in turn, the first call of a block not counted; the fastest and median call reported):

* ``gemm``: the matrix products of the anchor steps (forward, input gradient, weight gradient) as
  onnxgrad's graphs write them, MLAS against torch's ``mm``, at 1 and 2 threads;
* ``ops``: forward + backward of one op as onnxgrad differentiates it (``ForwardBackward`` on a
  one-op model exported from torch) against torch autograd on the same op: LayerNorm, softmax,
  ReLU (the elementwise backward passes), MaxPool 2x2 and the CNN's first convolution;
* ``update``: the AdamW update of each anchor's parameters as the one-graph step writes it
  (:func:`onnxgrad.artifacts.optim.emit_updates`) against ``torch.optim.AdamW(foreach=True)``;
* ``call``: the fixed cost of an ``OnnxModule`` call on a tiny model against a torch ``Linear`` and
  against a ``torch.autograd.Function`` that does nothing (the floor any autograd bridge pays).

    python bench/floors.py [--parts gemm ops update call] [--json out/floors.json]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
from collections.abc import Callable

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import onnxgrad
from bench import anchors
from bench.compare_torch import interleave, machine
from onnxgrad.runtime.runner import default_options

THREADS = 2


def interleaved(fns: dict[str, Callable[[], object]], calls: int = 40, block: int = 4) -> dict[str, dict]:
    """Fastest and median milliseconds per call of each function, run in turn by blocks."""
    times = interleave(fns, calls, block=block)
    return {k: {"min_ms": min(v), "median_ms": statistics.median(v)} for k, v in times.items()}


def _session(nodes: list, inputs: dict[str, list[int]], threads: int) -> ort.InferenceSession:
    graph = helper.make_graph(
        nodes,
        "part",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    opts = default_options()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _bound(sess: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> Callable[[], object]:
    """A run of ``sess`` through IO binding: no copy of the output to numpy is timed."""
    binding = sess.io_binding()
    for k, v in feeds.items():
        binding.bind_cpu_input(k, v)
    binding.bind_output("y")
    return lambda: sess.run_with_iobinding(binding)


# (name, rows, in, out): the products of one Linear layer of the anchors, batch rows flattened
LAYERS = [
    ("transformer ffn", 2048, 256, 1024),
    ("transformer attn", 2048, 256, 256),
    ("mlp fc1", 256, 784, 512),
]


def gemm() -> dict:
    """GFLOP/s of each product of a Linear layer's step, onnxruntime (as onnxgrad writes it) and torch."""
    rng = np.random.default_rng(0)
    out: dict = {}
    for name, rows, n_in, n_out in LAYERS:
        x = rng.standard_normal((rows, n_in), dtype=np.float32)
        w = rng.standard_normal((n_in, n_out), dtype=np.float32)  # torch exports Linear as x @ W^T stored
        dy = rng.standard_normal((rows, n_out), dtype=np.float32)
        forms = {  # onnxgrad's forward MatMul, input gradient dY W^T, weight gradient X^T dY
            "forward": ([helper.make_node("MatMul", ["a", "b"], ["y"])], {"a": x, "b": w}, (x, w)),
            "input grad": (
                [helper.make_node("Gemm", ["a", "b"], ["y"], transB=1)],
                {"a": dy, "b": w},
                (dy, w.T),
            ),
            "weight grad": (
                [helper.make_node("Gemm", ["a", "b"], ["y"], transA=1)],
                {"a": x, "b": dy},
                (x.T, dy),
            ),
        }
        flop = 2 * rows * n_in * n_out / 1e6  # MFLOP: / ms = GFLOP/s
        for threads in (1, 2):
            torch.set_num_threads(threads)
            fns: dict[str, Callable[[], object]] = {}
            for form, (nodes, feeds, (a, b)) in forms.items():
                sess = _session(nodes, {k: list(v.shape) for k, v in feeds.items()}, threads)
                fns[f"ort {form}"] = _bound(sess, feeds)
                ta, tb = torch.from_numpy(np.ascontiguousarray(a)), torch.from_numpy(np.ascontiguousarray(b))
                if form == "weight grad":
                    ta = torch.from_numpy(x).t()  # torch's autograd takes the transposed view
                if form == "input grad":
                    tb = torch.from_numpy(w).t()
                fns[f"torch {form}"] = lambda ta=ta, tb=tb: torch.mm(ta, tb)
            for k, v in interleaved(fns).items():
                v["gflops"] = flop / v["min_ms"]
                out[f"{name} {k} {threads}t"] = v
    torch.set_num_threads(THREADS)
    return out


def _export(module: torch.nn.Module, x: torch.Tensor) -> onnx.ModelProto:
    buf = io.BytesIO()
    torch.onnx.export(
        module, (x,), buf, opset_version=17, dynamo=False, input_names=["input"], output_names=["output"]
    )
    model = onnx.load_from_string(buf.getvalue())
    model.ir_version = min(model.ir_version, 10)
    return model


class _Softmax(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, dim=-1)


def ops() -> dict:
    """Forward + backward of one op, onnxgrad (gradient of the input and of any weight) and torch."""
    torch.manual_seed(0)
    cases = {
        "LayerNorm 16x128x256": (torch.nn.LayerNorm(256), (16, 128, 256)),
        "softmax 16x4x128x128": (_Softmax(), (16, 4, 128, 128)),
        "ReLU 16x128x1024": (torch.nn.ReLU(), (16, 128, 1024)),
        "MaxPool2d(2) 64x6x28x28": (torch.nn.MaxPool2d(2), (64, 6, 28, 28)),
        "Conv2d(1, 6, 5, pad 2) 64x1x28x28": (torch.nn.Conv2d(1, 6, 5, padding=2), (64, 1, 28, 28)),
    }
    opts = default_options()
    opts.intra_op_num_threads, opts.inter_op_num_threads = THREADS, 1
    out = {}
    for name, (module, shape) in cases.items():
        x = torch.randn(*shape)
        model = _export(module, x)
        fb = onnxgrad.ForwardBackward(model, inputs_requiring_grad=["input"], session_options=opts)
        feeds = {"input": x.numpy()}
        xg = x.clone().requires_grad_(True)
        ones = torch.ones_like(module(x))

        def torch_step(module=module, xg=xg, ones=ones) -> None:
            module.zero_grad(set_to_none=True)
            xg.grad = None
            module(xg).backward(ones)

        res = interleaved(
            {"onnxgrad": lambda fb=fb, feeds=feeds: fb.forward(feeds).backward(), "torch": torch_step}
        )
        out[name] = {**res, "ratio_min": res["onnxgrad"]["min_ms"] / res["torch"]["min_ms"]}
    return out


def update() -> dict:
    """The AdamW update alone: the one-graph step's nodes against torch's foreach AdamW."""
    from onnxgrad.artifacts.optim import Param, emit_updates
    from onnxgrad.model.emit import Emitter

    hyper = {"betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 1e-2}
    out = {}
    for name in ("mlp", "cnn", "transformer"):
        shapes = [tuple(p.shape) for p in anchors.build(name).parameters()]
        graph = helper.make_graph([], "update", [], [])
        graph.input.extend(
            [
                helper.make_tensor_value_info("lr", TensorProto.DOUBLE, []),
                helper.make_tensor_value_info("step", TensorProto.INT64, []),
            ]
        )
        params, state = [], {}
        for i, s in enumerate(shapes):
            graph.input.extend(
                helper.make_tensor_value_info(f"{k}{i}", TensorProto.FLOAT, list(s)) for k in "pgmv"
            )
            params.append(Param(f"p{i}", f"g{i}", TensorProto.FLOAT))
            state[(f"p{i}", "exp_avg")], state[(f"p{i}", "exp_avg_sq")] = f"m{i}", f"v{i}"
        e = Emitter(graph, 17, TensorProto.FLOAT, "optimizer")
        new_params, new_state = emit_updates(e, "adamw", hyper, params, state, "lr", "step")
        graph.output.extend(
            helper.make_tensor_value_info(o, TensorProto.FLOAT, None)
            for o in (*new_params.values(), *new_state.values())
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        opts = default_options()
        opts.intra_op_num_threads, opts.inter_op_num_threads = THREADS, 1
        sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(0)
        feeds = {"lr": np.array(1e-3), "step": np.array(3, np.int64)}
        for i, s in enumerate(shapes):
            for k in "pgm":
                feeds[f"{k}{i}"] = rng.standard_normal(s, dtype=np.float32)
            feeds[f"v{i}"] = np.abs(rng.standard_normal(s, dtype=np.float32))
        binding = sess.io_binding()
        for k, v in feeds.items():
            binding.bind_ortvalue_input(k, ort.OrtValue.ortvalue_from_numpy(v))
        for o in sess.get_outputs():
            binding.bind_output(o.name)
        tparams = [torch.nn.Parameter(torch.from_numpy(feeds[f"p{i}"]).clone()) for i in range(len(shapes))]
        for i, p in enumerate(tparams):
            p.grad = torch.from_numpy(feeds[f"g{i}"]).clone()
        opt = torch.optim.AdamW(tparams, lr=1e-3, weight_decay=1e-2, foreach=True)
        res = interleaved({"onnxgrad": lambda s=sess, b=binding: s.run_with_iobinding(b), "torch": opt.step})
        nodes = sum(n.op_type != "Constant" for n in graph.node)
        out[name] = {**res, "values": int(sum(np.prod(s) for s in shapes)), "nodes": nodes}
    return out


def call() -> dict:
    """Microseconds of one step (zero_grad, forward, backward) on a Linear(16, 16), batch 4."""
    from bench.compare_torch import _tiny
    from onnxgrad.torch import OnnxModule

    module, x = _tiny()
    opts = default_options()
    opts.intra_op_num_threads, opts.inter_op_num_threads = THREADS, 1
    om = OnnxModule(anchors.export(module, x[:1]), session_options=opts)
    ones = torch.ones(4, 16)
    w, b = torch.nn.Parameter(torch.randn(16, 16)), torch.nn.Parameter(torch.randn(16))

    class Nothing(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, b):
            ctx.save_for_backward(x)
            return torch.empty(4, 16)

        @staticmethod
        def backward(ctx, g):
            return None, torch.empty(16, 16), torch.empty(16)

    def reps(step: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(50):
                step()

        return run

    def torch_step() -> None:
        module.zero_grad(set_to_none=True)
        module(x).backward(ones)

    def module_step() -> None:
        om.zero_grad(set_to_none=True)
        om(x).backward(ones)

    def nothing_step() -> None:
        w.grad = b.grad = None
        Nothing.apply(x, w, b).backward(ones)

    res = interleaved(
        {"OnnxModule": reps(module_step), "torch": reps(torch_step), "empty Function": reps(nothing_step)}
    )
    return {
        k: {"min_us": v["min_ms"] * 20, "median_us": v["median_ms"] * 20} for k, v in res.items()
    }  # 1e3 / 50


PARTS = {"gemm": gemm, "ops": ops, "update": update, "call": call}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    parser.add_argument("--json", help="write every figure to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(THREADS)
    figures: dict = {"machine": machine(), "threads": THREADS}
    print(", ".join(f"{k}: {v}" for k, v in figures["machine"].items() if k != "flags"))
    for part in args.parts:
        res = figures[part] = PARTS[part]()
        print(f"\n[{part}]")
        for k, v in res.items():
            print(
                f"  {k:48s} " + "  ".join(f"{f} {x:.4g}" for f, x in v.items() if isinstance(x, (int, float)))
            )
            for sub, x in v.items():
                if isinstance(x, dict):
                    print(f"      {sub:20s} " + "  ".join(f"{f} {y:.4g}" for f, y in x.items()))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
