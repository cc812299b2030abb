"""Attention layers exported by torch's TorchScript exporter: gradients equal torch autograd's.

``torch.onnx.export(..., dynamo=False)`` writes MultiheadAttention with axes and shapes computed by
small graphs of constants (``Constant -> Add -> Mod -> Reshape -> Slice``) that ONNX shape inference
does not follow; onnxgrad evaluates them (``onnxgrad.model.fold``) so every rank is known.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import onnx  # noqa: E402
from torch import nn  # noqa: E402

import onnxgrad  # noqa: E402
from onnxgrad.torch import OnnxModule  # noqa: E402

D, HEADS, FFN = 16, 4, 32
BATCH, SEQ, MEM = 2, 5, 6


class SelfAttention(nn.Module):
    def __init__(
        self,
        *,
        mask: bool = False,
        need_weights: bool = False,
        padding: bool = False,
        batch_first: bool = True,
    ) -> None:
        super().__init__()
        self.m = nn.MultiheadAttention(D, HEADS, dropout=0.0, batch_first=batch_first)
        self.mask, self.need_weights, self.padding = mask, need_weights, padding

    def forward(self, x):
        mask = torch.triu(torch.full((SEQ, SEQ), float("-inf")), 1) if self.mask else None
        padding = torch.tensor([[False] * (SEQ - 1) + [True], [False] * SEQ]) if self.padding else None
        out, weights = self.m(
            x, x, x, need_weights=self.need_weights, attn_mask=mask, key_padding_mask=padding
        )
        return out if weights is None else (out, weights)


class Encoder(nn.Module):
    def __init__(self, **kwargs) -> None:
        super().__init__()
        self.m = nn.TransformerEncoderLayer(D, HEADS, FFN, dropout=0.0, batch_first=True, **kwargs)

    def forward(self, x):
        return self.m(x)


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.m = nn.TransformerDecoderLayer(D, HEADS, FFN, dropout=0.0, batch_first=True)

    def forward(self, x, mem):
        return self.m(x, mem, tgt_mask=nn.Transformer.generate_square_subsequent_mask(SEQ))


class TinyViT(nn.Module):
    """torchvision's ViT in miniature: patches, class token, position embedding, pre-norm
    encoder blocks with GELU, a head on the class token."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, D, 4, stride=4)
        self.cls = nn.Parameter(torch.zeros(1, 1, D))
        self.pos = nn.Parameter(torch.zeros(1, 5, D))
        layer = nn.TransformerEncoderLayer(
            D, HEADS, FFN, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, 3)

    def forward(self, img):
        x = self.patch(img).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        return self.head(self.norm(self.encoder(x))[:, 0])


def _inputs(name: str) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(1)
    if name == "vit":
        return (torch.randn(BATCH, 3, 8, 8, generator=gen),)
    x = torch.randn(BATCH, SEQ, D, generator=gen)
    if name == "seq_first":
        return (x.transpose(0, 1).contiguous(),)
    if name == "decoder":
        return x, torch.randn(BATCH, MEM, D, generator=gen)
    return (x,)


CASES = {
    "self_attention": lambda: SelfAttention(),
    "causal_mask_weights": lambda: SelfAttention(mask=True, need_weights=True),
    "padding_mask_weights": lambda: SelfAttention(need_weights=True, padding=True),
    "seq_first": lambda: SelfAttention(batch_first=False),
    "encoder": lambda: Encoder(),
    "encoder_pre_norm_gelu": lambda: Encoder(norm_first=True, activation="gelu"),
    "decoder": lambda: Decoder(),
    "vit": lambda: TinyViT(),
}


def _net(name: str, train: bool) -> nn.Module:
    torch.manual_seed(0)
    net = CASES[name]()
    with torch.no_grad():  # no two parameters equal (zero biases, unit norms), else torch shares them
        for p in net.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return net.train(train)


