"""Property-based tests (hypothesis): gradients of random graphs, and corrupted model files.

* Random graphs built from supported ops (random shapes, broadcasting, static and symbolic
  dimensions) must have gradients equal to central finite differences in float64
  (:func:`onnxgrad.testing.check_gradients`); their float32 twin must give the same gradients to
  float32 precision.
* Corrupted model files (bytes flipped, overwritten, inserted, deleted; truncation) must end in an
  :class:`~onnxgrad.errors.OnnxGradError` or train normally, never another exception, a crash or a
  hang. Each file runs in a child process (``_corruption_worker``) with a time limit, so a segfault or
  a hang is reported as a failure of this test instead of killing the session.

Two profiles: the default one (a few examples each, deterministic, about 20 s) runs with the other
tests; ``ONNXGRAD_FUZZ=1`` selects ``onnxgrad-fuzz`` (at least 1,000 random examples per property),
which is what ``make fuzz`` runs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from onnx import helper

from onnxgrad.autodiff.engine import build_gradient
from onnxgrad.testing import check_gradients, run_gradients
from tests.models import make_model, mlp
from tests.reliability._corruption_worker import Worker
from tests.reliability._util import REPO, conv_model, shapes_model

FUZZ = os.environ.get("ONNXGRAD_FUZZ") == "1"
_COMMON: dict[str, Any] = {
    "deadline": None,
    "database": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
}
settings.register_profile("onnxgrad-short", max_examples=20, derandomize=True, **_COMMON)
settings.register_profile("onnxgrad-fuzz", max_examples=1000, derandomize=False, **_COMMON)
PROFILE = settings.get_profile("onnxgrad-fuzz" if FUZZ else "onnxgrad-short")


# ---- random graphs ----------------------------------------------------------------------------------
UNARY = ["Tanh", "Sigmoid", "Sin", "Cos", "Neg", "Softplus", "Softsign", "Relu", "Elu", "Selu", "LeakyRelu"]
BINARY = ["Add", "Sub", "Mul", "Div"]
OTHER = ["MatMul", "ReduceSum", "ReduceMean", "Transpose", "Softmax", "Concat", "Reshape", "Unsqueeze",
         "Expand", "Where", "Pow"]  # fmt: skip


class RandomGraph:
    """A graph grown one op at a time from hypothesis draws; values are tracked as numpy arrays of
    zeros, so every op's output shape is numpy's (the broadcasting ONNX specifies)."""

    def __init__(self, draw: Callable[[st.SearchStrategy], Any], seed: int) -> None:
        self.draw = draw
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: dict[str, np.ndarray] = {}  # name -> value fed
        self.params: dict[str, np.ndarray] = {}  # float initializers (trained)
        self.consts: dict[str, np.ndarray] = {}  # integer / bool initializers
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dynamic = draw(st.booleans())  # inputs declared with symbolic dimensions

    # -- values
    def _name(self, prefix: str) -> str:
        return f"{prefix}{len(self.shapes) + len(self.consts)}"

    def shape(self, min_rank: int = 0, max_rank: int = 3) -> tuple[int, ...]:
        return tuple(self.draw(st.lists(st.integers(1, 4), min_size=min_rank, max_size=max_rank)))

    def broadcastable(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """A shape that broadcasts with ``shape``: leading dims dropped, some dims set to 1."""
        drop = self.draw(st.integers(0, len(shape)))
        return tuple(1 if self.draw(st.booleans()) else d for d in shape[drop:])

    def new_input(self, shape: tuple[int, ...]) -> str:
        name = self._name("x")
        self.inputs[name] = self.rng.standard_normal(shape)
        self.shapes[name] = shape
        return name

    def new_param(self, shape: tuple[int, ...]) -> str:
        name = self._name("w")
        self.params[name] = self.rng.standard_normal(shape)
        self.shapes[name] = shape
        return name

    def const(self, value: Any, dtype: type = np.int64) -> str:
        name = self._name("c")
        self.consts[name] = np.asarray(value, dtype=dtype)
        return name

    def pick(self, min_rank: int = 0) -> str:
        names = [n for n, s in self.shapes.items() if len(s) >= min_rank]
        if not names:
            return self.new_param(self.shape(min_rank=max(min_rank, 1)))
        return self.draw(st.sampled_from(names))

    def operand_for(self, a: str) -> str:
        """An existing value or a new input/parameter broadcasting with ``a``."""
        candidates = [n for n, s in self.shapes.items() if _broadcasts(s, self.shapes[a])]
        choice = self.draw(st.sampled_from(["existing", "param", "input"]))
        if choice == "existing" and candidates:
            return self.draw(st.sampled_from(candidates))
        shape = self.broadcastable(self.shapes[a])
        return self.new_input(shape) if choice == "input" else self.new_param(shape)

    def emit(self, op: str, inputs: list[str], shape_of: Callable[..., np.ndarray], **attrs: Any) -> str:
        out = self._name("v")
        self.nodes.append(helper.make_node(op, inputs, [out], name=f"n{len(self.nodes)}_{op}", **attrs))
        args = [np.zeros(self.shapes[i]) if i in self.shapes else self.consts[i] for i in inputs]
        self.shapes[out] = tuple(np.shape(shape_of(*args)))
        return out

    # -- ops
    def grow(self) -> str:
        op = self.draw(st.sampled_from(UNARY + BINARY + OTHER))
        if op in UNARY:
            return self.emit(op, [self.pick()], lambda a: a)
        if op in ("Add", "Sub", "Mul"):
            a = self.pick()
            return self.emit(op, [a, self.operand_for(a)], np.add)
        if op == "Div":  # a / (c + sigmoid(b)) with c = 1.5: the denominator stays in [1.5, 2.5]
            a = self.pick()
            s = self.emit("Sigmoid", [self.operand_for(a)], lambda b: b)
            c = self.new_param(())
            self.params[c][...] = 1.5
            return self.emit("Div", [a, self.emit("Add", [s, c], np.add)], np.add)
        if op == "Pow":  # a float exponent, not differentiated (a**e has no real log for a < 0)
            return self.emit("Pow", [self.pick(), self.const(2.0, np.float64)], lambda a, e: a)
        if op == "MatMul":
            a = self.pick(min_rank=1)
            w = self.new_param((self.shapes[a][-1], self.draw(st.integers(1, 3))))
            return self.emit("MatMul", [a, w], np.matmul)
        if op in ("ReduceSum", "ReduceMean"):
            a = self.pick(min_rank=1)
            rank = len(self.shapes[a])
            axes = sorted(self.draw(st.sets(st.integers(0, rank - 1), min_size=1)))
            keep = self.draw(st.sampled_from([0, 1]))
            shape_of = lambda x, ax: np.sum(x, tuple(ax), keepdims=bool(keep))
            return self.emit(op, [a, self.const(axes)], shape_of, keepdims=keep)
        if op == "Transpose":
            a = self.pick(min_rank=2)
            perm = self.draw(st.permutations(range(len(self.shapes[a]))))
            return self.emit("Transpose", [a], lambda x: np.transpose(x, perm), perm=list(perm))
        if op == "Softmax":
            a = self.pick(min_rank=1)
            axis = self.draw(st.integers(-len(self.shapes[a]), len(self.shapes[a]) - 1))
            return self.emit("Softmax", [a], lambda x: x, axis=axis)
        if op == "Concat":
            a = self.pick(min_rank=1)
            shape = self.shapes[a]
            axis = self.draw(st.integers(0, len(shape) - 1))
            other = list(shape)
            other[axis] = self.draw(st.integers(1, 3))
            b = self.new_param(tuple(other)) if self.draw(st.booleans()) else a
            return self.emit("Concat", [a, b], lambda x, y: np.concatenate([x, y], axis), axis=axis)
        if op == "Reshape":
            a = self.pick(min_rank=1)
            target = [-1] if self.draw(st.booleans()) else [-1, self.shapes[a][-1]]
            return self.emit("Reshape", [a, self.const(target)], lambda x, t: np.reshape(x, t))
        if op == "Unsqueeze":
            a = self.pick()
            axis = self.draw(st.integers(0, len(self.shapes[a])))
            return self.emit(
                "Unsqueeze", [a, self.const([axis])], lambda x, ax: np.expand_dims(x, int(ax[0]))
            )
        if op == "Expand":
            a = self.pick()
            target = [self.draw(st.integers(1, 3)), *self.shapes[a]]
            return self.emit("Expand", [a, self.const(target)], lambda x, t: np.broadcast_to(x, t))
        # Where: a constant condition picks between a and a broadcasting operand
        a = self.pick()
        b = self.operand_for(a)
        cond = self.rng.random(np.broadcast_shapes(self.shapes[a], self.shapes[b])) > 0.5
        return self.emit("Where", [self.const(cond, np.bool_), a, b], lambda c, x, y: np.where(c, x, y))

    def model(self, outputs: list[str], dtype: type) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
        """The graph in ``dtype`` (float32 or float64), and its feeds."""

        def dims(name: str) -> list[Any]:
            return (
                [f"{name}_d{i}" for i in range(len(self.shapes[name]))]
                if self.dynamic
                else list(self.shapes[name])
            )

        inits = {k: v.astype(dtype) for k, v in self.params.items()}
        inits.update({k: v.astype(dtype) if v.dtype.kind == "f" else v for k, v in self.consts.items()})
        model = make_model(
            self.nodes,
            [(n, dtype, dims(n)) for n in self.inputs],
            [(o, dtype, list(self.shapes[o])) for o in outputs],
            inits,
        )
        return model, {k: v.astype(dtype) for k, v in self.inputs.items()}


def _broadcasts(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    try:
        return np.broadcast_shapes(a, b) == tuple(np.broadcast_shapes(b))
    except ValueError:
        return False


@st.composite
def random_graphs(draw: Callable[[st.SearchStrategy], Any]) -> tuple[RandomGraph, list[str]]:
    g = RandomGraph(draw, draw(st.integers(0, 2**32 - 1)))
    g.new_input(g.shape())
    for _ in range(draw(st.integers(1, 8))):
        last = g.grow()
    produced = [n for node in g.nodes for n in node.output]
    extra = draw(st.sampled_from(produced))
    return g, list(dict.fromkeys([last, extra]))


@settings(PROFILE)
@given(random_graphs(), st.sampled_from([np.float64, np.float32]))
def test_random_graph_gradients_match_finite_differences(graph, dtype):
    g, outputs = graph
    model64, feeds64 = g.model(outputs, np.float64)
    wrt = [*g.params, *g.inputs]
    result = check_gradients(model64, feeds64, wrt=wrt)
    assert result.ok, f"{[n.op_type for n in g.nodes]}\n{result.report()}"
    if dtype is np.float64:
        return
    # the float32 twin: same gradients up to float32 rounding
    model32, feeds32 = g.model(outputs, np.float32)
    rng = np.random.default_rng(1)
    graphs64, graphs32 = (
        build_gradient(m, trainable=list(g.params), inputs_requiring_grad=list(g.inputs))
        for m in (model64, model32)
    )
    cot = {o: rng.standard_normal(g.shapes[o]) for o in outputs}
    _, want = run_gradients(graphs64, feeds64, cot)
    _, got = run_gradients(graphs32, feeds32, {o: c.astype(np.float32) for o, c in cot.items()})
    for name, ref in want.items():
        assert got[name].dtype == np.float32 and got[name].shape == ref.shape
        scale = max(1.0, float(np.abs(ref).max(initial=0)))
        np.testing.assert_allclose(got[name], ref, rtol=2e-3, atol=2e-4 * scale, err_msg=name)


# ---- corrupted files --------------------------------------------------------------------------------
SEEDS: dict[str, tuple[bytes, dict[str, np.ndarray]]] = {
    "mlp": (mlp(np.float32).SerializeToString(), {"x": np.ones((2, 4), np.float32)}),
    "shapes": (shapes_model().SerializeToString(), {"x": np.ones((2, 6), np.float32)}),
    "conv": (conv_model().SerializeToString(), {"x": np.ones((2, 1, 5, 5), np.float32)}),
}
# The first byte of the graph's name: overwritten with 0xFF, the name is no longer UTF-8.
_GRAPH_NAME_BYTE = SEEDS["mlp"][0].find(b"\x12\x04test") + 2


def _mutate(data: bytes, mutations: list[tuple[str, int, int]]) -> bytes:
    out = bytearray(data)
    for kind, pos, value in mutations:
        if not out:
            break
        pos %= len(out)
        if kind == "xor":
            out[pos] ^= value
        elif kind == "set":
            out[pos] = value
        elif kind == "insert":
            out.insert(pos, value)
        elif kind == "delete":
            del out[pos]
        else:  # truncate
            del out[max(pos, 1) :]
    return bytes(out)


MUTATIONS = st.lists(
    st.tuples(
        st.sampled_from(["xor", "xor", "set", "insert", "delete", "truncate"]),
        st.integers(0, 1 << 20),
        st.integers(1, 255),
    ),
    min_size=1,
    max_size=6,
)


@pytest.fixture(scope="module")
def worker():
    w = Worker(REPO, timeout=60.0)
    yield w
    w.close()


@pytest.mark.parametrize(
    "validated",
    [
        pytest.param(False, id="entry-point"),
        pytest.param(True, id="load_untrusted"),
    ],
)
@settings(PROFILE, max_examples=PROFILE.max_examples * 3, phases=[Phase.explicit, Phase.generate])
@example(seed="mlp", mutations=[("set", _GRAPH_NAME_BYTE, 0xFF)])
@given(seed=st.sampled_from(sorted(SEEDS)), mutations=MUTATIONS)
def test_corrupted_files_end_in_onnxgrad_errors(worker, validated, seed, mutations):
    data, feeds = SEEDS[seed]
    outcome = worker.run(_mutate(data, mutations), feeds, validated)
    assert outcome.kind in ("ok", "onnxgrad"), (
        f"{seed} model with {mutations}: {outcome.kind} {outcome.error}\n{outcome.detail}"
    )


def test_seed_models_train_in_the_worker(worker):
    for name, (data, feeds) in SEEDS.items():
        assert worker.run(data, feeds, True).kind == "ok", name
        assert worker.run(data, feeds, False).kind == "ok", name


def test_random_graph_ops_all_have_gradient_rules():
    """The op menu only lists ops with gradient rules (a missing rule would silently shrink it)."""
    from onnxgrad import supported_ops

    assert set(UNARY + BINARY + OTHER) <= set(supported_ops())
