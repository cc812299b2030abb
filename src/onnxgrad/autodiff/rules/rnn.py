"""Recurrent layers: RNN, GRU and LSTM (opsets 7 and 14: every direction, layout, optional input).

The forward op is one fused kernel that keeps its gates to itself, and the backward does not re-run
the recurrence. Every gate depends only on X_t and H_{t-1}, and once the forward has run the whole
hidden sequence is known: it is the op's output Y, and H_{t-1} is Y shifted by one step. So the
pre-activations X_t W^T + H_{t-1} R^T of all steps are a few large Gemms, and only what is
sequential runs in an ONNX ``Scan`` over reversed time: the gradient recursion through R (dH_{t-1}
from dH_t; LSTM's dC_{t-1} = dC_t f_t + ...), one MatMul per step. The gates and their derivatives
are recomputed from the pre-activations inside that Scan's step, where the per-step tensors stay in
cache. (Measured on onnxruntime 1.31, single thread, the reverse Scan of an LSTM and what feeds it:
17 ms at T=100 B=32 H=128, against 19 ms both when every gate and factor is computed over all steps
beforehand, whose T x B x 4H tensors then go through memory several times, and when the
pre-activations are recomputed per step too; 44 ms against 50 and 44 at T=50 B=64 H=256. Only tiny
layers favour the all-steps form: 2.6 ms against 2.0 at T=100 B=8 H=64.) LSTM's cell states,
which no output holds, are rebuilt first by a second Scan, forward in time
(C_t = f_t C_{t-1} + i_t c_t, elementwise). Weight gradients are then one Gemm per weight and
direction over all steps. The forward saves X, the weights and Y (asked of the node when the model
does not use it).

Directions: a reverse direction is a forward one on inputs reversed within each sequence's length
(``ReverseSequence``, its own inverse), so both directions of a bidirectional op are stacked on a
direction axis and share the Scans. Variable lengths: steps at t >= sequence_lens[b] pass the
gradients through unchanged (the forward holds the state there), and since onnxruntime sets Y_h (and
Y_c) to zero for an empty sequence, no gradient reaches initial_h/initial_c from it.

Where the spec leaves room the semantics are onnxruntime's: ``clip`` bounds every gate's
pre-activation (peephole term included) but not the cell state; ``activation_alpha``/``beta`` are
consumed in the order of the activations that take them, with onnxruntime's defaults.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from ...errors import GradientNotImplementedError
from ...model.graph import Dim
from ..builder import GradBuilder, Var
from ..registry import NodeContext, rule
from .common import flip, node_label, optional_input, scan, zeros

# ---- activation functions ---------------------------------------------------------------------
# name -> (takes alpha, takes beta); defaults as onnxruntime (rnn_helpers.cc), 0 otherwise
_ACT_PARAMS = {
    "relu": (False, False),
    "tanh": (False, False),
    "sigmoid": (False, False),
    "affine": (True, True),
    "leakyrelu": (True, False),
    "thresholdedrelu": (True, False),
    "scaledtanh": (True, True),
    "hardsigmoid": (True, True),
    "elu": (True, False),
    "softsign": (False, False),
    "softplus": (False, False),
}
_ACT_DEFAULTS = {"leakyrelu": (0.01, 0.0), "hardsigmoid": (0.2, 0.5), "elu": (1.0, 0.0)}
_STEP_RANK = 3  # every value of a Scan step is [D, B, .] (or a [1, B, 1] mask)
_NUM_GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
_DEFAULT_ACTS = {"RNN": ["tanh"], "GRU": ["sigmoid", "tanh"], "LSTM": ["sigmoid", "tanh", "tanh"]}


@dataclass(frozen=True)
class Act:
    """One activation of a recurrent op (lower-case name, alpha, beta), applied and differentiated."""

    name: str
    alpha: float = 0.0
    beta: float = 0.0

    @property
    def grad_needs_x(self) -> bool:
        """Whether the derivative needs the pre-activation, not just the activation's value."""
        return self.name in ("leakyrelu", "thresholdedrelu", "scaledtanh", "elu")

    def __call__(self, x: Var) -> Var:
        g, a, b = x.g, self.alpha, self.beta
        if self.name == "affine":
            return x * a + b
        if self.name == "scaledtanh":
            return g.Tanh(x * b) * a
        if self.name in ("leakyrelu", "thresholdedrelu", "elu"):
            return g.op(_ONNX_NAMES[self.name], x, alpha=a)
        if self.name == "hardsigmoid":
            return g.HardSigmoid(x, alpha=a, beta=b)
        return g.op(_ONNX_NAMES[self.name], x)

    def grad(self, x: Var | None, y: Var) -> Var:
        """dy/dx from the pre-activation ``x`` (when :attr:`grad_needs_x`) and the value ``y``."""
        g, a, b = y.g, self.alpha, self.beta
        if self.name == "tanh":
            return 1 - y * y
        if self.name == "sigmoid":
            return y * (1 - y)
        if self.name == "relu":
            return g.Cast(y > 0, to=y.dtype)
        if self.name == "affine":
            return g.Expand(g.const(a, y.dtype), g.Shape(y))
        if self.name == "hardsigmoid":  # alpha where alpha*x + beta is strictly inside (0, 1)
            return g.Cast(g.And(y > 0, y < 1), to=y.dtype) * a
        if self.name == "softsign":  # 1 / (1 + |x|)^2 == (1 - |y|)^2
            s = 1 - g.Abs(y)
            return s * s
        if self.name == "softplus":  # sigmoid(x) == 1 - exp(-y)
            return 1 - g.Exp(-y)
        assert x is not None
        one = g.const(1.0, y.dtype)
        if self.name == "leakyrelu":
            return g.Where(x >= 0, one, g.const(a, y.dtype))
        if self.name == "elu":
            return g.Where(x >= 0, one, y + a)
        if self.name == "thresholdedrelu":
            return g.Cast(x > a, to=y.dtype)
        t = g.Tanh(x * b)  # scaledtanh
        return (1 - t * t) * (a * b)


