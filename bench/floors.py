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
  (:func:`onnxgrad.artifacts.optim.emit_program`), and other ways to write it, against
  ``torch.optim.AdamW(foreach=True)``; then the numpy ``AdamW`` step on the same parameters
  (``numpy``), and on 200 float64 parameters of 64 values (``many small``);
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
from typing import Any

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
F32_EPS = float(np.finfo(np.float32).eps)


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


def _adamw_torch_order(o: Any, h: Any, p: Any, g: Any, s: dict) -> tuple[Any, dict]:
    """AdamW in torch's order, 14 passes: ``p += (-lr / (1-β1^t)) m / (√v / √(1-β2^t) + eps)``
    (the registry's formula until 2026-11-27; it now moves ``√(1-β2^t)`` into the scalars)."""
    beta1, beta2 = h["betas"]
    p_in = o.mul(p, o.sub(1.0, o.mul(o.lr, h["weight_decay"])))
    m, v = s["exp_avg"], s["exp_avg_sq"]
    new_m = o.add(m, o.mul(o.sub(g, m), 1.0 - beta1))
    new_v = o.add(o.mul(v, beta2), o.mul(o.mul(g, g), 1.0 - beta2))
    denom = o.add(o.div(o.sqrt(new_v), o.sqrt(o.one_minus_pow(beta2, o.t))), h["eps"])
    step_size = o.div(o.neg(o.lr), o.one_minus_pow(beta1, o.t))
    return o.add(p_in, o.mul(o.div(new_m, denom), step_size)), {"exp_avg": new_m, "exp_avg_sq": new_v}


def _update_model(shapes: list[tuple[int, ...]], variant: str) -> onnx.ModelProto:
    """One AdamW update of parameters of ``shapes`` (float32), inputs ``p{i} g{i} m{i} v{i}``,
    ``lr`` (double), ``step`` (int64), as the one-graph step writes it (``"program"``), in
    torch's order of operations (``"torch's order"``, one pass more), or over all parameters
    concatenated into one flat tensor (``"flat"``)."""
    from dataclasses import replace

    from onnxgrad.artifacts.optim import Param, emit_program
    from onnxgrad.model.emit import Emitter
    from onnxgrad.train.optimizers import definition

    hyper = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}
    spec = definition("adamw")
    if variant == "torch's order":
        spec = replace(spec, formula=_adamw_torch_order, _programs={})
    f32 = TensorProto.FLOAT
    graph = helper.make_graph([], "update", [], [])
    graph.input.extend(
        [
            helper.make_tensor_value_info("lr", TensorProto.DOUBLE, []),
            helper.make_tensor_value_info("step", TensorProto.INT64, []),
        ]
    )
    for i, s in enumerate(shapes):
        graph.input.extend(helper.make_tensor_value_info(f"{k}{i}", f32, list(s)) for k in "pgmv")
    e = Emitter(graph, 17, f32, "optimizer")
    outputs: dict[str, str] = {}
    if variant == "flat":
        flat = e.const(np.array([-1]), TensorProto.INT64)
        cat = {
            k: e.op("Concat", *(e.op("Reshape", f"{k}{i}", flat) for i in range(len(shapes))), axis=0)
            for k in "pgmv"
        }
        params = [Param(cat["p"], cat["g"], f32)]
        state = {(cat["p"], "exp_avg"): cat["m"], (cat["p"], "exp_avg_sq"): cat["v"]}
        new_p, new_s = emit_program(e, spec, hyper, params, state, "lr", "step")
        sizes = e.const(np.array([int(np.prod(s)) for s in shapes]), TensorProto.INT64)
        for k, value in (
            ("p", new_p[cat["p"]]),
            ("m", new_s[(cat["p"], "exp_avg")]),
            ("v", new_s[(cat["p"], "exp_avg_sq")]),
        ):
            parts = [e.fresh(f"split_{k}") for _ in shapes]
            graph.node.append(helper.make_node("Split", [value, sizes], parts, axis=0))
            for i, (part, s) in enumerate(zip(parts, shapes)):
                outputs[f"new_{k}{i}"] = e.op("Reshape", part, e.const(np.array(s), TensorProto.INT64))
        outputs = {f"new_{k}{i}": outputs[f"new_{k}{i}"] for i in range(len(shapes)) for k in "pmv"}
    else:
        params = [Param(f"p{i}", f"g{i}", f32) for i in range(len(shapes))]
        state = {
            (f"p{i}", k): f"{x}{i}"
            for i in range(len(shapes))
            for k, x in (("exp_avg", "m"), ("exp_avg_sq", "v"))
        }
        new_p, new_s = emit_program(e, spec, hyper, params, state, "lr", "step")
        for i in range(len(shapes)):
            outputs[f"new_p{i}"] = new_p[f"p{i}"]
            outputs[f"new_m{i}"], outputs[f"new_v{i}"] = (
                new_s[(f"p{i}", "exp_avg")],
                new_s[(f"p{i}", "exp_avg_sq")],
            )
    graph.output.extend(helper.make_tensor_value_info(v, f32, None) for v in outputs.values())
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


