"""Cross-check against PyTorch autograd on the three anchor models exported by torch.onnx.export.

float64 exports are compared per element (1e-6 relative); float32 runs through onnxruntime's
float32 kernels, where ReLU activations within 1e-7 of zero may flip between implementations, so
they are compared tie-aware: by the relative error of the whole gradient tensor.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from bench import anchors  # noqa: E402

import onnxgrad  # noqa: E402
from onnxgrad.model.graph import to_array  # noqa: E402
from onnxgrad.testing import assert_allclose_scaled, run_gradients  # noqa: E402

# Small batches keep the suite fast; the architectures are exactly the anchors'.
CASES = {
    "mlp": dict(batch=8),
    "cnn": dict(batch=2),
    "transformer": dict(batch=2, seq=8),
}


def _cotangent(module, x):
    # not ones: the transformer ends in LayerNorm, whose outputs sum to a constant
    gen = torch.Generator().manual_seed(7)
    shape = module(x).shape
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def _torch_grads(module, x, cot):
    module.zero_grad()
    module(x).backward(cot.to(x.dtype))
    return {n: p.grad.detach().double().numpy() for n, p in module.named_parameters()}


def _grouped_compare(model, onnx_grads, module, torch_grads, check):
    """Match ONNX initializers to torch parameters by value (possibly transposed, possibly tied).

    The TorchScript exporter may store a weight transposed, and aliases identical tensors through
    Identity (two fresh LayerNorms share their weight; onnxgrad trains the aliases apart, under
    their own names): for each group of equal values, the sum of onnxgrad's gradients must equal
    the sum of torch's.
    """
    params = {n: p.detach().double().numpy() for n, p in module.named_parameters()}
    values = {i.name: to_array(i).astype(np.float64) for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Identity" and node.input[0] in values:
            values[node.output[0]] = values[node.input[0]]
    matched = set()
    groups = []
    for name, value in values.items():
        if name not in onnx_grads:
            continue
        same = [n for n, p in params.items() if p.shape == value.shape and np.array_equal(p, value)]
        tr = [
            n
            for n, p in params.items()
            if p.ndim == 2 and p.T.shape == value.shape and np.array_equal(p.T, value)
        ]
        if same or tr:
            groups.append((name, same, tr))
    assert groups, "no initializer matched a torch parameter"
    by_value: dict[tuple, list] = {}
    for name, same, tr in groups:
        by_value.setdefault((tuple(same), tuple(tr)), []).append(name)
    for (same, tr), names in by_value.items():
        got = sum(onnx_grads[n] for n in names)
        want = sum(torch_grads[n] for n in same) + sum(torch_grads[n].T for n in tr)
        check(got, want, names)
        matched.update(same)
        matched.update(tr)
    assert matched == set(params), f"torch parameters without an ONNX gradient: {set(params) - matched}"


@pytest.mark.parametrize("name", list(CASES))
def test_anchor_float64_matches_torch(name):
    module = anchors.build(name).double()
    x = anchors.example_input(name, dtype=torch.float64, **CASES[name])
    model = anchors.export(module, x)
    graphs = onnxgrad.build_gradient(model)
    # onnxruntime has no float64 Conv kernel: the CNN runs on onnx.reference
    backend = "reference" if name == "cnn" else "onnxruntime"
    cot = _cotangent(module, x)
    out, grads = run_gradients(graphs, {"input": x.numpy()}, {"output": cot.numpy()}, backend=backend)
    np.testing.assert_allclose(out["output"], module(x).detach().numpy(), rtol=1e-9, atol=1e-9)

    def check(got, want, names):
        scale = max(np.abs(want).max(), 1e-4)  # exact zeros (e.g. attention key bias) compare absolutely
        assert_allclose_scaled(got, want, rtol=1e-6, scale=scale, err_msg=str(names))

    _grouped_compare(model, grads, module, _torch_grads(module, x, cot), check)


@pytest.mark.parametrize("name", list(CASES))
def test_anchor_float32_matches_torch_tie_aware(name):
    module = anchors.build(name)
    x = anchors.example_input(name, **CASES[name])
    model = anchors.export(module, x)
    fb = onnxgrad.ForwardBackward(model)
    res = fb.forward({"input": x.numpy()})
    ref = anchors.build(name).double()  # reference: torch in float64 on the same float32 weights
    ref.load_state_dict(module.state_dict())
    cot = _cotangent(ref, x.double())
    grads = res.backward({"output": cot.float().numpy()})
    torch_grads = _torch_grads(ref, x.double(), cot.float().double())

    def check(got, want, names):
        # the floor keeps exact-zero gradients (attention key bias) from dividing noise by zero
        err = np.linalg.norm(got - want) / (np.linalg.norm(want) + 1e-3 * np.sqrt(want.size))
        assert err < 1e-4, f"{names}: relative error {err:.2e}"

    _grouped_compare(model, grads, module, torch_grads, check)


def test_transformer_export_aliases_train_apart():
    """The trap of the anchors page: the exporter aliases the two fresh LayerNorms' equal weights
    and biases through Identity; they are distinct torch parameters and train apart."""
    module = anchors.build("transformer")
    model = anchors.export(module, anchors.example_input("transformer", batch=1, seq=4))
    lns = [n for n in model.graph.node if n.op_type == "LayerNormalization"]
    assert len(lns) == 2
    aliases = {n.output[0] for n in model.graph.node if n.op_type == "Identity"}
    assert {"norm2.weight", "norm2.bias"} <= aliases
    graphs = onnxgrad.build_gradient(model)
    assert len(graphs.trainable) == sum(1 for _ in module.parameters())
    assert {"norm1.weight", "norm2.weight", "norm1.bias", "norm2.bias"} <= set(graphs.trainable)