_ONNX_NAMES = {
    "relu": "Relu",
    "tanh": "Tanh",
    "sigmoid": "Sigmoid",
    "leakyrelu": "LeakyRelu",
    "thresholdedrelu": "ThresholdedRelu",
    "elu": "Elu",
    "softsign": "Softsign",
    "softplus": "Softplus",
}


def _per_direction(fn: Callable[..., Var], acts: Sequence[Act], axis: int, *xs: Var | None) -> Var:
    """``fn(act, *xs)`` with each direction's own activation (``axis`` is the direction axis)."""
    if len(set(acts)) == 1:
        return fn(acts[0], *xs)
    g = next(x.g for x in xs if x is not None)
    parts = [
        None if x is None else g.Split(x, axis=axis, num_outputs=len(acts), outputs=len(acts)) for x in xs
    ]
    outs = [fn(a, *[None if p is None else p[d] for p in parts]) for d, a in enumerate(acts)]
    return g.Concat(*outs, axis=axis)


def _activate(acts: Sequence[Act], x: Var, axis: int) -> Var:
    return _per_direction(lambda a, v: a(v), acts, axis, x)


def _derivative(acts: Sequence[Act], x: Var | None, y: Var, axis: int) -> Var:
    return _per_direction(lambda a, u, v: a.grad(u, v), acts, axis, x, y)


# ---- what a rule knows about the node ---------------------------------------------------------
@dataclass
class _Spec:
    op: str
    hidden: int
    directions: list[bool]  # per direction: whether it runs in reverse time
    layout: int
    clip: float | None
    acts: list[list[Act]]  # [slot][direction]: RNN f; GRU f, g; LSTM f, g, h

    @property
    def num_directions(self) -> int:
        return len(self.directions)


def _spec(n: NodeContext) -> _Spec:
    op = n.node.op_type
    direction = n.attr("direction", "forward")
    dirs = {"forward": [False], "reverse": [True], "bidirectional": [False, True]}.get(direction)
    if dirs is None:
        raise GradientNotImplementedError(f"{node_label(n)}: unknown direction {direction!r}")
    hidden = n.attr("hidden_size")
    if hidden is None:
        r = n.inputs[2]
        hidden = r.shape[-1] if r is not None and r.shape is not None else None
    if not isinstance(hidden, int):
        raise GradientNotImplementedError(f"{node_label(n)}: hidden_size must be given or R's shape known")
    layout = n.attr("layout", 0) if n.opset >= 14 else 0
    return _Spec(op, hidden, dirs, layout, n.attr("clip"), _activations(n, op, len(dirs)))


def _activations(n: NodeContext, op: str, num_dirs: int) -> list[list[Act]]:
    per_dir = len(_DEFAULT_ACTS[op])
    given = [s.decode() if isinstance(s, bytes) else s for s in n.attr("activations") or []]
    names = [s.lower() for s in (given or _DEFAULT_ACTS[op] * num_dirs)]
    if op == "RNN" and num_dirs == 1 and len(names) == 2:  # the schema's default lists two
        names = names[:1]
    if len(names) == per_dir and num_dirs == 2:
        names = names * 2
    if len(names) != per_dir * num_dirs:
        raise GradientNotImplementedError(
            f"{node_label(n)}: expected {per_dir * num_dirs} activations, got {names}"
        )
    unknown = [s for s in names if s not in _ACT_PARAMS]
    if unknown:
        raise GradientNotImplementedError(f"{node_label(n)}: unsupported activation(s) {unknown}")
    alphas = list(n.attr("activation_alpha") or [])
    betas = list(n.attr("activation_beta") or [])
    acts: list[Act] = []
    for name in names:  # alpha and beta are consumed in order by the activations that take them
        takes_a, takes_b = _ACT_PARAMS[name]
        default_a, default_b = _ACT_DEFAULTS.get(name, (0.0, 0.0))
        a = (alphas.pop(0) if alphas else default_a) if takes_a else 0.0
        b = (betas.pop(0) if betas else default_b) if takes_b else 0.0
        acts.append(Act(name, float(a), float(b)))
    return [[acts[d * per_dir + s] for d in range(num_dirs)] for s in range(per_dir)]


