"""Gradient checks of the transformer rules (rules/attention/, SwiGLU in rules/elementwise.py):
Attention, RotaryEmbedding, SwiGLU.

Against float64 central finite differences through onnxruntime (Attention; it has no float64
RotaryEmbedding and loads no opset 28, so those and Attention-25 run on onnx.reference), plus
float32 onnxruntime checks, and against torch in float64: scaled_dot_product_attention, and a few
lines of torch for the rotary embedding and SwiGLU.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnxruntime
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper

import onnxgrad.autodiff.rules.attention  # noqa: F401  (registers the rules until rules/__init__ imports it)
from onnxgrad import testing
from onnxgrad.autodiff.engine import build_gradient
from onnxgrad.model.graph import ir_version_for
from onnxgrad.testing import assert_allclose_scaled, check_gradients, node_model
from tests.autodiff.conftest import ensure_output_shape
from tests.autodiff.random_data import reseed, rnd, rng  # one generator per test (conftest.py)
from tests.models import ort_loads_opset

from .test_rules_linalg import torch_grads

F32 = np.float32
REF = "reference"


def check(
    op: str,
    inputs: Sequence[np.ndarray | None],
    attrs: dict[str, Any],
    opset: int,
    *,
    n_outputs: int = 1,
    backend: testing.Backend = "onnxruntime",
    dynamic: bool = False,
) -> None:
    """Finite-difference check of every floating-point input (every output with a cotangent)."""
    model = node_model(op, inputs, attrs=attrs, opset=opset, n_outputs=n_outputs, dynamic=dynamic)
    feeds = {i.name: np.asarray(inputs[int(i.name[2:])]) for i in model.graph.input}
    if dynamic and not model.graph.output[0].type.tensor_type.HasField("shape"):
        y = testing.run_model(node_model(op, inputs, attrs=attrs, opset=opset), backend)(feeds)["out0"]
        ensure_output_shape(model, y.shape, dynamic=True)
    wrt = [k for k, v in feeds.items() if v.dtype.kind == "f"]
    result = check_gradients(model, feeds, wrt=wrt, backend=backend)
    assert result.ok, result.report()


# ---- Attention ------------------------------------------------------------------------------
def qkv(b: int, hq: int, hkv: int, sq: int, skv: int, d: int = 5, dv: int = 7) -> list[np.ndarray]:
    return [rnd(b, hq, sq, d), rnd(b, hkv, skv, d), rnd(b, hkv, skv, dv)]


def qkv3(b: int, hq: int, hkv: int, sq: int, skv: int, d: int = 5, dv: int = 7) -> list[np.ndarray]:
    return [rnd(b, sq, hq * d), rnd(b, skv, hkv * d), rnd(b, skv, hkv * dv)]


reseed("test_rules_attention.py cases")  # the cases below draw at import: from a generator of their own
ATTENTION_CASES = [
    # (id, inputs, attrs, number of outputs)
    ("mha-cross", qkv(2, 3, 3, 4, 6), {}, 1),
    ("gqa", qkv(2, 4, 2, 4, 6), {}, 1),
    ("mqa", qkv(1, 3, 1, 4, 5), {"scale": 0.7}, 1),
    ("3d-gqa", qkv3(2, 4, 2, 4, 6), {"q_num_heads": 4, "kv_num_heads": 2}, 1),
    ("causal", qkv(2, 2, 2, 4, 4), {"is_causal": 1}, 1),
    ("causal-bottom-right", qkv(1, 2, 2, 3, 6), {"is_causal": 1}, 1),
    ("bool-mask", [*qkv(2, 3, 3, 4, 6), rng().random((4, 6)) > 0.3], {}, 1),
    ("float-mask-broadcast", [*qkv(2, 3, 3, 4, 6), rnd(2, 1, 4, 6)], {"scale": 0.3}, 1),
    ("float-mask-heads", [*qkv(2, 4, 2, 4, 6), rnd(4, 4, 6)], {}, 1),
    ("past-present", [*qkv(2, 2, 2, 3, 3), None, rnd(2, 2, 2, 5), rnd(2, 2, 2, 7)], {"is_causal": 1}, 3),
    (
        "past-3d-gqa",
        [*qkv3(1, 4, 2, 2, 2), None, rnd(1, 2, 3, 5), rnd(1, 2, 3, 7)],
        {"q_num_heads": 4, "kv_num_heads": 2},
        3,
    ),
    ("softcap", [*qkv(2, 2, 2, 4, 6), rnd(4, 6)], {"softcap": 1.5, "scale": 0.8}, 1),
]


@pytest.mark.parametrize(
    ("inputs", "attrs", "n_out"), [c[1:] for c in ATTENTION_CASES], ids=[c[0] for c in ATTENTION_CASES]
)
@pytest.mark.parametrize("opset", [23, 24])
def test_attention(inputs: list, attrs: dict, n_out: int, opset: int) -> None:
    """float64 through onnxruntime, present_key/value taking gradients too where returned."""
    check("Attention", inputs, attrs, opset, n_outputs=n_out)


def test_attention_opset24_inputs() -> None:
    """A float mask shorter than the keys (padded with -inf), and nonpad_kv_seqlen with is_causal."""
    check("Attention", [*qkv(2, 3, 3, 4, 6), rnd(4, 4)], {}, 24)
    check("Attention", [*qkv(2, 3, 3, 4, 6), None, None, None, np.array([4, 6])], {"is_causal": 1}, 24)


def test_attention_opset25_windows_and_causal_with_mask() -> None:
    """On onnx.reference: onnxruntime 1.31 knows no window attributes, and fails to load float64
    Attention with is_causal and a float mask."""
    check("Attention", qkv(1, 2, 2, 4, 6), {"left_window_size": 1, "right_window_size": 0}, 25, backend=REF)
    check("Attention", [*qkv(1, 4, 2, 4, 4), rnd(4, 4)], {"is_causal": 1, "softcap": 2.0}, 23, backend=REF)


def test_attention_fully_masked_row_has_zero_gradient() -> None:
    """A query row that attends nothing outputs 0 (onnx.reference; onnxruntime 1.31 gives NaN)."""
    mask = np.array([[True] * 6, [False] * 6, [True, False] * 3, [False] * 5 + [True]])
    inputs = [*qkv(1, 2, 2, 4, 6), mask]
    check("Attention", inputs, {}, 23, backend=REF)
    model = node_model("Attention", inputs, opset=23)
    graphs = build_gradient(model, trainable=[], inputs_requiring_grad=["in0", "in1", "in2"])
    _, grads = testing.run_gradients(graphs, {f"in{i}": x for i, x in enumerate(inputs)}, backend=REF)
    np.testing.assert_array_equal(grads["in0"][:, :, 1], 0.0)
    assert np.all(np.isfinite(grads["in1"])) and np.all(np.isfinite(grads["in2"]))


@pytest.mark.parametrize("case", [0, 1, 3], ids=["mha", "gqa", "3d-gqa"])
def test_attention_dynamic(case: int) -> None:
    """Every dim symbolic: head counts of 4-D inputs are read at run time."""
    _, inputs, attrs, _ = ATTENTION_CASES[case]
    check("Attention", inputs, attrs, 23, dynamic=True)


def test_attention_float32() -> None:
    inputs = [x.astype(F32) for x in [*qkv(2, 4, 2, 4, 6), rnd(4, 6)]]
    check("Attention", inputs, {"softcap": 2.0}, 23)


def sdpa(mask: bool = False, **kw: Any) -> Any:
    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor | None = None) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m if mask else None, **kw)

    return f


@pytest.mark.parametrize(
    ("inputs", "attrs", "fn"),
    [
        (qkv(2, 3, 3, 4, 6), {}, sdpa()),
        # 0.25: exact in float32 and so is its square root, which onnx.reference takes in float32
        (qkv(2, 4, 2, 4, 6), {"scale": 0.25}, sdpa(scale=0.25, enable_gqa=True)),
        (qkv(2, 2, 2, 5, 5), {"is_causal": 1}, sdpa(is_causal=True)),
        ([*qkv(2, 3, 3, 4, 6), rnd(2, 1, 4, 6)], {}, sdpa(mask=True)),
        ([*qkv(2, 3, 3, 4, 6), rng().random((4, 6)) > 0.3], {}, sdpa(mask=True)),
    ],
    ids=["mha", "gqa-scale", "causal", "float-mask", "bool-mask"],
)
def test_attention_versus_torch(inputs: list, attrs: dict, fn: Any) -> None:
    """On onnx.reference: onnxruntime's float64 Attention rounds its default scale to float32."""
    torch_grads("Attention", inputs, attrs, fn, opset=23, backend=REF)


