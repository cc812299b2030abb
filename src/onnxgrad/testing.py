"""The correctness harness: gradients against central finite differences.

:func:`check_gradients` compares the backward graph of any model with finite differences of its
forward graph, in float64, through onnxruntime or ``onnx.reference`` (for ops onnxruntime has no
float64 kernel for). :func:`node_model` and :func:`check_op` make one-node models so each rule is
checked in isolation, at any shape; :func:`check_nodes` checks every node of a model that way, at the
values the model computes. The command ``onnxgrad check`` is :func:`check_nodes` and
:func:`check_gradients` on random inputs. :func:`assert_allclose_scaled` compares two float32
results of one computation done in different orders, with a bound that scales with their magnitude;
:func:`cancellation_bound` is the rounding residue of a float32 sum whose terms cancel.
"""

from __future__ import annotations

import inspect
import math
import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from .autodiff.engine import GradientGraphs, build_gradient
from .autodiff.registry import lookup
from .errors import GradientNotImplementedError, InputError
from .model.graph import (
    FLOAT_TYPES,
    all_subgraphs,
    ir_version_for,
    np_dtype,
    onnx_dtype,
    opset_of,
    topological_order,
)
from .model.infer import infer_value_infos
from .model.load import load_checked
from .model.pythonop_spec import has_python_nodes
from .runtime.runner import make_session
from .runtime.values import contiguous, from_numpy

Backend = Literal["onnxruntime", "reference"]


def run_model(model: onnx.ModelProto, backend: Backend = "onnxruntime") -> Any:
    """A function feeds -> {output name: array} running ``model`` on ``backend``.

    onnxruntime runs at the basic optimization level: its extended fusions (e.g. FusedMatMul) are
    float32-only and would reject float64 graphs. A graph holding PythonOp / PythonOpGrad nodes runs
    as the doors run it, whatever ``backend`` says (:func:`_python_runner`).
    """
    names = [o.name for o in model.graph.output]
    if has_python_nodes(model):
        return _python_runner(model, names)
    if backend == "reference":
        from onnx.reference import ReferenceEvaluator

        ev = ReferenceEvaluator(model, new_ops=_precise_ops())
        return lambda feeds: dict(zip(names, ev.run(None, dict(feeds))))
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    opts.log_severity_level = 3
    opts.intra_op_num_threads = 1  # test models are tiny: threads only add contention
    sess = make_session(model, ["CPUExecutionProvider"], opts)
    return lambda feeds: dict(zip(names, sess.run(None, dict(feeds))))


