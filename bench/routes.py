"""Issue 33's routes, measured: alternatives to what onnxgrad does now, A/B in one process.

Each section builds the variants side by side and times them interleaved (blocks of a few calls in
turn, the first call of a block not counted), so a loaded machine slows both alike; it prints the
median and fastest call of each and their ratios to the first variant (what onnxgrad does now):

* ``rules``: the backward of LayerNorm, softmax and ReLU in other forms (the rule re-registered
  for the variant, the gradient graphs built, then the next variant), with each variant's largest
  difference from torch's float64 gradient;
* ``adamw``: the one-graph AdamW update (``emit_updates``) against a form with one pass fewer;
* ``denormal``: ``session.set_denormal_as_zero`` on the anchors' one-graph training step, and
  the loss after a few steps with and without it;
* ``threads``: spinning, ``session.dynamic_block_base``, the arena, and a global thread pool
  shared by the forward and backward sessions, on the anchors' numpy forward + backward;
* ``nchwc``: whether onnxruntime's optimizer writes the blocked-layout (``com.microsoft.nchwc``)
  Conv when the weight is an input rather than an initializer, and what the initializer form
  (pre-packed, blocked) would save on the cnn/vgg forward Convs;
* ``maxpool``: MaxPool's gradient from a forward window ArgMax against the Indices output, on the
  cnn and vgg one-graph steps and numpy forward + backward.

    python bench/routes.py [--sections rules adamw denormal threads nchwc maxpool] [--rounds 3]
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
from collections.abc import Callable

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import onnxgrad
from bench import anchors
from bench.compare_torch import interleave, machine
from bench.floors import _export, _Softmax
from onnxgrad.autodiff.builder import Var, cast, where
from onnxgrad.autodiff.registry import formulas, lookup, rule
from onnxgrad.runtime.runner import default_options

THREADS = 2
CALLS = 120  # per variant and case: the machine this was written on was shared and noisy


def timed(fns: dict[str, Callable[[], object]], calls: int = 30, block: int = 4) -> dict[str, dict]:
    """Median and fastest ms of each function, interleaved; ``ratio``: median over the first's."""
    times = interleave(fns, calls, block=block)
    first = next(iter(times))
    base_med, base_min = statistics.median(times[first]), min(times[first])
    return {
        k: {
            "median_ms": statistics.median(v),
            "min_ms": min(v),
            "ratio_median": statistics.median(v) / base_med,
            "ratio_min": min(v) / base_min,
        }
        for k, v in times.items()
    }


def _opts(threads: int = THREADS) -> ort.SessionOptions:
    opts = default_options()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    return opts


# ---- rules: other forms of the LayerNorm, softmax and ReLU backward ---------------------------
def _ln_start(g, n):
    """What both LayerNorm variants start from: the inputs, the bias gradient, the axes and 1/std."""
    from onnxgrad.autodiff.rules.norm import norm_axes

    x, scale = n.inputs[0], n.inputs[1]
    b = n.inputs[2] if len(n.inputs) > 2 else None
    dy = n.dy
    grads = [None] * len(n.inputs)
    if b is not None and n.needs[2]:
        grads[2] = g.unbroadcast(dy, b, x.shape)
    axis = int(n.attr("axis", -1))
    axes = norm_axes(n, x, axis)
    stash = int(n.attr("stash_type", TensorProto.FLOAT))
    stat_shape = (*x.shape[: axes[0] % len(x.shape)], *(1,) * len(axes))
    inv = cast(g.extra_output(n.node, 2, stash, stat_shape), x)
    return x, scale, dy, grads, axis, axes, stash, stat_shape, inv


def _ln_recomputed(g, n):
    """LayerNorm's backward with xh made by one LayerNormalization(x, ones) instead of (x - mean) inv."""
    from onnxgrad.autodiff.rules.norm import mean_over, normalize_backward

    x, scale, dy, grads, axis, axes, stash, _stat_shape, inv = _ln_start(g, n)
    ones = g.const(np.ones(scale.shape, np.float32), x.dtype)
    xh = g.LayerNormalization(x, ones, axis=axis, epsilon=n.attr("epsilon", 1e-5), stash_type=stash)
    if n.needs[1]:
        grads[1] = g.unbroadcast(dy * xh, scale, x.shape)
    if n.needs[0]:
        grads[0] = normalize_backward(dy * scale, xh, inv, mean_over(g, axes))
    return grads