UPDATE_VARIANTS = ("program", "torch's order", "flat", "program, 1 thread", "program, in place")


def update(variants: tuple[str, ...] = UPDATE_VARIANTS) -> dict:
    """The AdamW update alone: the one-graph step's nodes (and other ways to write them: see
    :func:`_update_model`; ``", 1 thread"``: one intra-op thread; ``", in place"``: the new
    values written over the inputs' buffers) against torch's foreach AdamW and onnxgrad's numpy
    AdamW; each variant's largest difference from the one-graph step's numbers (``diff_eps``)."""
    out: dict = {}
    for name in ("mlp", "cnn", "transformer"):
        shapes = [tuple(p.shape) for p in anchors.build(name).parameters()]
        rng = np.random.default_rng(0)
        feeds = {"lr": np.array(1e-3), "step": np.array(3, np.int64)}
        for i, s in enumerate(shapes):
            for k in "pgm":
                feeds[f"{k}{i}"] = rng.standard_normal(s, dtype=np.float32)
            feeds[f"v{i}"] = np.abs(rng.standard_normal(s, dtype=np.float32))
        opts = default_options()
        opts.intra_op_num_threads, opts.inter_op_num_threads = THREADS, 1
        fns: dict[str, Callable[[], object]] = {}
        results: dict[str, dict[str, np.ndarray]] = {}
        nodes: dict[str, int] = {}
        for variant in variants:
            model = _update_model(shapes, variant.split(",")[0])
            nodes[variant] = sum(n.op_type != "Constant" for n in model.graph.node)
            opts.intra_op_num_threads = 1 if variant.endswith("1 thread") else THREADS
            sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
            got = sess.run(None, feeds)  # outputs in order: p, m, v of each parameter
            results[variant] = dict(enumerate(got))
            binding = sess.io_binding()  # as the one-graph step: every output in a buffer of its own
            for k, v in feeds.items():
                binding.bind_ortvalue_input(k, ort.OrtValue.ortvalue_from_numpy(v))
            if variant.endswith("in place"):  # new p, m, v written over p, m, v (copies of the feeds)
                own = {k: ort.OrtValue.ortvalue_from_numpy(feeds[k].copy()) for k in feeds if k[0] in "pmv"}
                for k, v in own.items():
                    binding.bind_ortvalue_input(k, v)
                for j, o in enumerate(sess.get_outputs()):
                    binding.bind_ortvalue_output(o.name, own[f"{'pmv'[j % 3]}{j // 3}"])
            else:
                for o, v in zip(sess.get_outputs(), got):
                    binding.bind_ortvalue_output(o.name, ort.OrtValue.ortvalue_from_numpy(np.empty_like(v)))
            fns[variant] = lambda s=sess, b=binding: s.run_with_iobinding(b)
        tparams = [torch.nn.Parameter(torch.from_numpy(feeds[f"p{i}"]).clone()) for i in range(len(shapes))]
        for i, p in enumerate(tparams):
            p.grad = torch.from_numpy(feeds[f"g{i}"]).clone()
        opt = torch.optim.AdamW(tparams, lr=1e-3, weight_decay=1e-2, foreach=True)
        fns["torch"] = opt.step
        fns["numpy"] = _numpy_adamw(
            [feeds[f"p{i}"] for i in range(len(shapes))], [feeds[f"g{i}"] for i in range(len(shapes))]
        )
        res = interleaved(fns)
        base = results[variants[0]]
        for variant in variants:  # the largest difference, in float32 eps of max(|value|, |change|)
            diff = 0.0
            for k, v in results[variant].items():
                old, new = feeds[f"{'pmv'[k % 3]}{k // 3}"], base[k]
                scale = np.maximum(np.abs(new), np.abs(new - old)) * F32_EPS
                diff = max(diff, float(np.max(np.abs(v - new) / np.maximum(scale, 1e-37))))
            res[variant] = {**res[variant], "nodes": nodes[variant], "diff_eps": diff}
        out[name] = {**res, "values": int(sum(np.prod(s) for s in shapes))}
    rng = np.random.default_rng(1)
    small = [rng.standard_normal(64) for _ in range(200)]
    grads = [rng.standard_normal(64) for _ in range(200)]
    tparams = [torch.nn.Parameter(torch.from_numpy(p).clone()) for p in small]
    for p, g in zip(tparams, grads):
        p.grad = torch.from_numpy(g).clone()
    opt = torch.optim.AdamW(tparams, lr=1e-3, weight_decay=1e-2, foreach=True)
    out["200 float64 parameters of 64 values"] = interleaved(
        {"numpy": _numpy_adamw(small, grads), "torch": opt.step}
    )
    return out


def _numpy_adamw(params: list[np.ndarray], grads: list[np.ndarray]) -> Callable[[], None]:
    """A step of onnxgrad's numpy ``AdamW`` on copies of ``params`` with gradients ``grads``."""
    from onnxgrad.train import AdamW

    opt = AdamW({f"p{i}": p.copy() for i, p in enumerate(params)}, lr=1e-3)
    named = {f"p{i}": g for i, g in enumerate(grads)}
    return lambda: opt.step(named)


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
