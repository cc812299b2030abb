"""optimum's own merged decoder: ``decoder_model_merged.onnx`` of a tiny random GPT-2 as optimum
writes it (tests/data/optimum_gpt2_merged.onnx, from tools/make_optimum_fixture.py), with its value
names. Its two If branches define the same names with different types (``/transformer/Add_1_output_0``
is an int64 position in the no-past branch, the float embeddings in the other); onnxruntime refused
onnxgrad's forward graph when they were mixed. Both branches are differentiated here against torch
float64 autograd of the same GPT-2: the weights, and in the cache branch the past keys and values.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

import onnxgrad
from onnxgrad.model.graph import to_array
from tests.zoo._util import cotangent, grad_errors, match_initializers

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "optimum_gpt2_merged.onnx"
# tools/make_optimum_fixture.py's CONFIG
CONFIG = dict(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2, n_inner=64)
BATCH, PAST, NEW = 2, 3, 4
KV = [f"{i}.{t}" for i in range(CONFIG["n_layer"]) for t in ("key", "value")]


@pytest.fixture(scope="module")
def merged_and_gpt2():
    """The fixture, and the GPT-2 it was exported from (float64), its weights read from the file."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model = onnx.load(FIXTURE)
    weights = {i.name.removesuffix("_merged_0"): to_array(i) for i in model.graph.initializer}
    gpt2 = GPT2LMHeadModel(GPT2Config(**CONFIG, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    with torch.no_grad():
        for name, p in gpt2.named_parameters():  # lm_head.weight is wte's (tied)
            p.copy_(torch.from_numpy(weights[name]))
    return model, gpt2.eval()


def _feeds(use_cache: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    past = PAST if use_cache else 0
    feeds = {
        "input_ids": rng.integers(0, CONFIG["vocab_size"], (BATCH, NEW)).astype(np.int64),
        "attention_mask": np.ones((BATCH, past + NEW), np.int64),
        "position_ids": np.tile(np.arange(past, past + NEW, dtype=np.int64), (BATCH, 1)),
        "use_cache_branch": np.array([use_cache]),
    }
    head = CONFIG["n_embd"] // CONFIG["n_head"]
    for kv in KV:
        feeds[f"past_key_values.{kv}"] = rng.standard_normal((BATCH, CONFIG["n_head"], past, head)).astype(
            np.float32
        )
    return feeds


def _torch_reference(gpt2, feeds, cots):
    """Outputs and gradients (parameters, past) of sum over outputs of output * cotangent, in float64."""
    from transformers import DynamicCache

    ref = gpt2.double()
    ref.zero_grad()
    past = [
        torch.tensor(feeds[f"past_key_values.{kv}"], dtype=torch.float64, requires_grad=True) for kv in KV
    ]
    cache = DynamicCache()
    if feeds["use_cache_branch"][0]:
        for i in range(CONFIG["n_layer"]):
            cache.update(past[2 * i], past[2 * i + 1], i)
    out = ref(
        input_ids=torch.from_numpy(feeds["input_ids"]),
        attention_mask=torch.from_numpy(feeds["attention_mask"]),
        position_ids=torch.from_numpy(feeds["position_ids"]),
        past_key_values=cache,
        use_cache=True,
    )
    present = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
    values = dict(zip(["logits", *[f"present.{kv}" for kv in KV]], [out.logits, *present]))
    loss = sum((v * torch.from_numpy(cots[k]).double()).sum() for k, v in values.items())
    loss.backward()
    grads = {n: p.grad.numpy() for n, p in ref.named_parameters()}
    past_grads = {f"past_key_values.{kv}": p.grad for kv, p in zip(KV, past)}
    return {k: v.detach().numpy() for k, v in values.items()}, grads, past_grads


@pytest.mark.parametrize("use_cache", [False, True], ids=["no_past_branch", "cache_branch"])
def test_both_branches_match_torch(merged_and_gpt2, use_cache):
    model, gpt2 = merged_and_gpt2
    feeds = _feeds(use_cache)
    total = (PAST if use_cache else 0) + NEW
    head = CONFIG["n_embd"] // CONFIG["n_head"]
    shapes = {"logits": (BATCH, NEW, CONFIG["vocab_size"])}
    shapes.update({f"present.{kv}": (BATCH, CONFIG["n_head"], total, head) for kv in KV})
    cots = {k: cotangent(s, seed=7 + i) for i, (k, s) in enumerate(shapes.items())}
    match = match_initializers(model, gpt2)
    assert not match.unmatched, match.unmatched
    past_names = [f"past_key_values.{kv}" for kv in KV] if use_cache else []

    fb = onnxgrad.ForwardBackward(model, inputs_requiring_grad=past_names)
    res = fb.forward(feeds)
    outputs, want, want_past = _torch_reference(gpt2, feeds, cots)
    for name, got in zip(fb.output_names, res.outputs):
        np.testing.assert_allclose(got, outputs[name], rtol=1e-4, atol=1e-4 * np.abs(outputs[name]).max())
    grads = res.backward(cots)
    # the default trainable set: every parameter, GPT-2's transposed head tied to the embedding
    assert set(fb.parameters) <= set(match.sources)
    got, covered = match.gather({**grads, **{n: np.zeros(match.sources[n].shape) for n in match.sources
                                             if n not in grads}})  # fmt: skip
    assert all(covered[n].all() for n in want)
    bad = grad_errors(got, want)
    assert not bad, f"{len(bad)} of {len(want)} parameter gradients differ from torch:\n" + "\n".join(bad)
    for name in past_names:
        w = want_past[name].numpy()
        np.testing.assert_allclose(grads[name], w, rtol=0, atol=1e-4 * np.abs(w).max())