def _ln_matvec(recompute: bool):
    """LayerNorm's backward with the row means mean(dxh xh) = (dy xh) @ (scale / D) and
    mean(dxh) = dy @ (scale / D): one (D, 1) matrix-vector product each instead of Mul + ReduceMean."""

    def fn(g, n):
        x, scale, dy, grads, axis, _axes, stash, stat_shape, inv = _ln_start(g, n)
        if recompute:
            ones = g.const(np.ones(scale.shape, np.float32), x.dtype)
            xh = g.LayerNormalization(x, ones, axis=axis, epsilon=n.attr("epsilon", 1e-5), stash_type=stash)
        else:
            mean = cast(g.extra_output(n.node, 1, stash, stat_shape), x)
            xh = (x - mean) * inv
        t = dy * xh
        grads[1] = g.unbroadcast(t, scale, x.shape)
        d = scale.shape[0]
        col = g.Unsqueeze(scale * g.const(1.0 / d, x.dtype), [1])  # (D, 1)
        proj, m = t @ col, dy @ col  # (..., 1)
        grads[0] = inv * (dy * scale - xh * proj - m)
        return grads

    return fn


def _softmax_matvec(g, n):
    """Softmax's backward with the row sum as a product by ones(K, 1) instead of ReduceSum."""
    y, dy = n.y, n.dy
    k = y.shape[-1]
    t = dy * y
    s = t @ g.const(np.ones((k, 1), np.float32), y.dtype)
    return [y * (dy - s)]


def _softmax_t(g, n):
    """Softmax's backward as t - y sum(t), t = dy y (same pass count, the sum read from t)."""
    y, dy = n.y, n.dy
    t = dy * y
    return [t - y * g.reduce_sum(t, [-1], keepdims=True)]


RELU_FORMS: dict[str, Callable[[Var, Var], Var]] = {
    "dy * Cast(y > 0) (now)": lambda y, dy: dy * cast(y > 0, dy),
    "Where(y > 0, dy, 0)": lambda y, dy: where(y > 0, dy, 0),
    "dy * Sign(y)": lambda y, dy: dy * y.g.Sign(y),
    "dy * Cast(Cast(y, bool))": lambda y, dy: dy * cast(y.g.Cast(y, to=TensorProto.BOOL), dy),
}