# ---- sequences, directions, masks -------------------------------------------------------------
def _split_dirs(g: GradBuilder, x: Var | None, num_dirs: int) -> list[Var | None]:
    """The directions of a [T, D, B, .] tensor, each [T, 1, B, .]."""
    if x is None or num_dirs == 1:
        return [x] * num_dirs
    return list(g.Split(x, axis=1, num_outputs=num_dirs, outputs=num_dirs))


def _join_dirs(g: GradBuilder, parts: list[Var], axis: int) -> Var:
    return parts[0] if len(parts) == 1 else g.Concat(*parts, axis=axis)


class _Seqs:
    """Time-major tensors in each direction's processing order, stacked as [T, D, B, ...]."""

    def __init__(self, g: GradBuilder, spec: _Spec, lens: Var | None) -> None:
        self.g, self.spec, self.lens = g, spec, lens

    def _rev(self, x: Var) -> Var:  # x [T, B, ...]: reverse each sequence within its length
        if self.lens is None:
            return flip(self.g, x)
        return self.g.ReverseSequence(x, self.lens, batch_axis=1, time_axis=0)

    def reorder(self, x: Var) -> Var:
        """[T, D, B, ...] between time order and processing order (either way: an involution)."""
        g, dirs = self.g, self.spec.directions
        if not any(dirs):
            return x
        parts = _split_dirs(g, x, len(dirs))
        return _join_dirs(
            g, [g.Unsqueeze(self._rev(g.Squeeze(p, [1])), [1]) if r else p for p, r in zip(parts, dirs)], 1
        )


def _times_weights(g: GradBuilder, a: Var, w: Var, acc: Var | None, num_dirs: int, cols: int) -> Var:
    """a_d w_d^T + acc_d for each direction d: a [T, D, B, K], w [D, cols, K], acc [T, D, B, cols].

    One Gemm per direction over all steps and batch rows, the accumulation included.
    """
    outs = []
    for d, (ad, cd) in enumerate(zip(_split_dirs(g, a, num_dirs), _split_dirs(g, acc, num_dirs))):
        wd = g.Squeeze(w if num_dirs == 1 else g.Slice(w, [d], [d + 1], [0]), [0])
        y = g.Gemm(g.Flatten(ad, axis=3), wd, None if cd is None else g.Flatten(cd, axis=3), transB=1)
        shape = g.Concat(g.Slice(g.Shape(ad), [0], [3], [0]), g.const([cols]), axis=0)
        outs.append(g.Reshape(y, shape))
    return _join_dirs(g, outs, 1)


def _contract(g: GradBuilder, a: Var, b: Var, num_dirs: int) -> Var:
    """sum over steps and batch of a^T b: [T, D, B, P] x [T, D, B, Q] -> [D, P, Q].

    One Gemm per direction (an Einsum costs onnxruntime several times more).
    """
    pairs = zip(_split_dirs(g, a, num_dirs), _split_dirs(g, b, num_dirs))
    parts = [g.Unsqueeze(g.Gemm(g.Flatten(u, axis=3), g.Flatten(v, axis=3), transA=1), [0]) for u, v in pairs]
    return _join_dirs(g, parts, 0)


def _sum_steps(g: GradBuilder, x: Var) -> Var:
    """sum over steps and batch: [T, D, B, N] -> [D, N] (leading axis first: onnxruntime's fast path)."""
    return g.reduce_sum(g.reduce_sum(x, [0], keepdims=False), [1], keepdims=False)


def _clip(spec: _Spec, x: Var) -> Var:
    """The clipped pre-activation (built by ``x``'s own builder: it also serves Scan bodies)."""
    if spec.clip is None:
        return x
    return x.g.Clip(x, x.g.const(-spec.clip, x.dtype), x.g.const(spec.clip, x.dtype))