def test_attention_3d_versus_torch() -> None:
    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        def heads(t: torch.Tensor, h: int) -> torch.Tensor:
            return t.reshape(t.shape[0], t.shape[1], h, -1).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(q, 4), heads(k, 2), heads(v, 2), enable_gqa=True)
        return y.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1)

    torch_grads(
        "Attention", qkv3(2, 4, 2, 3, 5), {"q_num_heads": 4, "kv_num_heads": 2}, f, opset=23, backend=REF
    )


def attention_model(inputs: list[np.ndarray], attrs: dict, outputs: list[str]) -> Any:
    """An Attention node whose outputs are ``outputs`` ('' for an unused slot), all returned."""
    names = [f"in{i}" for i in range(len(inputs))]
    vis = [helper.make_tensor_value_info(n, TensorProto.DOUBLE, x.shape) for n, x in zip(names, inputs)]
    node = helper.make_node("Attention", names, outputs, **attrs)
    shapes = {"y": None, "qk": None}
    outs = [helper.make_tensor_value_info(o, TensorProto.DOUBLE, shapes.get(o)) for o in outputs if o]
    model = helper.make_model(
        helper.make_graph([node], "g", vis, outs), opset_imports=[helper.make_opsetid("", 23)]
    )
    model.ir_version = ir_version_for(model.opset_import)
    import onnx

    return onnx.shape_inference.infer_shapes(model)