def _variant_fbs(
    module: torch.nn.Module, shape: tuple[int, ...], op: str, variants: dict[str, Callable[[], None]]
) -> dict[str, dict]:
    """For each variant: register it (``variants[k]()``), build and time ``ForwardBackward``."""
    torch.manual_seed(0)
    x = torch.randn(*shape)
    model = _export(module, x)
    xd = x.double().requires_grad_(True)
    md = copy.deepcopy(module).double()
    out_d = md(xd)
    dy = torch.randn(out_d.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out_d.backward(dy)  # not ones: LayerNorm's and softmax's input gradients of a plain sum are 0
    seed = {"output": dy.float().numpy()}
    ref = {"input": xd.grad.numpy(), **{k: p.grad.numpy() for k, p in md.named_parameters()}}
    saved = lookup("", op, 17)
    fns, errs = {}, {}
    feeds = {"input": x.numpy()}
    variants = {**variants, "A/A control: the first again": next(iter(variants.values()))}
    for name, register in variants.items():
        register()
        fb = onnxgrad.ForwardBackward(
            copy.deepcopy(model), inputs_requiring_grad=["input"], session_options=_opts()
        )
        res = fb.forward(feeds).backward(seed)
        errs[name] = max(
            float(np.max(np.abs(res[k] - r)) / (np.max(np.abs(r)) + 1e-30)) for k, r in ref.items()
        )
        fns[name] = lambda fb=fb: fb.forward(feeds).backward(seed)
    from onnxgrad.autodiff.registry import _add

    _add(saved)  # the rule as it was
    out = timed(fns, calls=CALLS, block=3)
    for k in out:
        out[k]["max_err_vs_f64"] = errs[k]
    return out


def rules() -> dict:
    torch.set_num_threads(THREADS)
    out = {}
    current_ln = lookup("", "LayerNormalization", 17).fn

    def reg_ln(fn):
        return lambda: rule("LayerNormalization", since=17)(fn)

    out["LayerNorm 16x128x256"] = _variant_fbs(
        torch.nn.LayerNorm(256),
        (16, 128, 256),
        "LayerNormalization",
        {
            "now: xh = (x - Mean) InvStdDev": reg_ln(current_ln),
            "xh = LayerNormalization(x, 1)": reg_ln(_ln_recomputed),
            "row means as (D,1) products": reg_ln(_ln_matvec(False)),
            "both": reg_ln(_ln_matvec(True)),
        },
    )
    current_sm = lookup("", "Softmax", 13).fn
    out["softmax 16x4x128x128"] = _variant_fbs(
        _Softmax(),
        (16, 4, 128, 128),
        "Softmax",
        {
            "now: y (dy - sum(dy y))": lambda: rule("Softmax", since=13)(current_sm),
            "t - y sum(t)": lambda: rule("Softmax", since=13)(_softmax_t),
            "sum as product by ones(K, 1)": lambda: rule("Softmax", since=13)(_softmax_matvec),
        },
    )
    out["ReLU 16x128x1024"] = _variant_fbs(
        torch.nn.ReLU(),
        (16, 128, 1024),
        "Relu",
        {k: (lambda f=f: formulas("Relu", f)) for k, f in RELU_FORMS.items()},
    )
    return out


# ---- adamw: the update with one pass fewer ------------------------------------------------------
def _adamw_graph(shapes: list[tuple[int, ...]], folded: bool) -> onnx.ModelProto:
    """The AdamW update of parameters of ``shapes``: onnxgrad's ``emit_updates`` (``folded=False``)
    or, folded, ``p decay - (lr / b1) m / (sqrt(v) + eps b2) b2`` (b2 = sqrt(1 - beta2^t)):
    the division by b2 moved into the per-step scalars, one pass fewer per parameter."""
    from onnxgrad.artifacts.optim import Param, emit_updates
    from onnxgrad.model.emit import Emitter

    hyper = {"betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 1e-2}
    graph = helper.make_graph([], "update", [], [])
    graph.input.extend(
        [
            helper.make_tensor_value_info("lr", TensorProto.DOUBLE, []),
            helper.make_tensor_value_info("step", TensorProto.INT64, []),
        ]
    )
    for i, s in enumerate(shapes):
        graph.input.extend(
            helper.make_tensor_value_info(f"{k}{i}", TensorProto.FLOAT, list(s)) for k in "pgmv"
        )
    if not folded:
        e = Emitter(graph, 17, TensorProto.FLOAT, "optimizer")
        params = [Param(f"p{i}", f"g{i}", TensorProto.FLOAT) for i in range(len(shapes))]
        state = {}
        for i in range(len(shapes)):
            state[(f"p{i}", "exp_avg")], state[(f"p{i}", "exp_avg_sq")] = f"m{i}", f"v{i}"
        new_p, new_s = emit_updates(e, "adamw", hyper, params, state, "lr", "step")
        outs = [*new_p.values(), *new_s.values()]
    else:
        nodes, inits = [], []

        def c(name, value, dtype=np.float32):
            inits.append(numpy_helper.from_array(np.array(value, dtype), name))
            return name

        def n(op, *ins, **kw):
            o = f"t{len(nodes)}"
            nodes.append(helper.make_node(op, list(ins), [o], **kw))
            return o

        b1, b2 = hyper["betas"]
        t = n("Add", n("Cast", "step", to=TensorProto.DOUBLE), c("one_d", 1.0, np.float64))
        bias1 = n("Sub", "one_d", n("Pow", c("b1_d", b1, np.float64), t))
        sb2 = n("Sqrt", n("Sub", "one_d", n("Pow", c("b2_d", b2, np.float64), t)))
        # step = -lr / bias1 * sb2, eps' = eps * sb2, decay = 1 - lr wd
        step_f = n("Cast", n("Mul", n("Div", n("Neg", "lr"), bias1), sb2), to=TensorProto.FLOAT)
        eps_f = n("Cast", n("Mul", c("eps_d", hyper["eps"], np.float64), sb2), to=TensorProto.FLOAT)
        decay = n(
            "Cast",
            n("Sub", "one_d", n("Mul", "lr", c("wd_d", hyper["weight_decay"], np.float64))),
            to=TensorProto.FLOAT,
        )
        c("c1", 1 - b1), c("b2", b2), c("c2", 1 - b2)
        outs, states = [], []
        for i in range(len(shapes)):
            p, g, m, v = (f"{k}{i}" for k in "pgmv")
            nm = n("Add", m, n("Mul", n("Sub", g, m), "c1"))
            nv = n("Add", n("Mul", v, "b2"), n("Mul", n("Mul", g, g), "c2"))
            upd = n("Mul", n("Div", nm, n("Add", n("Sqrt", nv), eps_f)), step_f)
            outs.append(n("Add", n("Mul", p, decay), upd))
            states += [nm, nv]
        outs += states
        graph.node.extend(nodes)
        graph.initializer.extend(inits)
    graph.output.extend(helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _adamw_f64(feeds: dict, count: int, lr: float = 1e-3, wd: float = 1e-2) -> list[np.ndarray]:
    """The update p' - p of each parameter in float64 (torch's AdamW formula)."""
    b1, b2, eps, t = 0.9, 0.999, 1e-8, int(feeds["step"]) + 1
    out = []
    for i in range(count):
        p, g, m, v = (feeds[f"{k}{i}"].astype(np.float64) for k in "pgmv")
        m, v = m + (g - m) * (1 - b1), v * b2 + g * g * (1 - b2)
        denom = np.sqrt(v) / math.sqrt(1 - b2**t) + eps
        out.append(p * (1 - lr * wd) - lr / (1 - b1**t) * m / denom - p)
    return out


def adamw() -> dict:
    out = {}
    for name in ("mlp", "transformer"):
        shapes = [tuple(p.shape) for p in anchors.build(name).parameters()]
        rng = np.random.default_rng(0)
        feeds = {"lr": np.array(1e-3), "step": np.array(3, np.int64)}
        for i, s in enumerate(shapes):
            for k in "pgm":
                feeds[f"{k}{i}"] = rng.standard_normal(s, dtype=np.float32) * (0.1 if k == "m" else 1)
            feeds[f"v{i}"] = np.abs(rng.standard_normal(s, dtype=np.float32))
        fns, results = {}, {}
        forms = (
            ("now (14 passes)", False),
            ("folded b2 (13 passes)", True),
            ("A/A control: now again", False),
        )
        for label, folded in forms:
            model = _adamw_graph(shapes, folded)
            sess = ort.InferenceSession(
                model.SerializeToString(), _opts(), providers=["CPUExecutionProvider"]
            )
            results[label] = sess.run(None, feeds)
            binding = sess.io_binding()
            for k, v in feeds.items():
                binding.bind_ortvalue_input(k, ort.OrtValue.ortvalue_from_numpy(v))
            for o in sess.get_outputs():
                binding.bind_output(o.name)
            fns[label] = lambda s=sess, b=binding: s.run_with_iobinding(b)
        res = timed(fns, calls=CALLS, block=3)
        exact = _adamw_f64(feeds, len(shapes))
        for label, got in results.items():  # the largest error of the update p' - p, relative to its size
            res[label]["update_err_vs_f64"] = max(
                float(np.max(np.abs((g - feeds[f"p{i}"]) - d)) / np.max(np.abs(d)))
                for i, (g, d) in enumerate(zip(got, exact))
            )
        out[name] = res
    return out


# ---- denormal: set_denormal_as_zero on the one-graph step -----------------------------------------
def _onegraph_step(name: str, options: ort.SessionOptions, keep: list) -> Callable[[], object]:
    """The one-graph training step (forward, MSE, backward, AdamW) of ``name`` with ``options``;
    each call returns the step's outputs."""
    import tempfile

    from bench.compare_torch import FULL_LR, FULL_WD, _model
    from onnxgrad.artifacts import Runner, generate

    module, x = _model(name)
    model = anchors.export(module, x[:1])
    with torch.no_grad():
        target = torch.randn(module(x).shape, generator=torch.Generator().manual_seed(2))
    folder = tempfile.TemporaryDirectory()
    keep.append(folder)
    generate(model, loss="mse", loss_options={"output": "output"}, optimizer="adamw", lr=FULL_LR,
             weight_decay=FULL_WD, out_dir=folder.name)  # fmt: skip
    runner = Runner(folder.name, session_options=options)
    batch = {"input": x.numpy(), "target": target.numpy()}
    return lambda: runner.step(batch)


def denormal() -> dict:
    """The one-graph step with and without flush-to-zero; the loss after the same steps."""
    out = {}
    keep: list = []
    for name in ("mlp", "cnn", "transformer"):
        fns = {}
        for label, ftz in (("default", False), ("set_denormal_as_zero", True)):
            opts = _opts()
            if ftz:
                opts.add_session_config_entry("session.set_denormal_as_zero", "1")
            fns[label] = _onegraph_step(name, opts, keep)
        res = timed(fns, calls=20, block=3)
        # the same number of steps ran on each; the loss of one more
        for label, fn in fns.items():
            res[label]["loss"] = float(np.asarray(_loss(fn())))
        a, b = (res[k]["loss"] for k in fns)
        res["loss difference after the same steps"] = {"value": abs(a - b)}
        out[name] = res
    out["Mul of 1M denormal floats"] = _denormal_kernel()
    return out


def _denormal_kernel() -> dict:
    """Mul and Sqrt over 1M denormal floats (1e-39), with and without flush-to-zero: the CPU's own
    cost of denormals, whatever a step holds of them."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "h"], ["m"]), helper.make_node("Sqrt", ["m"], ["y"])],
        "denormal",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1 << 20])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array(0.75, np.float32), "h")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    x = np.full(1 << 20, 1e-39, np.float32)
    normal = np.full(1 << 20, 1e-3, np.float32)
    fns = {}
    for label, ftz, data in (("denormal, default", False, x), ("denormal, set_denormal_as_zero", True, x),
                             ("normal values, default", False, normal)):  # fmt: skip
        opts = _opts()
        if ftz:
            opts.add_session_config_entry("session.set_denormal_as_zero", "1")
        sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        fns[label] = lambda s=sess, d=data: s.run(None, {"x": d})
    return timed(fns, calls=CALLS, block=3)


def _loss(result: object) -> object:
    if isinstance(result, dict):
        return result["loss"]
    return getattr(result, "loss", result)


# ---- threads -------------------------------------------------------------------------------------
def _numpy_step(name: str, options: ort.SessionOptions) -> Callable[[], object]:
    from bench.compare_torch import _model

    module, x = _model(name)
    fb = onnxgrad.ForwardBackward(anchors.export(module, x[:1]), session_options=options)
    feeds = {"input": x.numpy()}
    return lambda: fb.forward(feeds).backward()


def _setting(threads: int, **entries: str) -> Callable[[], ort.SessionOptions]:
    def make() -> ort.SessionOptions:
        o = _opts(threads)
        for k, v in entries.items():
            if k == "arena":
                o.enable_cpu_mem_arena = v == "1"
            else:
                o.add_session_config_entry(k, v)
        return o

    return make


def threads() -> dict:
    """The numpy forward + backward of each anchor under several session settings, 1 and 2 threads."""
    out = {}
    for n in (1, 2):
        settings = {
            "now (no spinning)": _setting(n),
            "spinning": _setting(n, **{"session.intra_op.allow_spinning": "1"}),
            "dynamic_block_base=4": _setting(n, **{"session.dynamic_block_base": "4"}),
            "no arena": _setting(n, arena="0"),
            "A/A control: now again": _setting(n),
        }
        for name in ("mlp", "cnn", "transformer"):
            fns = {k: _numpy_step(name, make()) for k, make in settings.items()}
            out[f"{name} {n}t"] = timed(fns, calls=20, block=3)
    return out


def global_pool(pairs: int = 4) -> dict:
    """One global pool shared by the forward and backward sessions (``use_per_session_threads =
    False``, onnxruntime's global pool, which spins) against per-session pools without spinning.

    onnxruntime makes the global pool with its environment, once per process, and then refuses
    per-session pools: each form runs in processes of its own, ``pairs`` processes each, in turn
    (A B A B ...); each process times 30 steps after 5; the medians of the processes' medians and
    fastest steps are compared.
    """
    import subprocess

    out = {}
    for name in ("mlp", "cnn", "transformer"):
        runs: dict[str, list[list[float]]] = {"per-session": [], "global": []}
        for _ in range(pairs):
            for mode in runs:
                cmd = [sys.executable, os.path.abspath(__file__), "--pool-child", mode, name]
                text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
                runs[mode].append([float(t) for t in text.split()])
        med = {m: statistics.median(statistics.median(r) for r in rs) for m, rs in runs.items()}
        fast = {m: statistics.median(min(r) for r in rs) for m, rs in runs.items()}
        out[f"{name} {THREADS}t"] = {
            m: {
                "median_ms": med[m],
                "min_ms": fast[m],
                "ratio_median": med[m] / med["per-session"],
                "ratio_min": fast[m] / fast["per-session"],
            }
            for m in runs
        }
    return out


def _pool_child(mode: str, name: str) -> None:
    """Print the ms of 30 numpy forward + backward steps of ``name`` (``mode``: per-session, global)."""
    import time

    if mode == "global":
        from onnxruntime.capi import _pybind_state

        _pybind_state.set_global_thread_pool_sizes(THREADS, 1)
        opts = ort.SessionOptions()
        opts.use_per_session_threads = False
    else:
        opts = _opts()
    torch.set_num_threads(1)
    fn = _numpy_step(name, opts)
    times = []
    for i in range(35):
        t0 = time.perf_counter()
        fn()
        if i >= 5:
            times.append((time.perf_counter() - t0) * 1e3)
    print(" ".join(f"{t:.4f}" for t in times))


# ---- nchwc: the blocked-layout Conv, prepacking, weights as inputs ------------------------------
def _forward_variants(name: str) -> tuple[dict[str, tuple[bytes, dict, ort.SessionOptions]], np.ndarray]:
    """The forward of ``name`` in three forms: weights as initializers (onnxruntime may reorder
    them to NCHWc and prepack them), the same with ``session.disable_prepacking``, and weights
    as graph inputs (as onnxgrad's sessions take trainable weights)."""
    from bench.compare_torch import _model

    module, x = _model(name)
    model = anchors.export(module, x[:1])
    as_inputs = copy.deepcopy(model)
    weights = {t.name: numpy_helper.to_array(t) for t in as_inputs.graph.initializer}
    del as_inputs.graph.initializer[:]
    as_inputs.graph.input.extend(
        helper.make_tensor_value_info(k, TensorProto.FLOAT, list(v.shape)) for k, v in weights.items()
    )
    feeds = {"input": x.numpy()}
    no_prepack = _opts()
    no_prepack.add_session_config_entry("session.disable_prepacking", "1")
    return {
        "weights as initializers": (model.SerializeToString(), feeds, _opts()),
        "initializers, disable_prepacking": (model.SerializeToString(), feeds, no_prepack),
        "weights as inputs (onnxgrad)": (as_inputs.SerializeToString(), {**feeds, **weights}, _opts()),
    }, x.numpy()


def _optimized_ops(model: bytes, options: ort.SessionOptions) -> dict[str, int]:
    """How many nodes of each (domain, op) onnxruntime's optimized graph holds."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "optimized.onnx")
        options.optimized_model_filepath = path
        ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        options.optimized_model_filepath = ""
        counts: dict[str, int] = {}
        for n in onnx.load(path).graph.node:
            key = f"{n.domain + '.' if n.domain else ''}{n.op_type}"
            counts[key] = counts.get(key, 0) + 1
    return counts


def nchwc() -> dict:
    out = {}
    for name in ("cnn", "vgg"):
        variants, _ = _forward_variants(name)
        fns = {}
        for label, (model, feeds, opts) in variants.items():
            ops = _optimized_ops(model, opts)
            print(f"  {name}, {label}: " + ", ".join(f"{k} {v}" for k, v in sorted(ops.items())))
            sess = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
            fns[label] = lambda s=sess, f=feeds: s.run(None, f)
        model, feeds, opts = variants["weights as inputs (onnxgrad)"]
        sess = ort.InferenceSession(model, _opts(), providers=["CPUExecutionProvider"])
        fns["A/A control: inputs again"] = lambda s=sess, f=feeds: s.run(None, f)
        out[f"{name} forward"] = timed(fns, calls=40, block=3)
    out.update(_nchwc_by_hand())
    out["external initializer updated in place"] = _stale_external()
    return out


def _blocked(w: str, o: int, i: int, k: int, block: int, tag: str) -> tuple[list, list]:
    """Nodes reordering weight ``w`` (O, I, k, k) into MLAS's NCHWc filter layout OIHWBiBo:
    ``(O/B, I/B, k, k, Bi, Bo)`` flattened back to (O, I, k, k); ordinary Reshape/Transpose ops."""
    s6, s4 = f"{tag}_s6", f"{tag}_s4"
    nodes = [
        helper.make_node("Reshape", [w, s6], [f"{tag}_w6"]),
        helper.make_node("Transpose", [f"{tag}_w6"], [f"{tag}_wt"], perm=[0, 2, 4, 5, 3, 1]),
        helper.make_node("Reshape", [f"{tag}_wt", s4], [f"{tag}_wb"]),
    ]
    inits = [
        numpy_helper.from_array(np.array([o // block, block, i // block, block, k, k], np.int64), s6),
        numpy_helper.from_array(np.array([o, i, k, k], np.int64), s4),
    ]
    return nodes, inits


def _nchwc_by_hand(block: int = 16) -> dict:
    """A 3x3 Conv (and its input gradient) of the VGG-style model's shapes with the weight as an
    input, written as ``com.microsoft.nchwc`` ops with the weight reordered by ordinary ops, against
    the generic Conv (and ConvTranspose) onnxgrad's graphs hold now and the initializer form.

    ``block``: MLAS's NCHWc block (16 with AVX-512, 8 with AVX2); the channel counts here are
    multiples of it, so no padding is needed.
    """
    out: dict = {}
    F = TensorProto.FLOAT
    conv = {"pads": [1, 1, 1, 1], "kernel_shape": [3, 3]}

    def mk(nodes: list, inputs: dict, inits: list = ()) -> bytes:
        graph = helper.make_graph(
            nodes,
            "conv",
            [helper.make_tensor_value_info(k, F, list(v.shape)) for k, v in inputs.items()],
            [helper.make_tensor_value_info("y", F, None)],
            list(inits),
        )
        opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft.nchwc", 1)]
        return helper.make_model(graph, opset_imports=opsets, ir_version=8).SerializeToString()

    for n, ci, co, hw in [(32, 32, 32, 32), (32, 32, 64, 16), (32, 64, 64, 16)]:
        rng = np.random.default_rng(0)
        x = rng.standard_normal((n, ci, hw, hw), dtype=np.float32)
        w = rng.standard_normal((co, ci, 3, 3), dtype=np.float32) * 0.1
        b = rng.standard_normal(co, dtype=np.float32)
        dy = rng.standard_normal((n, co, hw, hw), dtype=np.float32)
        relu_conv = [
            helper.make_node("Conv", ["x", "w", "b"], ["c"], **conv),
            helper.make_node("Relu", ["c"], ["y"]),
        ]
        reorder, inits = _blocked("w", co, ci, 3, block, "f")
        nchwc = "com.microsoft.nchwc"
        hand = [
            *reorder,
            helper.make_node("ReorderInput", ["x"], ["xb"], domain=nchwc),
            helper.make_node("Conv", ["xb", "f_wb", "b"], ["yb"], domain=nchwc, activation="Relu", **conv),
            helper.make_node("ReorderOutput", ["yb"], ["y"], domain=nchwc, channels=co),
        ]
        # dx = Conv(dy, W') with W'[i, o] = W[o, i] flipped in both spatial axes
        flip = [
            helper.make_node("Transpose", ["w"], ["wT"], perm=[1, 0, 2, 3]),
            helper.make_node("Slice", ["wT", "st", "en", "ax", "stp"], ["wf"]),
        ]
        reorder_t, inits_t = _blocked("wf", ci, co, 3, block, "t")
        slice_args = [
            numpy_helper.from_array(np.array(v, np.int64), k)
            for k, v in (("st", [-1, -1]), ("en", [-(2**62)] * 2), ("ax", [2, 3]), ("stp", [-1, -1]))
        ]
        dx_hand = [
            *flip,
            *reorder_t,
            helper.make_node("ReorderInput", ["dy"], ["db"], domain=nchwc),
            helper.make_node("Conv", ["db", "t_wb"], ["xg"], domain=nchwc, **conv),
            helper.make_node("ReorderOutput", ["xg"], ["y"], domain=nchwc, channels=ci),
        ]
        fwd_feeds, dx_feeds = {"x": x, "w": w, "b": b}, {"dy": dy, "w": w}
        weights = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")]
        cases = {
            f"forward Conv+Relu {ci}->{co} {hw}x{hw}": {
                "W input, generic Conv (now)": (mk(relu_conv, fwd_feeds), fwd_feeds),
                "W input, nchwc.Conv + reorder ops": (mk(hand, fwd_feeds, inits), fwd_feeds),
                "W initializer (onnxruntime's NCHWc)": (mk(relu_conv, {"x": x}, weights), {"x": x}),
            },
            f"input gradient {ci}->{co} {hw}x{hw}": {
                "ConvTranspose (now)": (
                    mk([helper.make_node("ConvTranspose", ["dy", "w"], ["y"], **conv)], dx_feeds),
                    dx_feeds,
                ),
                "nchwc.Conv of the flipped W": (mk(dx_hand, dx_feeds, inits_t + slice_args), dx_feeds),
            },
        }
        for case, forms in cases.items():
            fns, results = {}, {}
            for label, (model, feeds) in forms.items():
                sess = ort.InferenceSession(model, _opts(), providers=["CPUExecutionProvider"])
                results[label] = sess.run(None, feeds)[0]
                fns[label] = lambda s=sess, f=feeds: s.run(None, f)
            res = timed(fns, calls=40, block=3)
            ref = next(iter(results.values()))
            for label, got in results.items():
                res[label]["max_err_rel"] = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
            out[f"{case} batch {n}"] = res
    return out


def _external_placeholder(name: str, like: np.ndarray) -> onnx.TensorProto:
    """An initializer whose data lives outside the model (never read: supplied at session time)."""
    t = onnx.TensorProto(name=name, data_type=TensorProto.FLOAT, dims=list(like.shape))
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", "supplied.bin"), ("offset", "0"), ("length", str(like.nbytes))):
        entry = t.external_data.add()
        entry.key, entry.value = k, v
    return t


def _stale_external() -> dict:
    """Whether a Conv's weight given by ``add_external_initializers`` and then changed in place
    (as an optimizer updating the buffer would) changes the session's result."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 8, 3, 3), dtype=np.float32)
    x = rng.standard_normal((2, 8, 16, 16), dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])],
        "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [_external_placeholder("w", w)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    res = {}
    prepack_off = {"session.disable_prepacking": "1"}
    for label, entries, level in (
        ("default", {}, ort.GraphOptimizationLevel.ORT_ENABLE_ALL),
        ("disable_prepacking", prepack_off, ort.GraphOptimizationLevel.ORT_ENABLE_ALL),
        (
            "disable_prepacking, no layout optimizations",
            prepack_off,
            ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        ),
        ("disable_prepacking, no optimizations", prepack_off, ort.GraphOptimizationLevel.ORT_DISABLE_ALL),
    ):
        opts = _opts()
        opts.graph_optimization_level = level
        for k, v in entries.items():
            opts.add_session_config_entry(k, v)
        buf = w.copy()
        opts.add_external_initializers(["w"], [ort.OrtValue.ortvalue_from_numpy(buf)])
        sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        before = sess.run(None, {"x": x})[0]
        buf *= 2.0  # the update, in place
        after = sess.run(None, {"x": x})[0]
        res[label] = {"result_followed_update": float(np.allclose(after, 2 * before, rtol=1e-5, atol=1e-5))}
    return res


def blocked() -> dict:
    """The numpy forward + backward of vgg and cnn with :func:`onnxgrad.runtime.blocked_conv.blocked_convs`
    (Convs fed their weight on the NCHWc kernels) and without (the pass replaced by the identity
    while the sessions are made)."""
    import onnxgrad.runtime.runner as runner_module

    real = runner_module.blocked_convs
    out = {}
    for name in ("vgg", "cnn"):
        fns = {}
        for label, on in (
            ("generic Conv kernels (before)", False),
            ("blocked_convs (after)", True),
            ("A/A control: before again", False),
        ):
            runner_module.blocked_convs = real if on else (lambda model, providers, shapes_from=None: model)
            try:
                fn = _numpy_step(name, _opts())
                fn()  # makes the backward session under the same setting
            finally:
                runner_module.blocked_convs = real
            fns[label] = fn
        out[f"{name} forward+backward {THREADS}t"] = timed(fns, calls=30, block=3)
    return out


# ---- maxpool: each window's argmax from a forward ArgMax instead of MaxPool's Indices ----------------
def maxpool() -> dict:
    """The one-graph step and the numpy forward + backward of cnn and vgg with MaxPool's gradient
    routed from a forward window ArgMax (``rules/pool.py``, windows that tile X) and from the
    forward's Indices output (the rule's tiling test answering None while the graphs are built)."""
    from onnxgrad.autodiff.rules import pool

    real = pool._tiling
    out = {}
    keep: list = []
    for name, calls in (("cnn", 40), ("vgg", 15)):
        steps, fbs = {}, {}
        for label, on in (
            ("Indices (before)", False),
            ("window ArgMax (after)", True),
            ("A/A control: before again", False),
        ):
            pool._tiling = real if on else (lambda n, x, nsp: None)
            try:
                steps[label] = _onegraph_step(name, _opts(), keep)
                fbs[label] = _numpy_step(name, _opts())
                fbs[label]()  # builds the gradient graphs under the same setting
            finally:
                pool._tiling = real
        out[f"{name} one-graph step {THREADS}t"] = timed(steps, calls=calls, block=3)
        out[f"{name} forward+backward {THREADS}t"] = timed(fbs, calls=calls, block=3)
    return out


SECTIONS = {
    "rules": rules,
    "adamw": adamw,
    "denormal": denormal,
    "threads": threads,
    "globalpool": global_pool,
    "nchwc": nchwc,
    "blocked": blocked,
    "maxpool": maxpool,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    parser.add_argument("--rounds", type=int, default=1, help="repeat each section")
    parser.add_argument("--pool-child", nargs=2, metavar=("MODE", "MODEL"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.pool_child:
        _pool_child(*args.pool_child)
        return 0
    torch.set_num_threads(THREADS)
    m = machine()
    print(", ".join(f"{k}: {v}" for k, v in m.items() if k != "flags"))
    for sec in args.sections:
        for r in range(args.rounds):
            res = SECTIONS[sec]()
            print(f"\n[{sec}] round {r + 1}")
            for case, variants in res.items():
                print(f"  {case}")
                for k, v in variants.items():
                    print(f"    {k:40s} " + "  ".join(f"{f} {x:.4g}" for f, x in v.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