def _gate(spec: _Spec, acts: Sequence[Act], x: Var, axis: int = 0) -> tuple[Var, Var]:
    """(activation, derivative) of a pre-activation whose direction axis is ``axis`` (0 in a Scan
    step); the derivative is 0 where clip bound x."""
    xc = _clip(spec, x)
    y = _activate(acts, xc, axis)
    d = _derivative(acts, xc, y, axis)
    if spec.clip is not None:
        d = x.g.Where(x.g.Abs(x) <= spec.clip, d, x.g.const(0.0, d.dtype))
    return y, d


@dataclass
class _Ctx:
    """The shared pieces of every op's backward, time-major, in processing order."""

    g: GradBuilder
    n: NodeContext
    spec: _Spec
    xt: Var  # [T, B, I], time order
    yp: Var  # [T, D, B, H]: H_t
    hprev: Var  # [T, D, B, H]: H_{t-1}
    seqs: _Seqs
    mask: Var | None  # [T, 1, B, 1] bool: the step is inside its sequence
    dy: Var | None  # [T, D, B, H]
    state_shape: Var  # [D, B, H]

    def _b(self) -> Var | None:
        return optional_input(self.n, 3)

    def bias(self, k: int, which: int) -> Var | None:
        """Wb (``which`` 0) or Rb (1) of gate block ``k`` as [1, D, 1, H]."""
        b = self._b()
        if b is None:
            return None
        h = self.spec.hidden
        start = (which * _NUM_GATES[self.spec.op] + k) * h
        return self.g.Unsqueeze(self.g.Slice(b, [start], [start + h], [1]), [0, 2])

    def xw(self, bias: Var | None) -> Var:
        """X_t W^T + ``bias`` ([D, G H]) for all gates and directions: [T, D, B, G H], processing order.

        One Gemm on X as it comes (bias included); the reverse direction is reordered afterwards.
        """
        g, num_dirs, gh = self.g, self.spec.num_directions, _NUM_GATES[self.spec.op] * self.spec.hidden
        w = g.Flatten(self.n.inputs[1], axis=2)  # [D G H, I]
        y = g.Gemm(g.Flatten(self.xt, axis=2), w, None if bias is None else g.Reshape(bias, [-1]), transB=1)
        steps, batch = (g.Slice(g.Shape(self.xt), [k], [k + 1], [0]) for k in (0, 1))
        if num_dirs == 1:
            y = g.Reshape(y, g.Concat(steps, g.const([1]), batch, g.const([gh]), axis=0))
        else:
            shape = g.Concat(steps, batch, g.const([num_dirs, gh]), axis=0)
            y = g.Transpose(g.Reshape(y, shape), perm=[0, 2, 1, 3])
        return self.seqs.reorder(y)

    def input_bias(self, recurrent_blocks: int | None = None) -> Var | None:
        """Wb + Rb as [D, G H] (Rb of the first ``recurrent_blocks`` gate blocks only, when given)."""
        b = self._b()
        if b is None:
            return None
        g, gh = self.g, _NUM_GATES[self.spec.op] * self.spec.hidden
        rb = g.Slice(b, [gh], [2 * gh], [1])
        if recurrent_blocks is not None:
            keep = np.zeros(gh)
            keep[: recurrent_blocks * self.spec.hidden] = 1
            rb = rb * g.const(keep, rb.dtype)
        return g.Slice(b, [0], [gh], [1]) + rb

    def hr(self, h: Var, blocks: tuple[int, int], acc: Var | None = None) -> Var:
        """h R^T (+ ``acc``) for gate blocks ``blocks``: [T, D, B, k H]."""
        g, hsz = self.g, self.spec.hidden
        r = self.n.inputs[2]
        if blocks != (0, _NUM_GATES[self.spec.op]):
            r = g.Slice(r, [blocks[0] * hsz], [blocks[1] * hsz], [1])
        return _times_weights(g, h, r, acc, self.spec.num_directions, (blocks[1] - blocks[0]) * hsz)


@dataclass
class _Grads:
    """What each op's backward hands to the common part."""

    dxw: Var  # [T, D, B, G H]: gradient of X_t W^T + Wb (masked)
    dr: Callable[[], Var]  # [D, G H, H], built only when asked
    drb: Callable[[], Var] | None  # [D, G H]; None: the same as Wb's
    dh0: Var  # [D, B, H]
    dc0: Var | None = None
    dp: Callable[[], Var] | None = None


def _add(*xs: Var | None) -> Var:
    """The sum of the ``xs`` that are present."""
    present = [x for x in xs if x is not None]
    out = present[0]
    for x in present[1:]:
        out = out + x
    return out


def _inside(b: GradBuilder, mask: Var | None, x: Var) -> Var:
    """``x`` inside the sequence, 0 outside (a Where: padding may hold anything, even NaN)."""
    return x if mask is None else b.Where(mask, x, b.const(0.0, x.dtype))


