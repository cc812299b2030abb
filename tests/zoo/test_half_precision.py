"""Zoo, half precision: the tiny BERT converted to float16 trains as torch autocast does.

The TorchScript export of ``bert`` (see _util) is converted by onnxruntime's own
``convert_float_to_float16`` (every weight and activation float16: the Gather of the embeddings
takes a ScatterND-add gradient, which onnxruntime's CPU provider has no float16 kernel for). The
reference is torch with the same weights rounded to float16, trained in float32 under
``torch.autocast("cpu", dtype=torch.float16)`` with ``torch.amp.GradScaler``; onnxgrad trains the
float16 model with :class:`onnxgrad.train.Trainer`'s defaults for half-precision models (float32
master weights, dynamic loss scaling).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from tests.zoo._util import (
    cotangent,
    exported,
    feeds_of,
    match_initializers,
    model_and_inputs,
    output_shape,
    torch_grads,
    train_target,
)

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
float16 = pytest.importorskip("onnxruntime.transformers.float16")

STEPS, LR = 10, 0.05
# torch.testing.assert_close's own tolerance for float16 (rtol 1e-3, atol 1e-5): the reported loss
# is itself a float16 (half an ulp is 2.4e-4 to 4.9e-4 relative); measured: 3.4e-4 at most
RTOL, ATOL = 1e-3, 1e-5


def _half_module() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """The zoo's BERT with every weight rounded to float16 (what the float16 model holds), float32."""
    module, inputs = model_and_inputs("bert")
    module = copy.deepcopy(module)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.half().float())
    return module, inputs


def _model16():
    return float16.convert_float_to_float16(exported("bert", "torchscript"))


def _autocast_losses(module: torch.nn.Module, inputs, target: np.ndarray) -> list[float]:
    module = copy.deepcopy(module)
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu")
    tgt = torch.from_numpy(target)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = module(*inputs)
        loss = ((out.float() - tgt) ** 2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    return losses


def test_float16_bert_trains_like_torch_autocast():
    from onnxgrad.train import Trainer

    model = _model16()
    module, inputs = _half_module()
    target = train_target(output_shape("bert"))
    want = _autocast_losses(module, inputs, target)
    feeds = {**feeds_of(model, inputs), "target": target.astype(np.float16)}
    trainer = Trainer(model, loss="mse", optimizer="sgd", lr=LR, batch_size=len(target), shuffle=False,
                      progress=False)  # fmt: skip
    got = trainer.fit(feeds, epochs=STEPS)["loss"]  # one batch per epoch: one loss per step
    assert trainer.amp is not None and trainer.amp.weights is not None
    assert {m.dtype for m in trainer.amp.weights.master.values()} == {np.dtype(np.float32)}
    # a float16 loss cannot hold torch's first scale 2^16: backed off once, no step skipped
    assert trainer.amp.scaler.scale == 2.0**15 and trainer.amp.scaler.skipped == 0
    bad = [
        f"step {i}: {g:.6g} vs autocast {w:.6g}"
        for i, (g, w) in enumerate(zip(got, want))
        if not abs(g - w) <= ATOL + RTOL * abs(w)
    ]
    assert not bad, "\n".join(bad)
    assert got[-1] < 0.6 * got[0]


def test_float16_bert_gradients_are_exact_to_the_precision():
    """ForwardBackward's float16 gradients against torch float64 autograd on the same (rounded)
    weights: within 1e-2 of each tensor's largest |gradient| (float16 keeps 11 bits; two layers of
    float16 activations and their gradients), that scale floored at 1e-2 of the model's largest."""
    import onnxgrad

    model = _model16()
    module, inputs = _half_module()
    # the float32 export and its module give the names (the float16 model keeps them)
    match = match_initializers(exported("bert", "torchscript"), model_and_inputs("bert")[0])
    assert match.sources
    cot = cotangent(output_shape("bert"))
    grads = onnxgrad.gradients(
        model,
        feeds_of(model, inputs),
        {model.graph.output[0].name: cot.astype(np.float16)},
        wrt=list(match.sources),
    )
    assert {g.dtype for g in grads.values()} == {np.dtype(np.float16)}
    got, _ = match.gather(grads)
    _, want = torch_grads(module, inputs, cot)
    top = max(float(np.abs(w).max()) for w in want.values())
    bad = []
    for name, w in want.items():
        scale = max(float(np.abs(w).max()), 1e-2 * top)
        err = float(np.abs(got[name] - w).max())
        if err > 1e-2 * scale:
            bad.append(f"{name}: {err:.3g} = {err / scale:.3g} of scale {scale:.3g}")
    assert not bad, "\n".join(bad)
