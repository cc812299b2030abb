"""Exported transformers (tiny configs, random weights): the default trainable set is the model's
parameters and 20 SGD steps through ``OnnxModule(model)`` follow torch's losses."""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("onnxscript")  # torch.onnx.export(dynamo=True)

from onnxgrad.autodiff.params import select_parameters  # noqa: E402
from onnxgrad.torch import OnnxModule  # noqa: E402

VOCAB, STEPS = 64, 20


class Logits(torch.nn.Module):
    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.net(input_ids=ids, use_cache=False).logits


def gpt2() -> torch.nn.Module:
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0, embd_pdrop=0
    )
    cfg.attn_pdrop = 0
    return transformers.GPT2LMHeadModel(cfg)


def llama() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
    )
    return transformers.LlamaForCausalLM(cfg)


@functools.cache  # one export per model for the whole file (seconds each)
def export(make) -> tuple[torch.nn.Module, object, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    net = make()
    net.config._attn_implementation = "eager"
    with torch.no_grad():  # at initialization biases are zeros and norm weights ones: the exporter
        for p in net.parameters():  # would fold or share them, where torch trains each
            p.add_(0.02 * torch.randn_like(p))
    module = Logits(net).eval()
    ids, targets = torch.randint(0, VOCAB, (2, 8)), torch.randint(0, VOCAB, (2, 8))
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(module, (ids,), dynamo=True, input_names=["ids"], output_names=["logits"])
    return module, program.model_proto, ids, targets


def sgd_losses(module: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> list[float]:
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(module(ids).reshape(-1, VOCAB), targets.reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("make", [gpt2, llama], ids=["gpt2", "llama"])
def test_sgd_through_onnx_module_follows_torch(make):
    module, model, ids, targets = export(make)
    selection = select_parameters(model)
    left_out = set(selection.reasons.values())
    assert "Pow exponent" in left_out and "scalar constant" in left_out and "additive mask" in left_out
    if make is gpt2:  # the tied head: the embedding and its folded transpose are one parameter
        assert [(t.source, t.how) for t in selection.ties] == [("net.lm_head.weight", "transpose [1, 0]")]
    else:
        assert {"epsilon", "rotary position table"} <= left_out and selection.ties == []
    onnx_module = OnnxModule(model)
    expected = sgd_losses(copy.deepcopy(module), ids, targets)
    got = sgd_losses(onnx_module, ids, targets)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, expected, rtol=1e-4)


def test_gpt2_head_trained_apart_without_ties():
    module, model, ids, targets = export(gpt2)
    expected = sgd_losses(copy.deepcopy(module), ids, targets)
    apart = sgd_losses(OnnxModule(model, tie_weights=False), ids, targets)
    assert apart[0] == pytest.approx(expected[0], rel=1e-5)  # same model, trained differently
    assert abs(apart[-1] - expected[-1]) > 1e-3