def _python_runner(model: onnx.ModelProto, names: list[str]) -> Any:
    """feeds -> {output name: array} for a graph holding PythonOp / PythonOpGrad nodes: onnxruntime
    stages around calls of the registered Functions (:class:`~onnxgrad.pythonop.executor.PythonGraph`,
    what ``ForwardBackward`` and the other doors run), in training mode. The values of the latest
    call stay alive until the next one, so a forward's ctx handles reach the backward run after it."""
    from .pythonop.executor import PythonGraph  # imports torch: only for graphs that need it

    graph = PythonGraph(model, ["CPUExecutionProvider"])
    latest: list[Any] = []

    def run(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        arrays = {k: contiguous(np.asarray(v)) for k, v in feeds.items()}
        env = graph.run({k: from_numpy(a) for k, a in arrays.items()}, names, True)
        latest[:] = [arrays, env]
        return {n: np.array(env[n].numpy(), copy=True) for n in names}

    return run


def _precise_ops() -> list[type]:
    """Replacements for onnx.reference kernels: Erf and Gelu in float64, grouped ConvTranspose fixed."""
    from onnx.reference.op_run import OpRun
    from onnx.reference.ops.op_conv_transpose import ConvTranspose as _RefConvTranspose

    erf = np.vectorize(math.erf, otypes=[np.float64])

    class Erf(OpRun):
        op_domain = ""

        def _run(self, x):  # type: ignore[override]
            return (erf(x).astype(x.dtype),)

    class Gelu(OpRun):
        op_domain = ""

        def _run(self, x, approximate="none"):  # type: ignore[override]
            if approximate == "tanh":
                y = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
            else:
                y = 0.5 * x * (1 + erf(x / math.sqrt(2)))
            return (y.astype(x.dtype),)

    class ConvTranspose(OpRun):
        """onnx 1.23's ConvTranspose slices W by output channel when group > 1: run group by group."""

        op_domain = ""

        def _run(self, X, W, B=None, group=None, **kw):  # type: ignore[override]
            run = _RefConvTranspose._run  # the reference implementation, one group at a time
            group = group or 1
            if group == 1:
                return run(self, X, W, B, group=1, **kw)
            c = X.shape[1] // group
            parts = [
                run(self, X[:, i * c : (i + 1) * c], W[i * c : (i + 1) * c], None, group=1, **kw)[0]
                for i in range(group)
            ]
            y = np.concatenate(parts, axis=1)
            if B is not None:
                y = y + B.reshape(1, -1, *(1,) * (y.ndim - 2))
            return (y.astype(X.dtype),)

    return [Erf, Gelu, ConvTranspose]


def _backward(
    graphs: GradientGraphs,
    bwd: Any,
    values: Mapping[str, np.ndarray],
    out: Mapping[str, np.ndarray],
    cot: Mapping[str, np.ndarray],
) -> dict[str, np.ndarray]:
    feeds = {s: out[s] if s in out else values[s] for s in graphs.saved}
    feeds.update({graphs.grad_inputs[o]: c for o, c in cot.items()})
    res = bwd(feeds)
    return {w: res[name] for w, name in graphs.grad_outputs.items()}


def run_gradients(
    graphs: GradientGraphs,
    feeds: Mapping[str, np.ndarray],
    grad_outputs: Mapping[str, np.ndarray] | None = None,
    backend: Backend = "onnxruntime",
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Run forward then backward graphs on ``backend``: (outputs, gradients by wrt name).

    Trainable values take their initializer values; ``grad_outputs=None`` means ones.
    """
    inits = {i.name: numpy_helper.to_array(i) for i in graphs.forward.graph.initializer}
    values = {**{t: inits[t] for t in graphs.trainable}, **feeds}
    out = run_model(graphs.forward, backend)(values)
    if grad_outputs is None:
        grad_outputs = {o: np.ones_like(out[o]) for o in graphs.grad_inputs}
    cot = {o: grad_outputs.get(o, np.zeros_like(out[o])) for o in graphs.grad_inputs}
    bwd = run_model(graphs.backward, backend)
    return out, _backward(graphs, bwd, values, out, cot)


@dataclass
class Mismatch:
    """One probed element: the analytic gradient and the central finite difference."""

    name: str
    index: tuple[int, ...]
    analytic: float
    numeric: float


@dataclass
class NonDifferentiable(Mismatch):
    """An element where the function has a kink within the step (a ReLU zero, a pooling or argmax
    tie): the one-sided slopes ``left`` and ``right`` disagree and the analytic gradient lies between
    them, so the central difference (their mean) cannot judge it."""

    left: float = math.nan
    right: float = math.nan


@dataclass
class GradCheckResult:
    """Analytic and numeric gradients, and where they disagree.

    ``mismatches``: elements where the gradient is wrong (the check fails); ``nondiff``: elements
    where the function is not differentiable within the finite-difference step, left out of the
    comparison and of ``max_error`` (see :func:`check_gradients`); ``probed``: elements compared,
    by value; ``unprobed``: elements chosen but left out because the finite-difference step is lost
    in rounding at their magnitude (``finfo(float32).min`` in an attention mask: ``x ± h == x``),
    by value. A result that probed no element (:attr:`checked` 0) checked nothing: not a pass.
    """

    analytic: dict[str, np.ndarray]
    numeric: dict[str, np.ndarray]  # NaN where an element was not probed
    mismatches: list[Mismatch] = field(default_factory=list)
    max_error: dict[str, float] = field(default_factory=dict)
    nondiff: list[NonDifferentiable] = field(default_factory=list)
    probed: dict[str, int] = field(default_factory=dict)
    unprobed: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.mismatches

    @property
    def checked(self) -> int:
        """The number of elements compared, over every value."""
        return sum(self.probed.values())

    def unprobed_note(self) -> str:
        """``'k elements not probed: ...'``, or ``''`` when every chosen element was."""
        n = sum(self.unprobed.values())
        if not n:
            return ""
        return f"{n} element(s) not probed: the step is lost in rounding at their magnitude"

    def nondiff_note(self) -> str:
        """``'not differentiable within the step at k of n elements'``, or ``''`` when none was."""
        if not self.nondiff:
            return ""
        probed = sum(self.probed.values())
        return f"not differentiable within the step at {len(self.nondiff)} of {probed} elements"

    def report(self) -> str:
        lines = [f"{'value':40s} {'max |analytic - numeric|':>26s}  status"]
        bad = {m.name for m in self.mismatches}
        kinks = Counter(m.name for m in self.nondiff)
        for name, err in self.max_error.items():
            status = "FAIL" if name in bad else "ok"
            if kinks[name]:
                status += f" ({kinks[name]} of {self.probed.get(name, 0)} not differentiable within the step)"
            lines.append(f"{name:40s} {err:26.3e}  {status}")
        for m in self.mismatches[:10]:
            lines.append(f"  {m.name}{list(m.index)}: analytic {m.analytic:.8g}, numeric {m.numeric:.8g}")
        for k in self.nondiff[: 10 if not self.mismatches else 0]:
            lines.append(
                f"  {k.name}{list(k.index)}: NONDIFF, analytic {k.analytic:.8g}, one-sided slopes "
                f"{k.left:.8g} and {k.right:.8g}"
            )
        return "\n".join(lines)


def check_gradients(
    model: onnx.ModelProto | str | os.PathLike | bytes,
    feeds: Mapping[str, np.ndarray],
    *,
    wrt: Iterable[str] | None = None,
    backend: Backend = "onnxruntime",
    eps: float | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    max_elements: int = 48,
    seed: int = 0,
    graphs: GradientGraphs | None = None,
) -> GradCheckResult:
    """Compare onnxgrad's gradients of ``model`` with central finite differences.

    The scalar differentiated is ``sum_i <c_i, output_i>`` with random cotangents ``c_i``.
    ``wrt``: initializer and input names (``None``: every floating-point initializer and input).
    At most ``max_elements`` elements per value are probed (chosen at random, seeded).

    Tolerances: given ``rtol`` or ``atol``, an element agrees when ``|analytic - numeric| <= atol +
    rtol |numeric|`` (the other defaulting to 1e-5 / 1e-7, or 5e-2 / 5e-3 for float32 values).
    Without either, the bound is derived from the computation (:class:`_Bounds`): the rounding of
    the two evaluations of the scalar over the outputs the step moved (:func:`cancellation_bound`
    of those terms, and of the element's own ``|analytic x|``, in the outputs' precision, two
    roundings per node of the graph), divided by the step; plus the rounding of the analytic
    gradient itself (the same bound over every output, at the scale of that gradient); plus what
    the kernels may miss: float64 keeps the fixed 1e-7 + 1e-5 |numeric| (onnxruntime computes
    some float64 kernels, DFT, attention, through steps accurate to ~1e-7), lower precisions
    1e-4 (|numeric| + the gradient's scale). Where the differences at ``h`` and ``h / 2``
    disagree beyond the noise (truncation: a curved function, float32's large step), the
    central difference is refined by Richardson's extrapolation ``(4 D(h/2) - D(h)) / 3``. So a
    float32 rule 0.1-1 % off fails, and a float64 one with inputs of 1e4 passes.

    An element whose central difference disagrees is tested for a kink within the step (a ReLU zero,
    a pooling or argmax tie, where the central difference averages two slopes): the one-sided slopes
    ``(f(x+h) - f(x)) / h`` and ``(f(x) - f(x-h)) / h`` and the central difference at ``h / 2`` are
    computed; when the function is not smooth within the step (the two slopes disagree, or the
    central differences at ``h`` and ``h / 2`` do) and the analytic gradient is one of the one-sided
    slopes (at ``h`` or ``h / 2``) or the central difference at ``h / 2``, the element goes to
    ``nondiff``, not to the mismatches. A wrong gradient at a smooth point still fails (there both
    slopes and both central differences agree), and so does one at a kink that is none of the slopes.
    """
    check_settings(max_elements=max_elements, rtol=rtol, atol=atol, eps=eps)
    checked = load_checked(model)
    proto = checked.proto
    inits = {i.name: i for i in proto.graph.initializer}
    inputs = {i.name: i for i in proto.graph.input if i.name not in inits}
    if wrt is None:
        trainable = [n for n, t in inits.items() if t.data_type in FLOAT_TYPES]
        req = [n for n in inputs if n in feeds and np.asarray(feeds[n]).dtype.kind == "f"]
    else:
        wrt = list(wrt)
        trainable = [w for w in wrt if w in inits]
        req = [w for w in wrt if w not in inits]
    if graphs is None:
        graphs = build_gradient(checked, trainable=trainable, inputs_requiring_grad=req, tie_weights=False)
    fwd, bwd = run_model(graphs.forward, backend), run_model(graphs.backward, backend)
    params = {n: numpy_helper.to_array(inits[n]) for n in graphs.trainable}
    values = {**{k: np.asarray(v) for k, v in feeds.items()}, **params}
    low_precision = any(v.dtype != np.float64 for k, v in values.items() if k in graphs.grad_outputs)
    eps = eps if eps is not None else (1e-3 if low_precision else 1e-6)
    derived = rtol is None and atol is None  # else the caller's tolerances, the others defaulted
    floor_rtol, floor_atol = (0.0, 0.0) if low_precision else (1e-5, 1e-7)  # float64's fixed part
    rtol = rtol if rtol is not None else (5e-2 if low_precision else 1e-5)
    atol = atol if atol is not None else (5e-3 if low_precision else 1e-7)

    rng = np.random.default_rng(seed)
    out = fwd(values)
    cot = {o: rng.standard_normal(np.shape(out[o])).astype(out[o].dtype) for o in graphs.grad_inputs}

    def scalar(res: Mapping[str, np.ndarray]) -> float:
        return float(sum(np.sum(res[o].astype(np.float64) * cot[o]) for o in cot))

    def loss(vals: Mapping[str, np.ndarray]) -> float:
        return scalar(fwd(vals))

    def change(plus: Mapping[str, np.ndarray], minus: Mapping[str, np.ndarray]) -> float:
        """``Σ c (y+ - y-)``: the scalar's change as a sum of differences, so that outputs the
        step leaves alone add exactly 0 however large they are (a masked score of -3.4e38)."""
        return float(
            sum(np.sum((plus[o].astype(np.float64) - minus[o].astype(np.float64)) * cot[o]) for o in cot)
        )

    # what the scalar's rounding hides: each output is rounded in its dtype, so a change of the
    # scalar below ~ Σ |c y| eps cannot be told from noise (outputs of 3.4e38, a masked score)
    out_eps = max((float(np.finfo(out[o].dtype).eps) for o in cot if out[o].dtype.kind == "f"), default=0.0)
    resolution = 4 * out_eps * sum(float(np.sum(np.abs(out[o].astype(np.float64) * cot[o]))) for o in cot)
    nothing_out = not any(np.size(out[o]) for o in cot)  # empty outputs: the scalar is 0, whatever

    analytic = _backward(graphs, bwd, values, out, cot)
    bounds = _Bounds(graphs, values, out, cot, analytic, floor_rtol, floor_atol)

    result = GradCheckResult(analytic=analytic, numeric={})
    at_x: list[float] = []  # f(x), computed on the first kink test

    def kink(
        vals: dict[str, np.ndarray], w: str, idx: tuple, f_plus: float, f_minus: float, a: float, noise: float
    ) -> Any:
        """``(left, right)`` slopes when element ``idx`` of ``w`` is not differentiable within the
        step and ``a`` is one of its one-sided slopes (at ``eps`` or ``eps / 2``), else ``None``."""
        if not at_x:
            at_x.append(loss(vals))
        f0, base = at_x[0], vals[w]
        slopes = []
        for step, (fp, fm) in ((eps, (f_plus, f_minus)), (eps / 2, (None, None))):
            plus, minus = base.copy(), base.copy()
            plus[idx] += step
            minus[idx] -= step
            if fp is None:
                fp, fm = loss({**vals, w: plus}), loss({**vals, w: minus})
            hp, hm = float(plus[idx] - base[idx]), float(base[idx] - minus[idx])  # as the dtype has them
            slopes.append(((f0 - fm) / hm, (fp - f0) / hp, (fp - fm) / (hp + hm)))
        (left, right, central), (left2, right2, central2) = slopes
        largest = max(abs(left), abs(right), abs(central))
        # one-sided slopes carry twice the noise of the central difference, their difference four
        tol = 4 * noise + bounds.allowed(w, largest) if derived else atol + rtol * largest
        smooth = abs(left - right) <= tol and abs(central - central2) <= tol
        if smooth or not any(abs(a - s) <= tol for s in (left, right, left2, right2, central2)):
            return None
        return left, right

    for w in graphs.grad_outputs:
        base = values[w]
        num = np.full(base.shape, np.nan)
        flat_idx = np.arange(base.size) if not nothing_out else np.arange(0)
        if base.size > max_elements and not nothing_out:
            flat_idx = rng.choice(base.size, max_elements, replace=False)
        worst, lost = 0.0, 0
        for k in flat_idx:
            idx = np.unravel_index(k, base.shape)
            plus, minus = base.copy(), base.copy()
            plus[idx] += eps
            minus[idx] -= eps
            hp, hm = float(plus[idx]) - float(base[idx]), float(base[idx]) - float(minus[idx])
            if not (hp > 0 and hm > 0 and math.isfinite(hp + hm)):
                lost += 1  # x ± eps == x at this magnitude (or overflows): no difference to take
                continue
            r_plus, r_minus = fwd({**values, w: plus}), fwd({**values, w: minus})
            f_plus, f_minus, moved = scalar(r_plus), scalar(r_minus), change(r_plus, r_minus)
            num[idx] = moved / (hp + hm)  # the step as the dtype holds it
            a = float(analytic[w][idx])
            err = abs(a - num[idx])
            where = tuple(int(i) for i in idx)
            noise = bounds.noise(r_plus, r_minus, a * float(base[idx]), hp + hm) if derived else 0.0
            if derived and np.isfinite(a) and err > noise + bounds.allowed(w, abs(num[idx])):
                half = _half_step(fwd, change, values, w, idx, eps / 2)
                # the two differences disagree beyond their noise: truncation, which Richardson removes
                if half is not None and abs(half - num[idx]) > 3 * noise:
                    refined = (4 * half - num[idx]) / 3
                    if abs(a - refined) <= 3 * noise + bounds.allowed(w, abs(refined)):
                        worst = max(worst, abs(a - refined))
                        continue
            tol = noise + bounds.allowed(w, abs(num[idx])) if derived else atol + rtol * abs(num[idx])
            if not np.isfinite(a) or err > tol:
                if abs(a) * (hp + hm) <= resolution and abs(moved) <= resolution:
                    lost += 1  # the step's effect is below the rounding of the scalar: unjudgeable
                    num[idx] = np.nan
                    continue
                sides = kink(values, w, idx, f_plus, f_minus, a, noise) if np.isfinite(a) else None
                if sides is not None:
                    result.nondiff.append(NonDifferentiable(w, where, a, float(num[idx]), *sides))
                    continue
                result.mismatches.append(Mismatch(w, where, a, float(num[idx])))
            worst = max(worst, err)
        result.numeric[w] = num
        result.max_error[w] = worst
        result.probed[w] = len(flat_idx) - lost
        if lost:
            result.unprobed[w] = lost
        if analytic[w].shape != base.shape or analytic[w].dtype != base.dtype:
            result.mismatches.append(Mismatch(w, (), float("nan"), float("nan")))
    return result


class _Bounds:
    """The rounding a gradient check must allow, from the computation checked (see
    :func:`check_gradients`): the noise of a central difference, and the rounding of each analytic
    gradient."""

    def __init__(
        self,
        graphs: GradientGraphs,
        values: Mapping[str, np.ndarray],
        out: Mapping[str, np.ndarray],
        cot: Mapping[str, np.ndarray],
        analytic: Mapping[str, np.ndarray],
        floor_rtol: float,
        floor_atol: float,
    ) -> None:
        self.cot = cot
        nodes = len(graphs.forward.graph.node) + sum(len(g.node) for g in all_subgraphs(graphs.forward.graph))
        self.roundings = 1 + 2 * nodes  # a node rounds what it computes, its kernel steps once more
        floats = [
            np.asarray(v).dtype for v in [*out.values(), *values.values()] if np.asarray(v).dtype.kind == "f"
        ]
        self.dtype = max(floats, key=lambda d: np.finfo(d).eps, default=np.dtype(np.float64))
        terms = sum(int(np.size(out[o])) for o in cot)
        self.analytic = {
            w: cancellation_bound(
                max(terms, 1), _largest(g), g.dtype if g.dtype.kind == "f" else self.dtype, self.roundings
            )
            for w, g in analytic.items()
        }
        # what the kernels may miss, beyond rounding: relative, and at the gradient's scale
        self.kernel = 0.0 if floor_rtol else max(1e-4, 8 * float(np.finfo(self.dtype).eps))
        self.floor_rtol, self.floor_atol = floor_rtol, floor_atol
        self.scale = {w: _largest(g) for w, g in analytic.items()}

    def allowed(self, w: str, magnitude: float) -> float:
        """What the analytic gradient of ``w`` may differ by, besides the finite difference's noise,
        at an element of that ``magnitude``: its own rounding and the kernels' accuracy."""
        kernels = self.kernel * (magnitude + self.scale[w]) + self.floor_atol + self.floor_rtol * magnitude
        return self.analytic[w] + kernels

    def noise(
        self, plus: Mapping[str, np.ndarray], minus: Mapping[str, np.ndarray], sensitivity: float, step: float
    ) -> float:
        """The rounding error of ``(f(x+h) - f(x-h)) / step``: each evaluation of the scalar is off by
        the rounding of the terms ``c y`` the step moved, and of the element's own ``sensitivity``
        (``analytic * x``), in the outputs' precision."""
        count, top = 1, abs(sensitivity)
        for o, c in self.cot.items():
            moved = np.asarray(plus[o] != minus[o])
            if moved.any():
                count += int(moved.sum())
                terms = np.abs(
                    np.stack([plus[o], minus[o]])[:, moved].astype(np.float64) * np.asarray(c)[moved]
                )
                top = max(top, _largest(terms))
        return 2 * cancellation_bound(count, top, self.dtype, self.roundings) / step


def _largest(values: np.ndarray) -> float:
    """The largest finite magnitude in ``values`` (0 when none is)."""
    finite = np.abs(np.asarray(values, np.float64))
    finite = finite[np.isfinite(finite)]
    return float(finite.max()) if finite.size else 0.0


def _half_step(
    fwd: Any, change: Any, values: Mapping[str, np.ndarray], w: str, idx: tuple, half: float
) -> float | None:
    """The central difference of element ``idx`` of ``w`` at the step ``half``; None where that
    step is lost in rounding."""
    base = values[w]
    plus, minus = base.copy(), base.copy()
    plus[idx] += half
    minus[idx] -= half
    hp, hm = float(plus[idx]) - float(base[idx]), float(base[idx]) - float(minus[idx])
    if not (hp > 0 and hm > 0 and math.isfinite(hp + hm)):
        return None
    return float(change(fwd({**values, w: plus}), fwd({**values, w: minus})) / (hp + hm))


def result_status(result: GradCheckResult) -> str:
    """``"FAIL"`` (a mismatch), ``"EMPTY"`` (no element compared: nothing was checked, which is
    not a pass), ``"NONDIFF"`` (agreement where differentiable) or ``"ok"``."""
    if not result.ok:
        return "FAIL"
    if not result.checked:
        return "EMPTY"
    return "NONDIFF" if result.nondiff else "ok"


def check_settings(
    *,
    max_elements: Any = 1,
    rtol: float | None = None,
    atol: float | None = None,
    eps: float | None = None,
    names: Mapping[str, str] | None = None,
) -> None:
    """Refuse settings under which a gradient check would check nothing or anything: an
    :class:`InputError` for ``max_elements`` not an integer >= 1, a negative or non-finite ``rtol``
    / ``atol``, an ``eps`` not > 0. ``names``: how the caller calls each setting in the message
    (``onnxgrad check``: ``--max-elements``...). Called by :func:`check_gradients`,
    :func:`check_nodes` and ``onnxgrad check`` before any model runs."""
    names = dict(names or {})
    if isinstance(max_elements, bool) or not isinstance(max_elements, int | np.integer) or max_elements < 1:
        flag = names.get("max_elements", "max_elements")
        raise InputError(f"{flag} must be an integer >= 1 (elements probed per value), got {max_elements!r}")
    for key, value in (("rtol", rtol), ("atol", atol)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise InputError(f"{names.get(key, key)} must be a finite number >= 0, got {value}")
    if eps is not None and not (math.isfinite(eps) and eps > 0):
        raise InputError(f"{names.get('eps', 'eps')} must be a finite number > 0, got {eps}")


def node_model(
    op_type: str,
    inputs: Sequence[np.ndarray | None],
    *,
    attrs: Mapping[str, Any] | None = None,
    n_outputs: int = 1,
    opset: int = 18,
    domain: str = "",
    constant: Iterable[int] = (),
    dynamic: bool = False,
    output_dtypes: Sequence[np.dtype | type] | None = None,
) -> onnx.ModelProto:
    """A model with one ``op_type`` node, for testing its rule.

    Floating-point inputs become graph inputs ``in0``, ``in1``... (with symbolic dims when
    ``dynamic``); integer and bool inputs, and those whose index is in ``constant``, become
    initializers; ``None`` is an absent optional input. Outputs are ``out0``, ``out1``...
    """
    constant = set(constant)
    graph_inputs, inits, names = [], [], []
    for i, arr in enumerate(inputs):
        if arr is None:
            names.append("")
            continue
        arr = np.asarray(arr)
        name = f"in{i}"
        names.append(name)
        if arr.dtype.kind == "f" and i not in constant:
            shape = [f"d{i}_{j}" for j in range(arr.ndim)] if dynamic else list(arr.shape)
            graph_inputs.append(helper.make_tensor_value_info(name, onnx_dtype(arr.dtype), shape))
        else:
            inits.append(numpy_helper.from_array(arr, name))
    first = next(np.asarray(a).dtype for a in inputs if a is not None and np.asarray(a).dtype.kind == "f")
    dtypes = list(output_dtypes) if output_dtypes is not None else [first] * n_outputs
    outs = [helper.make_tensor_value_info(f"out{k}", onnx_dtype(dtypes[k]), None) for k in range(n_outputs)]
    node = helper.make_node(op_type, names, [o.name for o in outs], domain=domain or None, **(attrs or {}))
    graph = helper.make_graph([node], f"test_{op_type}", graph_inputs, outs, initializer=inits)
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = ir_version_for(model.opset_import)
    return onnx.shape_inference.infer_shapes(model)


# the keywords of node_model, which check_op passes on to it
_NODE_MODEL_OPTIONS = frozenset(
    p.name for p in inspect.signature(node_model).parameters.values() if p.kind is p.KEYWORD_ONLY
)


def check_op(
    op_type: str,
    inputs: Sequence[np.ndarray | None],
    *,
    backend: Backend = "onnxruntime",
    **options: Any,
) -> GradCheckResult:
    """Check the rule of ``op_type`` on these inputs; raises ``AssertionError`` with a report on failure.

    ``options``: those of :func:`node_model` (``attrs``, ``n_outputs``, ``opset``, ``domain``,
    ``constant``, ``dynamic``, ``output_dtypes``) make the one-node model; the others (``eps``,
    ``rtol``, ``atol``, ``max_elements``, ``seed``) are :func:`check_gradients`'s."""
    model = node_model(op_type, inputs, **{k: options.pop(k) for k in _NODE_MODEL_OPTIONS & options.keys()})
    feeds = {i.name: np.asarray(inputs[int(i.name[2:])]) for i in model.graph.input}
    wrt = [i.name for i in model.graph.input] + [
        t.name for t in model.graph.initializer if t.data_type in FLOAT_TYPES
    ]
    result = check_gradients(model, feeds, wrt=wrt, backend=backend, **options)
    if not result.ok:
        raise AssertionError(f"gradient check of {op_type} failed:\n{result.report()}")
    return result


# ---- every node of a model ---------------------------------------------------------------------
@dataclass
class NodeCheck:
    """The gradient check of one node of a model, on its own (:func:`check_nodes`).

    ``status``: ``"ok"``, ``"FAIL"``, ``"skipped"``, ``"EMPTY"`` (no element to compare: the node's
    values are empty, or every chosen element was unprobeable) or ``"NONDIFF"`` (the elements where
    the node is differentiable within the step agree, the others were left out: ``note`` says how
    many, and the elements are in ``result.nondiff``); ``checked_in``: precision and backend (``"-"``
    when not checked); ``max_error``: the largest difference found, formatted; ``note``: why a node
    was skipped or could not be checked; ``result``: the comparison, when one ran.
    """

    name: str
    op_type: str
    status: str
    checked_in: str = "-"
    max_error: str = "-"
    note: str = ""
    result: GradCheckResult | None = None


def check_nodes(
    model: onnx.ModelProto,
    feeds: Mapping[str, np.ndarray],
    *,
    rtol: float | None = None,
    atol: float | None = None,
    max_elements: int = 48,
    seed: int = 0,
) -> list[NodeCheck]:
    """Check the gradient rule of every node of ``model``'s main graph on its own, at the values the
    whole model computes from ``feeds`` (``Constant`` nodes left out).

    Each node becomes a one-node model (:func:`node_model`) checked with :func:`check_gradients`;
    a float32 node is checked in float64 where its attributes do not fix a dtype, so that a real
    error cannot hide in float32 noise. Control-flow nodes are skipped (the whole model checks them).
    """
    check_settings(max_elements=max_elements, rtol=rtol, atol=atol)
    values = model_values(model, feeds)
    infos = infer_value_infos(model)
    tolerances = {k: v for k, v in (("rtol", rtol), ("atol", atol)) if v is not None}
    checks = []
    for k, node in enumerate(topological_order(model.graph)):
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            continue
        check = NodeCheck(node.name or f"#{k}", node.op_type, "skipped")
        _check_node(check, node, model, values, infos, max_elements, seed, tolerances)
        checks.append(check)
    return checks


def model_values(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every value of the main graph at ``feeds``: inputs, initializers and each node output."""
    infos = infer_value_infos(model)
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    have = {o.name for o in probe.graph.output}
    for node in probe.graph.node:
        for o in node.output:
            if o and o not in have and o in infos:
                probe.graph.output.append(infos[o].to_proto())
                have.add(o)
    values = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    values.update(feeds)
    values.update(run_model(probe)(dict(feeds)))
    return values


def _check_node(
    check: NodeCheck,
    node: onnx.NodeProto,
    model: onnx.ModelProto,
    values: Mapping[str, np.ndarray],
    infos: Mapping[str, Any],
    max_elements: int,
    seed: int,
    tolerances: Mapping[str, float],
) -> None:
    """Fill ``check`` with the result of checking ``node`` on its own."""
    domain = "" if node.domain == "ai.onnx" else node.domain
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
        check.note = "control flow: checked with the whole model"
        return
    inputs = [values.get(i) if i else None for i in node.input]
    if any(i and values.get(i) is None for i in node.input):
        check.note = "an input value is unknown"
        return
    out_infos = [infos.get(o) for o in node.output]
    if not any(np.asarray(a).dtype.kind == "f" for a in inputs if a is not None):
        check.note = "no floating-point input"
        return
    if not any(i is not None and i.is_float for i in out_infos):
        check.note = "no floating-point output"
        return
    check.status = "FAIL"
    opset = opset_of(model, domain) or 1
    if lookup(domain, node.op_type, opset) is None:
        check.note = "no gradient rule"
        return
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    out_dtypes = [np_dtype(i.dtype) if i is not None else np.dtype(np.float32) for i in out_infos]
    attempts = []
    floats = {np.asarray(a).dtype for a in inputs if a is not None and np.asarray(a).dtype.kind == "f"}
    # float32 nodes are checked in float64 where the op allows it: finite differences are then exact
    # to ~1e-9 and a real error cannot hide in float32 noise. Ops whose attributes fix a dtype are not.
    if floats == {np.dtype(np.float32)} and not {"to", "dtype"} & set(attrs):
        up = [a.astype(np.float64) if a is not None and a.dtype == np.float32 else a for a in inputs]
        up_out = [np.dtype(np.float64) if d == np.float32 else d for d in out_dtypes]
        attempts += [(up, up_out, "float64", "onnxruntime"), (up, up_out, "float64", "reference")]
    attempts.append((inputs, out_dtypes, "/".join(sorted(str(f) for f in floats)), "onnxruntime"))
    error: Exception | None = None

    def build(
        arrays: list[np.ndarray | None], dtypes: list[np.dtype]
    ) -> tuple[onnx.ModelProto, dict[str, Any], list[str]]:
        """The one-node model of ``arrays``, its feeds and the names to differentiate."""
        single = node_model(
            node.op_type,
            arrays,
            attrs=attrs,
            n_outputs=len(node.output),
            opset=opset_of(model) or 18,
            domain=domain,
            output_dtypes=dtypes,
        )
        _declare_output_shapes(single, [values.get(o) for o in node.output])
        feeds = {i.name: arrays[int(i.name[2:])] for i in single.graph.input}
        wrt = [i.name for i in single.graph.input] + [
            t.name for t in single.graph.initializer if t.data_type in FLOAT_TYPES
        ]
        return single, feeds, wrt

    def run(arrays: list[np.ndarray | None], dtypes: list[np.dtype], backend: Backend) -> GradCheckResult:
        single, feeds, wrt = build(arrays, dtypes)
        return check_gradients(
            single, feeds, wrt=wrt, backend=backend, max_elements=max_elements, seed=seed, **tolerances
        )

    for arrays, dtypes, precision, backend in attempts:
        tied = ""
        used = arrays  # the inputs the reported check ran at
        try:
            result = run(arrays, dtypes, backend)
            if not result.ok and node.op_type in _SELECTING:
                # a maximum over tied values: check next to the tie, where one element is the maximum
                moved, tied = _break_ties(arrays, seed)
                retry = run(moved, dtypes, backend) if tied else result
                result, tied, used = (retry, tied, moved) if retry.ok else (result, "", arrays)
        except GradientNotImplementedError as exc:
            check.checked_in, check.note = precision, " ".join(str(exc).split())
            return
        except Exception as exc:  # this precision or backend cannot run the node: try the next
            error = exc
            continue
        worst = max(result.max_error.values(), default=0.0)
        check.status = result_status(result)
        check.note = "; ".join(n for n in (tied, result.nondiff_note(), result.unprobed_note()) if n)
        check.checked_in, check.max_error, check.result = f"{precision} {backend}", f"{worst:.2e}", result
        symbolic = {i: _symbolic_axes(infos.get(name)) for i, name in enumerate(node.input) if name}
        if result.ok and any(symbolic.values()):
            single, feeds, wrt = build(used, dtypes)
            _check_symbolic(check, single, {f"in{i}": a for i, a in symbolic.items() if a}, feeds, wrt, seed)
        return
    check.note = f"cannot check the node: {' '.join(str(error).split())[:200]}"


def _symbolic_axes(info: Any) -> list[int]:
    """The axes of a value that the model declares without a static size."""
    if info is None or info.shape is None:
        return []
    return [j for j, d in enumerate(info.shape) if not isinstance(d, int)]


def _check_symbolic(
    check: NodeCheck,
    single: onnx.ModelProto,
    axes: Mapping[str, Sequence[int]],
    feeds: Mapping[str, np.ndarray],
    wrt: Sequence[str],
    seed: int,
) -> None:
    """Compare the gradients of the one-node model ``single`` (checked at static shapes) with those
    of the same node built with the model's symbolic dims (``axes``, by input name), as the whole
    model builds it: shape-dependent rules take another path then, which must agree. A refusal or
    a difference fails the check."""
    backend: Backend = "reference" if check.checked_in.endswith("reference") else "onnxruntime"
    static = _seeded_gradients(single, feeds, wrt, backend, seed)
    try:
        symbolic = _seeded_gradients(declare_symbolic(single, axes), feeds, wrt, backend, seed)
    except GradientNotImplementedError as exc:
        check.status = "FAIL"
        check.note = f"refused with the model's symbolic dims: {' '.join(str(exc).split())}"
        return
    precise = all(np.asarray(v).dtype == np.float64 for v in static.values())
    rtol = 1e-9 if precise else 1e-4  # the same sums in another order: rounding only
    for name, want in static.items():
        got = np.asarray(symbolic[name], dtype=np.float64)
        want64 = np.asarray(want, dtype=np.float64)
        finite = np.isfinite(want64)
        bound = rtol * float(np.abs(want64[finite]).max(initial=0.0)) + (1e-12 if precise else 1e-6)
        same = got.shape == want64.shape and np.array_equal(np.isfinite(got), finite)
        if not same or not np.all(np.abs(got[finite] - want64[finite]) <= bound):
            check.status = "FAIL"
            check.note = f"the gradient of {name} differs with the model's symbolic dims {dict(axes)}"
            return


def _seeded_gradients(
    model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], wrt: Sequence[str], backend: Backend, seed: int
) -> dict[str, np.ndarray]:
    """The gradients of ``wrt`` (inputs and initializers of a one-node model) for cotangents drawn
    from ``seed``: the same for two models with outputs of the same shapes."""
    checked = load_checked(model)
    inits = {i.name: i for i in checked.proto.graph.initializer}
    graphs = build_gradient(
        checked,
        trainable=[w for w in wrt if w in inits],
        inputs_requiring_grad=[w for w in wrt if w not in inits],
        tie_weights=False,
    )
    out = run_model(graphs.forward, backend)(
        {**feeds, **{t: numpy_helper.to_array(inits[t]) for t in graphs.trainable}}
    )
    gen = np.random.default_rng(seed)
    cot = {o: gen.standard_normal(np.shape(out[o])).astype(out[o].dtype) for o in graphs.grad_inputs}
    return run_gradients(graphs, feeds, cot, backend)[1]


def declare_symbolic(model: onnx.ModelProto, axes: Mapping[str, Sequence[int]]) -> onnx.ModelProto:
    """A copy of ``model`` whose graph inputs have the dims ``axes[name]`` symbolic (axes past an
    input's rank are ignored), its value types inferred again from them; outputs that inference
    leaves untyped keep their rank. For checking a rule along the path it takes when sizes are
    known only at run time, as in a model exported with dynamic axes."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for inp in out.graph.input:
        dims = inp.type.tensor_type.shape.dim
        for j in axes.get(inp.name, ()):
            if j < len(dims):
                dims[j].dim_param = f"{inp.name}_d{j}"
    del out.graph.value_info[:]
    ranks = [len(o.type.tensor_type.shape.dim) for o in out.graph.output]
    for o in out.graph.output:
        o.type.tensor_type.ClearField("shape")
    out = onnx.shape_inference.infer_shapes(out)
    for o, rank in zip(out.graph.output, ranks):
        if not o.type.tensor_type.HasField("shape"):
            for _ in range(rank):
                o.type.tensor_type.shape.dim.add()
    return out


# Ops whose output picks among its inputs' elements: at equal values (a dead ReLU channel before a
# MaxPool) they have no derivative, and onnxgrad's rule takes one subgradient (the first index).
_SELECTING = frozenset(
    {"MaxPool", "GlobalMaxPool", "MaxRoiPool", "ReduceMax", "ReduceMin", "Max", "Min", "TopK"}
)


def _break_ties(arrays: Sequence[np.ndarray | None], seed: int) -> tuple[list[np.ndarray | None], str]:
    """``arrays`` with the floating-point elements whose value occurs more than once (over all of
    them) moved apart, and a note saying so (``''`` when there was no tie).

    A maximum over tied values has one-sided slopes that differ and, with overlapping windows, an
    analytic gradient that is one of many valid subgradients, none of which finite differences
    can confirm. The tied elements are moved by distinct multiples of ten finite-difference steps
    (of their dtype, at their scale), in a random order, so each window has one maximum that the
    steps of the check do not cross: :func:`check_nodes` checks the rule at a point next to the tie
    when the check at the tie fails (a check that passes there, NONDIFF included, stands; one that
    fails next to the tie too is reported as it failed at the tie).
    """
    floats = [a for a in arrays if a is not None and a.dtype.kind == "f"]
    if not floats:
        return list(arrays), ""
    flat = np.concatenate([a.reshape(-1) for a in floats])
    values, counts = np.unique(flat[np.isfinite(flat)], return_counts=True)
    repeated = values[counts > 1]
    if not repeated.size:
        return list(arrays), ""
    rng = np.random.default_rng(seed)
    masks = [None if a is None or a.dtype.kind != "f" else np.isin(a, repeated) for a in arrays]
    total = sum(int(m.sum()) for m in masks if m is not None)
    ranks = iter(rng.permutation(total) + 1)
    out: list[np.ndarray | None] = []
    spacing = 0.0
    for a, mask in zip(arrays, masks):
        if mask is None or not mask.any():
            out.append(a)
            continue
        step = 10 * (1e-3 if a.dtype != np.float64 else 1e-6) * max(1.0, float(np.max(np.abs(a[mask]))))
        spacing = max(spacing, step)
        moved = a.copy()
        moved[mask] += np.array([next(ranks) for _ in range(int(mask.sum()))], a.dtype) * step
        out.append(moved)
    note = (
        f"{total} tied input values moved apart by multiples of {spacing:.0e} (at a tie the maximum has "
        "no derivative: the rule's first-index subgradient is one valid choice)"
    )
    return out, note


def _declare_output_shapes(model: onnx.ModelProto, values: Sequence[np.ndarray | None]) -> None:
    """Give the outputs that shape inference left without a shape (ai.onnx.ml ops) the shapes the
    whole model computed, or, for outputs the model leaves unused (the statistics of a contrib
    normalization), those onnxgrad infers: the ONNX checker rejects graph outputs without one."""
    typed: dict[str, Any] | None = None
    for out, value in zip(model.graph.output, values):
        tensor = out.type.tensor_type
        if tensor.HasField("shape"):
            continue
        if value is None:
            typed = typed if typed is not None else infer_value_infos(model)
            info = typed.get(out.name)
            if info is not None and info.shape is not None:
                out.type.CopyFrom(info.to_proto().type)
            continue
        tensor.shape.SetInParent()
        for d in np.shape(value):
            tensor.shape.dim.add().dim_value = d


# ---- float32 results computed in different orders ---------------------------------------------
def assert_allclose_scaled(
    actual: Any,
    expected: Any,
    *,
    rtol: float = 1e-5,
    scale: float | None = None,
    err_msg: str = "",
) -> None:
    """Assert that two results of the same computation, done in different orders, agree to rounding.

    The rule: every element satisfies ``|actual - expected| <= rtol * scale``, where ``scale`` is
    ``max |expected|`` over the tensor's finite elements unless given. Shapes must be equal, NaNs
    and infinities at the same places.

    Use it where float32 values are computed in another order: merged against unmerged weights,
    ONNX against torch, fused against unfused kernels, one graph against two, and onnxruntime on a
    CPU with other kernels (AVX2 against AVX-512). Reordering a float32 sum moves each element by
    a few units in the last place of the terms summed into it, and those terms have the magnitude
    of the tensor, not of the element: an element that cancels to near zero carries an error of
    the size of its neighbours, and a large tensor carries a large absolute error. So the bound
    scales with the tensor's magnitude: neither absolute (breaks on values of magnitude 100) nor
    per element (breaks on the elements near zero). A reorder costs about 1e-7 to 1e-6 relative
    per float32 reduction and grows with depth; a wrong formula (a missed factor, a wrong
    gradient) is off by 1e-2 or more: pick ``rtol`` between the two. Comparisons against float64
    finite differences have their own rule (:func:`check_gradients`).

    ``actual`` and ``expected``: arrays, scalars or torch tensors (detached here). ``scale``: the
    magnitude the error is measured against, when it is not that of ``expected`` (e.g. a
    gradient whose exact value is zero). Raises ``AssertionError`` naming the worst element.
    """
    got, want = _as_float64(actual), _as_float64(expected)
    if got.shape != want.shape:
        raise AssertionError(f"{err_msg}: shapes differ: {got.shape} against {want.shape}".lstrip(": "))
    if scale is None:
        finite = np.abs(want[np.isfinite(want)])
        scale = float(finite.max()) if finite.size else 0.0
    bound = rtol * scale
    note = f"bound {rtol:g} x max|expected| {scale:.4g} = {bound:.3g}"
    np.testing.assert_allclose(got, want, rtol=0, atol=bound, err_msg=f"{err_msg} ({note})".lstrip())


def cancellation_bound(count: int, magnitude: float, dtype: Any = np.float32, roundings: int = 4) -> float:
    """The rounding residue to allow in a sum of ``count`` terms of size up to ``magnitude`` that
    cancel (exactly, or to far below ``magnitude``), computed in ``dtype``.

    Such a sum is left with the rounding of its terms and of the summation, not with any of its
    exact value: a conv bias feeding a training-mode BatchNormalization has an exact gradient of
    zero, the float32 sum of the ``N H W`` terms of the BatchNorm's input gradient. Each term
    carries ``roundings`` roundings of relative size u (the unit roundoff, half ``dtype``'s
    epsilon) from the elementwise ops that made it, and the summation one more per addition; in
    any summation order these errors are independent in sign, so they add up like a random walk:
    ``sqrt(count) * (roundings + 1) * u * magnitude``. (The worst case, ``count * (roundings + 1) *
    u * magnitude``, is reached only when every error has the same sign.) A wrong rule is off by a
    fraction of ``magnitude``, far above it.
    """
    u = float(np.finfo(dtype).eps) / 2
    return math.sqrt(count) * (roundings + 1) * u * magnitude


def _as_float64(value: Any) -> np.ndarray:
    """``value`` as a float64 (or complex128) array; torch tensors are detached and moved to the CPU."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    arr = np.asarray(value)
    return arr.astype(np.complex128 if arr.dtype.kind == "c" else np.float64)
