"""Zoo, decoders with a KV cache (optimum's layout, see _decoders): GPT-2 and Llama.

The with-past export fed empty caches (past length 0) and the merged export fed
``use_cache_branch = False`` compute the plain model: their gradients match torch autograd (the
zoo's check: 1e-4 of scale) and 10 SGD steps through ForwardBackward follow torch's float32 losses.
Each model is exported twice (with and without past, dynamo); the exports are cached per process.
"""

from __future__ import annotations

import numpy as np
import pytest

import onnxgrad
from tests.zoo._decoders import decoder, empty_past, io_names, merge_decoders
from tests.zoo._util import (
    TRAIN_RTOL,
    cotangent,
    grad_errors,
    match_initializers,
    model_and_inputs,
    output_shape,
    torch_grads,
    torch_losses,
    train_target,
)

pytest.importorskip("transformers")

STEPS = 10
CASES = [pytest.param(m, k, id=f"{m}-{k}") for m in ("gpt2", "llama") for k in ("with_past", "merged")]


def _model_and_feeds(name: str, kind: str) -> tuple:
    """The with-past or merged model, and its feeds for the no-cache path."""
    with_past = decoder(name, past=True)
    ids = model_and_inputs(name)[1][0].numpy()
    batch, seq = ids.shape
    feeds = {"input_ids": ids, "attention_mask": np.ones((batch, seq), np.int64)}
    feeds.update(zip(io_names(name, past=True)[0][2:], empty_past(name, batch)))
    if kind == "with_past":
        return with_past, feeds
    merged = merge_decoders(decoder(name, past=False), with_past)
    return merged, {**feeds, "use_cache_branch": np.array([False])}


@pytest.mark.parametrize(("name", "kind"), CASES)
def test_gradients_match_torch(name, kind):
    model, feeds = _model_and_feeds(name, kind)
    module, inputs = model_and_inputs(name)
    match = match_initializers(model, module)
    assert match.sources, "no initializer matched a parameter"
    cot = cotangent(output_shape(name))
    grads = onnxgrad.gradients(model, feeds, {"logits": cot}, wrt=list(match.sources))
    got, covered = match.gather(grads)
    _, want = torch_grads(module, inputs, cot)
    lost = {n: int((~covered[n] & (want[n] != 0)).sum()) for n in want}
    assert not any(lost.values()), f"parameter elements with a gradient no initializer holds: {lost}"
    bad = grad_errors(got, want)
    assert not bad, f"{len(bad)} of {len(want)} parameter gradients differ from torch:\n" + "\n".join(bad)


@pytest.mark.parametrize(("name", "kind"), CASES)
def test_training_follows_torch(name, kind):
    """10 SGD steps on mean((logits - target)^2), every float initializer trained (the default)."""
    model, feeds = _model_and_feeds(name, kind)
    module, inputs = model_and_inputs(name)
    target = train_target(output_shape(name))
    want = torch_losses(module, inputs, target)[:STEPS]
    fb = onnxgrad.ForwardBackward(model)
    # every initializer trained by default is a parameter (no exporter constant: attention scale,
    # mask ones, RoPE inverse frequencies; GPT-2's transposed head is tied to the embedding)
    assert set(fb.parameters) <= set(match_initializers(model, module).sources)
    out_index = fb.output_names.index("logits")
    got = []
    for _ in range(STEPS):
        res = fb.forward(feeds)
        out = res.outputs[out_index]
        got.append(float(np.mean((out.astype(np.float64) - target) ** 2)))
        grads = res.backward({"logits": (2 * (out - target) / out.size).astype(np.float32)})
        params = fb.parameters  # live arrays, updated in place
        for k, g in grads.items():
            params[k] -= 0.05 * g
    bad = [f"step {i}: {g:.8g} vs torch {w:.8g}" for i, (g, w) in enumerate(zip(got, want))
           if not abs(g - w) <= TRAIN_RTOL * abs(w)]  # fmt: skip
    assert not bad, "\n".join(bad)
    assert got[-1] < got[0]
