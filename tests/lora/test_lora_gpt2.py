"""LoRA on a tiny GPT-2 (transformers, random weights, torch.onnx.export(dynamo=True)): the adapters
alone overfit a short text, and the merged model gives the adapted model's logits."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("onnxscript")

from onnxgrad import lora  # noqa: E402
from onnxgrad.testing import assert_allclose_scaled  # noqa: E402
from onnxgrad.torch import OnnxModule  # noqa: E402

TEXT = "the quick brown fox jumps over the lazy dog"


def _export(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=64,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # away from the initialization's exact values
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, ids):
            return self.m(input_ids=ids, use_cache=False).logits

    ids = torch.tensor([[ord(c) % 64 for c in TEXT[:24]]])
    prog = torch.onnx.export(
        Logits().eval(),
        (ids[:, :-1],),
        dynamo=True,
        input_names=["ids"],
        output_names=["logits"],
        verbose=False,
    )
    return prog.model_proto, ids


def test_lora_gpt2_overfits_and_merges(tmp_path) -> None:
    base, ids = _export(tmp_path)
    adapted = lora.add_adapters(base, ["*attn*.weight", "*mlp*.weight"], rank=8, alpha=16)
    assert len(lora.adapter_names(adapted)) == 2 * 4 * 2  # A and B, 4 weights per layer, 2 layers
    module = OnnxModule(adapted)
    trained = {module.onnx_names[n] for n, _ in module.named_parameters()}
    assert trained == set(lora.adapter_names(adapted))  # only the adapters
    frozen_before = {n: b.clone() for n, b in module.named_buffers()}
    opt = torch.optim.Adam(module.parameters(), lr=1e-2)
    x, y = ids[:, :-1], ids[:, 1:]
    losses = []
    for _ in range(100):
        opt.zero_grad()
        logits = module(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.1 * losses[0], (losses[0], losses[-1])
    print(f"LoRA GPT-2: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    for n, b in module.named_buffers():  # the base did not move
        assert torch.equal(b, frozen_before[n])

    trained_model = module.to_onnx()
    merged = lora.merge(trained_model)
    import onnxruntime as ort

    def run(m):
        sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        return sess.run(None, {"ids": x.numpy()})[0]

    # merging, and onnxruntime's kernels (which depend on the CPU), change the float32 summation
    # order: a bound scaled by the logits' magnitude (2e-6 of it measured; a merge that lost the
    # adapters' scale would be off by the adapters' whole effect, checked to be far larger)
    unmerged = run(trained_model)
    assert np.abs(unmerged - run(base)).max() > 1e-2 * np.abs(unmerged).max()
    assert_allclose_scaled(run(merged), unmerged, rtol=1e-5)
    assert_allclose_scaled(unmerged, module(x), rtol=1e-5)
    # the adapters alone, saved and put back on the base, give the same model
    lora.save_adapters(trained_model, tmp_path / "adapters.safetensors")
    again = lora.load_adapters(base, tmp_path / "adapters.safetensors")
    np.testing.assert_array_equal(run(again), run(trained_model))


def test_recompute_layers_on_dynamo_gpt2(tmp_path) -> None:
    """recompute="layers" finds GPT-2's layers from the dynamo exporter's module paths."""
    import onnxgrad

    base, ids = _export(tmp_path)
    adapted = lora.add_adapters(base, ["*attn*.weight", "*mlp*.weight"], rank=4)
    plain = onnxgrad.build_gradient(adapted)
    rc = onnxgrad.build_gradient(adapted, recompute="layers")
    fed = set(plain.trainable) | {i.name for i in plain.forward.graph.input}
    assert len([n for n in rc.saved if n not in fed]) < len([n for n in plain.saved if n not in fed]) // 2
    x = ids[:, :-1].numpy()
    dy = np.random.default_rng(0).normal(size=(1, x.shape[1], 64)).astype(np.float32)
    g0 = onnxgrad.ForwardBackward(plain).forward({"ids": x}).backward([dy])
    g1 = onnxgrad.ForwardBackward(rc).forward({"ids": x}).backward([dy])
    # not bitwise here: onnxruntime fuses the forward session's ops (attention, GELU) differently
    # from their copies in the backward graph; float32 rounding apart
    for k in g0:
        assert_allclose_scaled(g1[k], g0[k], rtol=1e-5, err_msg=k)