def _carry(b: GradBuilder, mask: Var | None, new: Var, old: Var) -> Var:
    """The state after a step: ``new`` inside the sequence, ``old`` passed through outside."""
    return new if mask is None else b.Where(mask, new, old)


def _step_inputs(c: _Ctx, *seqs: Var | None) -> list[Var]:
    """Per-step Scan inputs: dY (when given), the ``seqs``, then the mask (when lengths vary)."""
    return [s for s in (c.dy, *seqs, c.mask) if s is not None]


def _unpack(c: _Ctx, slices: list[Var], count: int) -> tuple[Var | None, list[Var], Var | None]:
    it = iter(slices)
    dy = next(it) if c.dy is not None else None
    body = [next(it) for _ in range(count)]
    mask = next(it) if c.mask is not None else None
    return dy, body, mask


def _plus(b: GradBuilder, state: Var, dy: Var | None) -> Var:
    return state if dy is None else b.Add(state, dy)


def _blocks(b: GradBuilder, x: Var, count: int) -> list[Var]:
    """The ``count`` gate blocks of a step's [D, B, count H] value."""
    return list(b.Split(x, axis=-1, num_outputs=count, outputs=count))


# ---- RNN --------------------------------------------------------------------------------------
def _rnn(c: _Ctx, dyh: Var) -> _Grads:
    """H_t = f(X_t W^T + H_{t-1} R^T + Wb + Rb): dpre_t = dH_t f', dH_{t-1} = dpre_t R."""
    spec, acts = c.spec, c.spec.acts[0]
    # f' from H_t = f(pre) itself where it can (no recomputation), else from the pre-activation
    from_y = spec.clip is None and not any(a.grad_needs_x for a in acts)
    src = c.yp if from_y else c.hr(c.hprev, (0, 1), c.xw(c.input_bias()))
    r = c.n.inputs[2]

    def step(b: GradBuilder, states: list[Var], slices: list[Var]) -> tuple[list[Var], list[Var]]:
        dy, (v,), mask = _unpack(c, slices, 1)
        deriv = _derivative(acts, None, v, 0) if from_y else _gate(spec, acts, v)[1]
        dpre = _inside(b, mask, b.Mul(_plus(b, states[0], dy), deriv))
        return [_carry(b, mask, b.MatMul(dpre, r), states[0])], [dpre]

    (dh0,), (dpre,) = scan(c.g, [dyh], _step_inputs(c, src), step, backward=True, rank=_STEP_RANK)
    return _Grads(dxw=dpre, dr=lambda: _contract(c.g, dpre, c.hprev, spec.num_directions), drb=None, dh0=dh0)