def _export(net: nn.Module, args: tuple[torch.Tensor, ...], train: bool) -> onnx.ModelProto:
    buf = io.BytesIO()
    mode = torch.onnx.TrainingMode.TRAINING if train else torch.onnx.TrainingMode.EVAL
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            net,
            args,
            buf,
            dynamo=False,
            training=mode,
            do_constant_folding=False,  # keeps the parameters' names (folding transposes weights)
            input_names=[f"in{i}" for i in range(len(args))],
        )
    return onnx.load_from_string(buf.getvalue())


def _grad_outputs(outs) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randn(o.shape, generator=gen) for o in outs]


def _reference(net: nn.Module, args: tuple[torch.Tensor, ...]):
    """Torch's outputs and the gradients of sum(out * gy) for every parameter and input."""
    args = tuple(a.clone().requires_grad_() for a in args)
    net.zero_grad()
    outs = net(*args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    gys = _grad_outputs(outs)
    sum(torch.sum(o * gy) for o, gy in zip(outs, gys)).backward()
    grads = {name: p.grad.clone() for name, p in net.named_parameters()}
    grads.update({f"in{i}": a.grad.clone() for i, a in enumerate(args)})
    return [o.detach() for o in outs], gys, grads


def _assert_close(got: dict, want: dict) -> None:
    """float32: within 1e-4 of each tensor's largest gradient, that floored at 1e-3 of the
    largest gradient of the model."""
    largest = max(float(w.abs().max()) for w in want.values())
    assert set(got) == set(want)
    for name, w in want.items():
        g = torch.as_tensor(np.asarray(got[name]))
        assert g.shape == w.shape, name
        tol = 1e-4 * max(float(w.abs().max()), 1e-3 * largest)
        err = float((g - w).abs().max())
        assert err <= tol, f"{name}: error {err:.3g} over {tol:.3g}"


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", list(CASES))
def test_gradients_match_torch(name, train):
    net = _net(name, train)
    args = _inputs(name)
    model = _export(net, args, train)
    assert {i.name for i in model.graph.initializer} >= {n for n, _ in net.named_parameters()}
    _, gys, want = _reference(net, args)
    feeds = {f"in{i}": a.numpy() for i, a in enumerate(args)}
    grad_outputs = {o.name: gy.numpy() for o, gy in zip(model.graph.output, gys)}
    got = onnxgrad.gradients(model, feeds, grad_outputs, wrt=list(want))
    _assert_close(got, want)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", ["causal_mask_weights", "encoder", "decoder", "vit"])
def test_onnx_module_trains_like_torch(name, train):
    net = _net(name, train)
    args = _inputs(name)
    m = OnnxModule(_export(net, args, train)).train(train)
    outs, gys, want = _reference(net, args)
    ins = tuple(a.clone().requires_grad_() for a in args)
    got_outs = m(*ins)
    got_outs = got_outs if isinstance(got_outs, tuple) else (got_outs,)
    for o, w in zip(got_outs, outs):
        torch.testing.assert_close(o.detach(), w, rtol=1e-4, atol=1e-5)
    sum(torch.sum(o * gy) for o, gy in zip(got_outs, gys)).backward()
    got = {m.onnx_names[t]: p.grad for t, p in m.named_parameters()}
    got.update({f"in{i}": a.grad for i, a in enumerate(ins)})
    _assert_close(got, want)


def test_default_export_eval_builds():
    """The exporter's defaults (constant folding, which renames transposed weights): the input
    gradient still equals torch's."""
    net = _net("encoder", False)
    (x,) = _inputs("encoder")
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (x,), buf, dynamo=False, input_names=["in0"])
    model = onnx.load_from_string(buf.getvalue())
    _, gys, want = _reference(net, (x,))
    gy = {model.graph.output[0].name: gys[0].numpy()}
    got = onnxgrad.gradients(model, {"in0": x.numpy()}, gy, wrt=["in0"])
    _assert_close(got, {"in0": want["in0"]})