def test_attention_probabilities_output_used_by_the_model() -> None:
    """qk_matmul_output in mode 3 is the softmax: the rule reads it, and its gradient adds to dP."""
    inputs = qkv(2, 2, 2, 3, 4)
    model = attention_model(inputs, {"qk_matmul_output_mode": 3}, ["y", "", "", "qk"])
    result = check_gradients(model, {f"in{i}": x for i, x in enumerate(inputs)}, wrt=["in0", "in1", "in2"])
    assert result.ok, result.report()


def test_attention_rule_asks_the_forward_for_the_probabilities() -> None:
    model = node_model("Attention", qkv(1, 2, 2, 3, 4), opset=23)
    graphs = build_gradient(model, trainable=[], inputs_requiring_grad=["in0", "in1", "in2"])
    node = graphs.forward.graph.node[0]
    assert (
        helper.get_attribute_value(next(a for a in node.attribute if a.name == "qk_matmul_output_mode")) == 3
    )
    assert node.output[3] in graphs.saved
    assert set(graphs.saved) == {"in0", "in1", "in2", node.output[3]}


QK_MODE_CASES = [
    (case, mode)
    for case in ("mha-mask-softcap", "gqa-mask-softcap", "causal", "mask-only")
    for mode in range(4)
    if not (case == "causal" and mode == 2)  # -inf in the output: no finite differences
]