# ---- GRU --------------------------------------------------------------------------------------
def _gru(c: _Ctx, dyh: Var) -> _Grads:
    """z, r = f(.), h = g(.), H_t = (1 - z) h + z H_{t-1}; the reverse Scan carries dH only.

    linear_before_reset = 0: h = g(X W_h^T + (r H_{t-1}) R_h^T + Wb_h + Rb_h): r is computed over all
    steps for that Gemm, and a step has two dependent MatMuls (dq = dpre_h R_h, then
    dpre_r = dq H_{t-1} f'). linear_before_reset = 1: h = g(X W_h^T + r (H_{t-1} R_h^T + Rb_h) + Wb_h),
    one MatMul with the whole R per step.
    """
    g, spec, hp, hsz = c.g, c.spec, c.hprev, c.spec.hidden
    f, gh = spec.acts
    r_full = c.n.inputs[2]
    lbr = bool(c.n.attr("linear_before_reset", 0))
    xw_zr, xw_h = g.Split(c.xw(c.input_bias(2 if lbr else None)), [2 * hsz, hsz], axis=3, outputs=2)
    pre_zr = c.hr(hp, (0, 2), xw_zr)
    dirs = spec.num_directions

    if lbr:
        lin = _add(c.hr(hp, (2, 3)), c.bias(2, 1))

        def step(b: GradBuilder, states: list[Var], slices: list[Var]) -> tuple[list[Var], list[Var]]:
            dy, (pzr, xh, lin_t, hp_t), mask = _unpack(c, slices, 4)
            zr, dzr = _gate(spec, f, pzr)
            (z, r), (dz, dr) = _blocks(b, zr, 2), _blocks(b, dzr, 2)
            hh, dhh = _gate(spec, gh, b.Add(xh, b.Mul(r, lin_t)))
            dh = _plus(b, states[0], dy)
            dph = b.Mul(b.Mul(dh, b.Sub(b.const(1.0, dh.dtype), z)), dhh)
            dzp = b.Mul(b.Mul(dh, b.Sub(hp_t, hh)), dz)
            d3 = b.Concat(dzp, b.Mul(b.Mul(dph, lin_t), dr), b.Mul(dph, r), axis=-1)  # d(H R^T + Rb)
            prev = b.Add(b.Mul(dh, z), b.MatMul(d3, r_full))
            return [_carry(b, mask, prev, states[0])], [_inside(b, mask, d3), _inside(b, mask, dph)]

        (dh0,), (d3, dph) = scan(
            g, [dyh], _step_inputs(c, pre_zr, xw_h, lin, hp), step, backward=True, rank=_STEP_RANK
        )
        return _Grads(
            dxw=g.Concat(g.Slice(d3, [0], [2 * hsz], [3]), dph, axis=3),
            dr=lambda: _contract(g, d3, hp, dirs),
            drb=lambda: _sum_steps(g, d3),
            dh0=dh0,
        )

    r_all = _activate(f, _clip(spec, g.Slice(pre_zr, [hsz], [2 * hsz], [3])), 1)
    rh = r_all * hp  # r H_{t-1}, the input of R_h
    pre_h = c.hr(rh, (2, 3), xw_h)
    r_zr = g.Slice(r_full, [0], [2 * hsz], [1])
    r_h = g.Slice(r_full, [2 * hsz], [3 * hsz], [1])

    def step0(b: GradBuilder, states: list[Var], slices: list[Var]) -> tuple[list[Var], list[Var]]:
        dy, (pzr, ph, hp_t), mask = _unpack(c, slices, 3)
        zr, dzr = _gate(spec, f, pzr)
        (z, r), (dz, dr) = _blocks(b, zr, 2), _blocks(b, dzr, 2)
        hh, dhh = _gate(spec, gh, ph)
        dh = _plus(b, states[0], dy)
        dph = b.Mul(b.Mul(dh, b.Sub(b.const(1.0, dh.dtype), z)), dhh)
        dq = b.MatMul(dph, r_h)  # the gradient of r H_{t-1}
        dzr_p = b.Concat(b.Mul(b.Mul(dh, b.Sub(hp_t, hh)), dz), b.Mul(b.Mul(dq, hp_t), dr), axis=-1)
        prev = b.Add(b.Add(b.Mul(dh, z), b.MatMul(dzr_p, r_zr)), b.Mul(dq, r))
        return [_carry(b, mask, prev, states[0])], [_inside(b, mask, dzr_p), _inside(b, mask, dph)]

    (dh0,), (dzr, dph) = scan(
        g, [dyh], _step_inputs(c, pre_zr, pre_h, hp), step0, backward=True, rank=_STEP_RANK
    )
    dxw = g.Concat(dzr, dph, axis=3)
    return _Grads(
        dxw=dxw,
        dr=lambda: g.Concat(_contract(g, dzr, hp, dirs), _contract(g, dph, rh, dirs), axis=1),
        drb=None,
        dh0=dh0,
    )


