"""Zoo, deployed models: BERT and GPT-2 fused by onnxruntime's transformer optimizer.

The zoo's tiny BERT and GPT-2 (see _util) exported with TorchScript, then
``onnxruntime.transformers.optimizer.optimize_model(model_type="bert"/"gpt2", num_heads=4,
hidden_size=32, opt_level=0 and 99)``: SkipLayerNormalization, BiasGelu and FastGelu
(``com.microsoft``) replace the standard ops, at opt_level 0 without importing com.microsoft. Their
gradients are checked against torch autograd (every parameter, initializers mapped by value, see
:func:`~tests.zoo._util.match_initializers`) and against finite differences on the fused model
itself (a few elements of every initializer), and SGD through ``ForwardBackward`` follows torch's
losses.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import logging
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest

from tests.zoo._util import (
    STEPS,
    cotangent,
    grad_errors,
    loss_errors,
    match_initializers,
    model_and_inputs,
    torch,
    torch_grads,
    torch_losses,
    train_target,
)

pytest.importorskip("transformers")
optimizer = pytest.importorskip("onnxruntime.transformers.optimizer")

CASES = [(name, level) for name in ("bert", "gpt2") for level in (0, 99)]
IDS = [f"{name}-opt{level}" for name, level in CASES]
LR = 0.05


@contextlib.contextmanager
def _masks_without_vmap() -> Iterator[None]:
    """transformers builds GPT-2's causal mask with torch.vmap, which the TorchScript exporter
    cannot trace ("unordered_map::at"): its mask function for older torch releases (plain
    broadcasting, the same mask) while exporting."""
    from transformers import masking_utils as mu

    saved = mu._is_torch_greater_or_equal_than_2_6, mu.sdpa_mask
    mu._is_torch_greater_or_equal_than_2_6, mu.sdpa_mask = False, mu.sdpa_mask_older_torch
    try:
        yield
    finally:
        mu._is_torch_greater_or_equal_than_2_6, mu.sdpa_mask = saved


@functools.cache
def fused(name: str, level: int) -> onnx.ModelProto:
    """The zoo model ``name`` exported with TorchScript and fused by onnxruntime's optimizer."""
    module, inputs = model_and_inputs(name)
    buf = io.BytesIO()
    with warnings.catch_warnings(), _masks_without_vmap():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            copy.deepcopy(module), inputs, buf, input_names=["input_ids"], output_names=["output"],
            dynamo=False, opset_version=17,
        )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.onnx"
        path.write_bytes(buf.getvalue())
        logging.disable(logging.WARNING)  # the optimizer logs every fusion it does not find
        try:
            opt = optimizer.optimize_model(
                str(path), model_type=name, num_heads=4, hidden_size=32, opt_level=level
            )
        finally:
            logging.disable(logging.NOTSET)
        return opt.model


def _feeds(name: str) -> dict[str, np.ndarray]:
    _, inputs = model_and_inputs(name)
    return {"input_ids": inputs[0].numpy()}


@pytest.mark.parametrize(("name", "level"), CASES, ids=IDS)
def test_fused_gradients_match_torch(name: str, level: int) -> None:
    """Every parameter's gradient (float64 torch reference) and the output, through the fused graph."""
    import onnxgrad

    model = fused(name, level)
    contrib = {n.op_type for n in model.graph.node if n.domain == "com.microsoft"}
    assert "SkipLayerNormalization" in contrib and contrib & {"BiasGelu", "FastGelu"}, contrib
    module, inputs = model_and_inputs(name)
    match = match_initializers(model, module)
    assert match.sources, "no initializer matched a parameter"
    with torch.no_grad():
        out_shape = tuple(module(*inputs).shape)
    cot = cotangent(out_shape)
    grads = onnxgrad.gradients(model, _feeds(name), {"output": cot}, wrt=list(match.sources))
    got, covered = match.gather(grads)
    want_out, want = torch_grads(module, inputs, cot)
    lost = {n: int((~covered[n] & (want[n] != 0)).sum()) for n in want}
    assert not {n: k for n, k in lost.items() if k}, lost
    bad = grad_errors(got, want)
    assert not bad, f"{len(bad)} of {len(want)} parameter gradients differ from torch:\n" + "\n".join(bad)
    out = onnxgrad.ForwardBackward(model).forward(_feeds(name), training=False).outputs[0]
    np.testing.assert_allclose(out, want_out, rtol=0, atol=1e-4 * np.abs(want_out).max())


@pytest.mark.parametrize(("name", "level"), CASES, ids=IDS)
def test_fused_gradients_match_finite_differences(name: str, level: int) -> None:
    """A few elements of every float initializer of the fused model, float32 finite differences."""
    from onnxgrad.testing import check_gradients

    result = check_gradients(fused(name, level), _feeds(name), max_elements=3)
    assert result.ok, result.report()


@pytest.mark.parametrize(("name", "level"), CASES, ids=IDS)
def test_fused_training_follows_torch(name: str, level: int) -> None:
    """STEPS plain-SGD steps on mean((output - target)^2) through ForwardBackward, every parameter
    trained, against torch's float32 losses (the same weights)."""
    import onnxgrad

    model = fused(name, level)
    module, inputs = model_and_inputs(name)
    with torch.no_grad():
        target = train_target(tuple(module(*inputs).shape))
    want = torch_losses(module, inputs, target, lr=LR)
    exact = torch_losses(module, inputs, target, torch.float64, lr=LR)
    fb = onnxgrad.ForwardBackward(model)
    got = []
    for _ in range(STEPS):
        res = fb.forward(_feeds(name))
        out = res.outputs[0]
        got.append(float(np.mean((out.astype(np.float64) - target) ** 2)))
        grads = res.backward({"output": (2 * (out - target) / out.size).astype(np.float32)})
        params = fb.parameters
        for k, g in grads.items():
            params[k] -= LR * g
    assert got[-1] < got[0]
    bad = loss_errors(got, want, exact)
    assert not bad, f"{len(bad)} of {STEPS} losses leave torch's:\n" + "\n".join(bad[:5])