@pytest.mark.parametrize(("case", "mode"), QK_MODE_CASES)
def test_attention_qk_matmul_output_used_in_any_mode(case: str, mode: int) -> None:
    """The model reads qk_matmul_output in mode 0 (scale Q K^T), 1 (softcapped), 2 (and masked) or
    3 (probabilities): a mode-3 copy of the node gives the probabilities, and the output's gradient
    joins at its stage. float64 through onnxruntime (onnx.reference's mode 0 includes the softcap)."""
    if case == "mha-mask-softcap":
        inputs, attrs = [*qkv(2, 2, 2, 3, 4), rnd(3, 4)], {"softcap": 1.5, "scale": 0.6}
    elif case == "gqa-mask-softcap":
        inputs, attrs = [*qkv(1, 4, 2, 4, 4), rnd(4, 4)], {"softcap": 2.0}
    elif case == "causal":
        inputs, attrs = qkv(1, 4, 2, 4, 4), {"is_causal": 1, "softcap": 2.0}
    else:
        inputs, attrs = [*qkv(1, 3, 3, 3, 5), rnd(1, 3, 3, 5)], {}
    model = attention_model(inputs, {**attrs, "qk_matmul_output_mode": mode}, ["y", "", "", "qk"])
    wrt = [f"in{i}" for i in range(len(inputs))]
    result = check_gradients(model, {f"in{i}": x for i, x in enumerate(inputs)}, wrt=wrt)
    assert result.ok, result.report()
    # the qk output alone
    model = attention_model(inputs, {**attrs, "qk_matmul_output_mode": mode}, ["y", "", "", "qk"])
    graphs = build_gradient(model, trainable=[], inputs_requiring_grad=wrt, outputs=["qk"])
    result = check_gradients(model, {f"in{i}": x for i, x in enumerate(inputs)}, wrt=wrt, graphs=graphs)
    assert result.ok, result.report()


# ---- RotaryEmbedding ------------------------------------------------------------------------
def rope_case(three_d: bool, positions: bool, rot: int = 0, interleaved: int = 0) -> tuple[list, dict]:
    b, s, h, d = 2, 4, 3, 8
    half = (rot or d) // 2
    x = rnd(b, s, h * d) if three_d else rnd(b, h, s, d)
    if positions:
        caches = [rnd(10, half), rnd(10, half), rng().integers(0, 10, (b, s))]
    else:
        caches = [rnd(b, s, half), rnd(b, s, half)]
    attrs: dict[str, Any] = {"interleaved": interleaved}
    if three_d:
        attrs["num_heads"] = h
    if rot:
        attrs["rotary_embedding_dim"] = rot
    return [x, *caches], attrs


ROPE_CASES = [
    (False, False, 0, 0),
    (False, False, 0, 1),
    (True, True, 0, 0),
    (True, True, 6, 1),
    (False, True, 4, 0),
]


@pytest.mark.parametrize(
    ("three_d", "positions", "rot", "interleaved"),
    ROPE_CASES,
    ids=["4d", "4d-interleaved", "3d-positions", "3d-partial-interleaved", "4d-positions-partial"],
)
def test_rotary_embedding(three_d: bool, positions: bool, rot: int, interleaved: int) -> None:
    """X, cos_cache and sin_cache: float64 on onnx.reference, float32 on onnxruntime."""
    inputs, attrs = rope_case(three_d, positions, rot, interleaved)
    check("RotaryEmbedding", inputs, attrs, 23, backend=REF)
    check("RotaryEmbedding", [x.astype(F32) if x.dtype.kind == "f" else x for x in inputs], attrs, 23)


def test_rotary_embedding_dynamic() -> None:
    inputs, attrs = rope_case(True, True, 6, 0)
    check(
        "RotaryEmbedding",
        [x.astype(F32) if x.dtype.kind == "f" else x for x in inputs],
        attrs,
        23,
        dynamic=True,
    )


def torch_rope(interleaved: bool, rot: int, num_heads: int | None) -> Any:
    def f(
        x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor | None = None
    ) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(shape[0], shape[1], num_heads, -1) if num_heads else x.transpose(1, 2)  # (B, S, H, D)
        if pos is not None:
            cos, sin = cos[pos], sin[pos]
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        r = rot or x.shape[-1]
        turn, keep = x[..., :r], x[..., r:]
        x1, x2 = (turn[..., 0::2], turn[..., 1::2]) if interleaved else turn.chunk(2, dim=-1)
        y1, y2 = cos * x1 - sin * x2, sin * x1 + cos * x2
        y = torch.stack([y1, y2], dim=-1).flatten(-2) if interleaved else torch.cat([y1, y2], dim=-1)
        y = torch.cat([y, keep], dim=-1)
        return y.reshape(shape) if num_heads else y.transpose(1, 2)

    return f