# ---- LSTM -------------------------------------------------------------------------------------
def _lstm(c: _Ctx, dyh: Var, dyc: Var) -> _Grads:
    """Gates i, o, f, c (ONNX order): C_t = f C_{t-1} + i c, H_t = o h(C_t).

    Peepholes add P_i C_{t-1}, P_f C_{t-1} to the i, f pre-activations and P_o C_t to o's;
    input_forget couples f = 1 - i. The cell states, which no output holds, are rebuilt first by a
    Scan forward in time. The reverse Scan carries (dH, dC): dC_t += dH_t (o h'(C_t) + P_o dpre_o/dH),
    dC_{t-1} = dC_t f + P_i dpre_i + P_f dpre_f, dH_{t-1} = dpre R.
    """
    g, spec, hp, hsz = c.g, c.spec, c.hprev, c.spec.hidden
    f_act, g_act, h_act = spec.acts
    forget = bool(c.n.attr("input_forget", 0))
    p = optional_input(c.n, 7)
    pre = c.hr(hp, (0, 4), c.xw(c.input_bias()))
    c0 = _initial(c, 6)
    peep = None
    if p is not None:  # [D, 1, H] each, ONNX order i, o, f
        peep = [g.Unsqueeze(v, [1]) for v in g.Split(p, axis=1, num_outputs=3, outputs=3)]

    def input_forget_gates(b: GradBuilder, pi: Var, pf: Var, cprev: Var) -> tuple[Var, Var, Var, Var | None]:
        """i, di, f, df at one step (peepholes read C_{t-1}; input_forget: f = 1 - i, df unused)."""
        i, di = _gate(spec, f_act, pi if peep is None else b.Add(pi, b.Mul(cprev, peep[0])))
        if forget:
            return i, di, b.Sub(b.const(1.0, i.dtype), i), None
        fg, df = _gate(spec, f_act, pf if peep is None else b.Add(pf, b.Mul(cprev, peep[2])))
        return i, di, fg, df

    def cell_step(b: GradBuilder, states: list[Var], slices: list[Var]) -> tuple[list[Var], list[Var]]:
        pre_t, *mask = slices
        pi, _, pf, pc = _blocks(b, pre_t, 4)
        i, _, fg, _ = input_forget_gates(b, pi, pf, states[0])
        cn = b.Add(b.Mul(fg, states[0]), b.Mul(i, _activate(g_act, _clip(spec, pc), 0)))
        cn = _carry(b, mask[0] if mask else None, cn, states[0])
        return [cn], [cn]

    _, (cs,) = scan(
        g, [c0], [s for s in (pre, c.mask) if s is not None], cell_step, backward=False, rank=_STEP_RANK
    )
    cprev = g.Concat(g.Unsqueeze(c0, [0]), g.Slice(cs, [0], [-1], [0]), axis=0)
    r = c.n.inputs[2]

    def step(b: GradBuilder, states: list[Var], slices: list[Var]) -> tuple[list[Var], list[Var]]:
        dy, (pre_t, c_t, cp_t), mask = _unpack(c, slices, 3)
        pi, po, pf, pc = _blocks(b, pre_t, 4)
        i, di, fg, df = input_forget_gates(b, pi, pf, cp_t)
        cg, dcg = _gate(spec, g_act, pc)
        o, do = _gate(spec, f_act, po if peep is None else b.Add(po, b.Mul(c_t, peep[1])))
        hc = _activate(h_act, c_t, 0)
        dh = _plus(b, states[0], dy)
        dpo = b.Mul(b.Mul(dh, hc), do)
        dc = b.Add(states[1], b.Mul(b.Mul(dh, o), _derivative(h_act, c_t, hc, 0)))
        if peep is not None:
            dc = b.Add(dc, b.Mul(dpo, peep[1]))
        dpi = b.Mul(b.Mul(dc, b.Sub(cg, cp_t) if forget else cg), di)
        dpf = zeros(b, b.Shape(dc), dc.dtype) if df is None else b.Mul(b.Mul(dc, cp_t), df)
        d4 = b.Concat(dpi, dpo, dpf, b.Mul(b.Mul(dc, i), dcg), axis=-1)
        dcp = b.Mul(dc, fg)
        if peep is not None:
            dcp = b.Add(dcp, b.Mul(dpi, peep[0]))
            if df is not None:
                dcp = b.Add(dcp, b.Mul(dpf, peep[2]))
        new = [_carry(b, mask, b.MatMul(d4, r), states[0]), _carry(b, mask, dcp, states[1])]
        return new, [_inside(b, mask, d4)]

    (dh0, dc0), (d4,) = scan(
        g, [dyh, dyc], _step_inputs(c, pre, cs, cprev), step, backward=True, rank=_STEP_RANK
    )

    def dp() -> Var:  # dP_i = sum dpre_i C_{t-1}, dP_o = sum dpre_o C_t, dP_f = sum dpre_f C_{t-1}
        dpi, dpo, dpf = (g.Slice(d4, [k * hsz], [(k + 1) * hsz], [3]) for k in range(3))
        return g.Concat(*(_sum_steps(g, v) for v in (dpi * cprev, dpo * cs, dpf * cprev)), axis=1)

    return _Grads(
        dxw=d4, dr=lambda: _contract(g, d4, hp, spec.num_directions), drb=None, dh0=dh0, dc0=dc0, dp=dp
    )


# ---- the rule ---------------------------------------------------------------------------------
def _dout(n: NodeContext, i: int) -> Var | None:
    return n.dout[i] if i < len(n.dout) else None


def _initial(c: _Ctx, i: int) -> Var:
    """initial_h (i = 5) or initial_c (6) as [D, B, H]; zeros when absent."""
    v = optional_input(c.n, i)
    if v is None:
        return zeros(c.g, c.state_shape, c.yp.dtype)
    return v if c.spec.layout == 0 else c.g.Transpose(v, perm=[1, 0, 2])


def _y_shape(x: Var, spec: _Spec) -> tuple[Dim, ...]:
    """The shape of Y: [T, D, B, H], or [B, T, D, H] in layout 1 (X being [T, B, I] or [B, T, I])."""
    a, b = (x.shape[0], x.shape[1]) if x.shape is not None else (None, None)
    d, h = spec.num_directions, spec.hidden
    return (a, d, b, h) if spec.layout == 0 else (a, b, d, h)


def _lengths(g: GradBuilder, n: NodeContext, x: Var, layout: int) -> Var | None:
    """sequence_lens as int64; None when absent or known to be the full length everywhere."""
    lens = optional_input(n, 4)
    if lens is None:
        return None
    known = n.const_input(4)
    steps = x.shape[layout] if x.shape is not None else None
    if known is not None and isinstance(steps, int) and np.all(known == steps):
        return None
    return g.Cast(lens, to=TensorProto.INT64)