@pytest.mark.parametrize(
    ("three_d", "positions", "rot", "interleaved"),
    [ROPE_CASES[1], ROPE_CASES[3]],
    ids=["4d-interleaved", "3d-partial"],
)
def test_rotary_embedding_versus_torch(three_d: bool, positions: bool, rot: int, interleaved: int) -> None:
    inputs, attrs = rope_case(three_d, positions, rot, interleaved)
    fn = torch_rope(bool(interleaved), rot, attrs.get("num_heads"))
    torch_grads("RotaryEmbedding", inputs, attrs, fn, backend=REF, opset=23, wrt=[0, 1, 2])


# ---- SwiGLU ---------------------------------------------------------------------------------
@pytest.mark.parametrize("alpha", [None, 1.7])
def test_swiglu(alpha: float | None) -> None:
    """Opset 28: onnx.reference only (onnxruntime 1.31 loads opsets up to 26)."""
    attrs = {} if alpha is None else {"alpha": alpha}
    check("SwiGLU", [rnd(3, 4), rnd(3, 4)], attrs, 28, backend=REF)
    a = float(F32(alpha or 1.0))  # the attribute is a float32
    torch_grads(
        "SwiGLU",
        [rnd(2, 5), rnd(2, 5)],
        attrs,
        lambda x, y: x * torch.sigmoid(a * x) * y,
        backend=REF,
        opset=28,
    )