@rule("RNN", "GRU", "LSTM", since=7)
def recurrent(g: GradBuilder, n: NodeContext) -> list[Var | None]:
    """Gradients of RNN, GRU and LSTM for X, W, R, B, initial_h, initial_c and P (see the module doc).

    With dpre_t the gradient of the gates' pre-activations (from the reverse Scan):
    dW = sum_t dpre_t^T X_t, dR = sum_t dpre_t^T H_{t-1} (GRU: r H_{t-1} for R_h),
    dB = [sum dpre, sum dpre] (GRU's Rb_h aside), dX_t = dpre_t W, and d initial_h (d initial_c) is
    the recursion's final dH (dC).
    """
    needs = [i < len(n.needs) and n.needs[i] for i in range(8)]
    grads: list[Var | None] = [None] * len(n.inputs)
    if not any(needs):
        return grads
    spec = _spec(n)
    x = n.inputs[0]
    y = (
        n.outputs[0]
        if n.outputs and n.outputs[0] is not None
        else g.extra_output(n.node, 0, x.dtype, _y_shape(x, spec))
    )
    time_major = spec.layout == 0

    def to_time_major(v: Var, perm: list[int]) -> Var:
        return v if time_major else g.Transpose(v, perm=perm)

    lens = _lengths(g, n, x, spec.layout)
    seqs = _Seqs(g, spec, lens)
    yp = seqs.reorder(to_time_major(y, [1, 2, 0, 3]))
    shape = g.Shape(yp)
    state_shape = g.Slice(shape, [1], [4], [0])
    mask = None
    if lens is not None:
        steps = g.Range(g.const(0), g.Squeeze(g.Slice(shape, [0], [1], [0]), [0]), g.const(1))
        mask = g.Less(g.Reshape(steps, [-1, 1, 1, 1]), g.Reshape(lens, [1, 1, -1, 1]))
    dy = _dout(n, 0)
    if dy is not None:
        dy = seqs.reorder(to_time_major(dy, [1, 2, 0, 3]))  # ignored outside the sequences
    c = _Ctx(g, n, spec, to_time_major(x, [1, 0, 2]), yp, yp, seqs, mask, dy, state_shape)
    # H_{t-1}: initial_h, then Y without its last step (initial_h is read through the context)
    c.hprev = g.Concat(g.Unsqueeze(_initial(c, 5), [0]), g.Slice(yp, [0], [-1], [0]), axis=0)

    def final_grad(i: int) -> Var:  # the gradient of Y_h (i = 1) or Y_c (2), [D, B, H]
        d = _dout(n, i)
        return zeros(g, state_shape, x.dtype) if d is None else to_time_major(d, [1, 0, 2])

    if spec.op == "RNN":
        out = _rnn(c, final_grad(1))
    elif spec.op == "GRU":
        out = _gru(c, final_grad(1))
    else:
        out = _lstm(c, final_grad(1), final_grad(2))

    def initial_grad(d: Var) -> Var:
        if lens is not None:  # an empty sequence outputs zeros, not its initial state
            nonempty = g.Reshape(g.Greater(lens, g.const(0)), [1, -1, 1])
            d = g.Where(nonempty, d, g.const(0.0, d.dtype))
        return to_time_major(d, [1, 0, 2])

    if needs[0] or needs[1]:
        # [T, B, D G H] in time order: X's gradients are then one MatMul each over all directions
        dxw = seqs.reorder(out.dxw)
        if spec.num_directions == 1:
            dxw = g.Reshape(dxw, [0, -1, _NUM_GATES[spec.op] * spec.hidden])
        else:
            dxw = g.Reshape(g.Transpose(dxw, perm=[0, 2, 1, 3]), [0, 0, -1])
        w = g.Flatten(n.inputs[1], axis=2)  # [D G H, I]
        if needs[0]:
            grads[0] = to_time_major(g.MatMul(dxw, w), [1, 0, 2])
        if needs[1]:
            dw = g.Gemm(g.Flatten(dxw, axis=2), g.Flatten(c.xt, axis=2), transA=1)
            grads[1] = g.Reshape(dw, [spec.num_directions, _NUM_GATES[spec.op] * spec.hidden, -1])
    if needs[2]:
        grads[2] = out.dr()
    if needs[3]:
        dwb = _sum_steps(g, out.dxw)
        grads[3] = g.Concat(dwb, dwb if out.drb is None else out.drb(), axis=1)
    if needs[5]:
        grads[5] = initial_grad(out.dh0)
    if needs[6] and out.dc0 is not None:
        grads[6] = initial_grad(out.dc0)
    if needs[7] and out.dp is not None:
        grads[7] = out.dp()
    return grads