# ---- LinearAttention (opset 27) ----------------------------------------------------------------
def torch_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    past: torch.Tensor | None,
    decay: torch.Tensor | None,
    beta: torch.Tensor | None,
    hq: int,
    hkv: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence of the ONNX definition, step by step (float64)."""
    b, t, _ = q.shape
    dk, dv, r = q.shape[-1] // hq, v.shape[-1] // hkv, hq // hkv
    q4 = q.reshape(b, t, hq, dk).transpose(1, 2)
    k4 = k.reshape(b, t, hkv, dk).transpose(1, 2)
    v4 = v.reshape(b, t, hkv, dv).transpose(1, 2)
    state = past if past is not None else torch.zeros(b, hkv, dk, dv, dtype=q.dtype)
    outs = []
    for i in range(t):
        if decay is not None:
            state = state * torch.exp(decay[:, i].reshape(b, hkv, -1))[..., None]
        vt = v4[:, :, i]
        if beta is not None:
            vt = beta[:, i].reshape(b, -1, 1) * (vt - torch.einsum("bhdm,bhd->bhm", state, k4[:, :, i]))
        state = state + k4[:, :, i, :, None] * vt[:, :, None, :]
        outs.append(
            torch.einsum("bhd,bhdm->bhm", q4[:, :, i], state.repeat_interleave(r, dim=1)) / math.sqrt(dk)
        )
    return torch.stack(outs, 2).transpose(1, 2).reshape(b, t, hq * dv), state


def linear_attention_inputs(
    rule: str, hq: int, hkv: int, per_head_decay: bool, shared_beta: bool, past: bool
) -> list[np.ndarray | None]:
    b, t, dk, dv = 2, 3, 3, 4
    inputs = [rnd(b, t, hq * dk), rnd(b, t, hkv * dk) * 0.5, rnd(b, t, hkv * dv)]
    inputs.append(rnd(b, hkv, dk, dv) if past else None)
    inputs.append(-np.abs(rnd(b, t, hkv if per_head_decay else hkv * dk)) if "gated" in rule else None)
    inputs.append(1 / (1 + np.exp(-rnd(b, t, 1 if shared_beta else hkv))) if "delta" in rule else None)
    while inputs[-1] is None:
        inputs.pop()
    return inputs


LINEAR_ATTENTION_CASES = [
    # (update rule, q heads, kv heads, per-head decay, one beta for all heads, past_state)
    (rule, *shape)
    for rule in ("linear", "gated", "delta", "gated_delta")
    for shape in ((2, 2, True, False, True), (4, 2, False, True, False))
]


@pytest.mark.parametrize("outputs", [("out0", "out1"), ("out0",), ("out1",)], ids=["both", "output", "state"])
@pytest.mark.parametrize(("rule", "hq", "hkv", "per_head", "shared", "past"), LINEAR_ATTENTION_CASES)
def test_linear_attention_versus_torch(
    rule: str, hq: int, hkv: int, per_head: bool, shared: bool, past: bool, outputs: tuple[str, ...]
) -> None:
    """float64: the forward on onnx.reference equals the recurrence in torch (to its float32
    arithmetic), the backward (two Scans, run on onnxruntime) equals torch autograd exactly."""
    inputs = linear_attention_inputs(rule, hq, hkv, per_head, shared, past)
    attrs = {"q_num_heads": hq, "kv_num_heads": hkv, "update_rule": rule}
    model = node_model("LinearAttention", inputs, attrs=attrs, n_outputs=2, opset=27)
    feeds = {i.name: inputs[int(i.name[2:])] for i in model.graph.input}
    graphs = build_gradient(model, trainable=[], inputs_requiring_grad=list(feeds), outputs=list(outputs))
    fwd = testing.run_model(graphs.forward, REF)(feeds)
    cot = {o: rnd(*fwd[o].shape) for o in outputs}
    bfeeds = {s: fwd[s] if s in fwd else feeds[s] for s in graphs.saved}
    bfeeds.update({graphs.grad_inputs[o]: c for o, c in cot.items()})
    if not ort_loads_opset(27):  # onnx.reference's Scan runs forward only: the backward needs onnxruntime
        pytest.skip(f"onnxruntime {onnxruntime.__version__} cannot load opset 27")
    res = testing.run_model(graphs.backward, "onnxruntime")(bfeeds)
    ts = [None if x is None else torch.tensor(x, requires_grad=True) for x in inputs]
    ts += [None] * (6 - len(ts))
    y, state = torch_linear_attention(*ts, hq, hkv)  # type: ignore[arg-type]
    assert_allclose_scaled(fwd["out0"], y.detach().numpy(), rtol=1e-5)
    assert_allclose_scaled(fwd["out1"], state.detach().numpy(), rtol=1e-5)
    loss = sum((t * torch.tensor(cot[o])).sum() for o, t in (("out0", y), ("out1", state)) if o in cot)
    loss.backward()  # type: ignore[union-attr]
    for i, t in enumerate(ts):
        if t is None:
            continue
        want = np.zeros(t.shape) if t.grad is None else t.grad.numpy()
        got = res[graphs.grad_outputs[f"in{i}"]]
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-11, err_msg=f"in{i}")


@pytest.mark.parametrize("opset", [27, 28])
@pytest.mark.parametrize("rule", ["linear", "gated", "delta", "gated_delta"])
def test_linear_attention_float32_onnxruntime(rule: str, opset: int) -> None:
    """Finite differences through onnxruntime's own kernel (float32 only), symbolic dims too."""
    if not ort_loads_opset(opset):
        pytest.skip(f"this onnxruntime loads no opset {opset}")
    inputs = [
        None if x is None else x.astype(F32) for x in linear_attention_inputs(rule, 4, 2, True, False, True)
    ]
    attrs = {"q_num_heads": 4, "kv_num_heads": 2, "update_rule": rule}
    for dynamic in (False, True):
        model = node_model("LinearAttention", inputs, attrs=attrs, n_outputs=2, opset=opset, dynamic=dynamic)
        feeds = {i.name: inputs[int(i.name[2:])] for i in model.graph.input}
        result = check_gradients(model, feeds, wrt=list(feeds), eps=1e-2, rtol=5e-2, atol=1e-2)
        assert result.ok, result.report()
