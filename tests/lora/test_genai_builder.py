"""LLMs as onnxruntime-genai's model builder writes them train as written.

The fixtures (``tools/make_genai_fixture.py``) are a tiny random Llama (``tests/data/genai_llama_hf``:
hidden 64, 2 layers, 4 query heads, 2 key/value heads, vocabulary 128) and what
``python -m onnxruntime_genai.models.builder -p fp32|int4 -e cpu`` (0.15.2) writes for it: a KV
cache, ``SkipSimplifiedLayerNormalization``, ``GroupQueryAttention`` reading the packed QKV
projection with ``do_rotary=1`` and the rotary tables ``cos_cache`` / ``sin_cache`` as
initializers, and in the int4 file ``MatMulNBits`` with ``accuracy_level=4``.

Checked here: onnxgrad's unfused form of the attention computes the builder's outputs bit for bit;
the weight gradients of the fp32 file (a padded batch; a non-empty past, whose own gradients are
checked too) are those of torch float64 autograd on the same HF model; the rotary tables are
never in the default trainable set; QLoRA on the int4 file lowers the loss in 20 SGD steps.
"""

from __future__ import annotations

import functools
import itertools
from pathlib import Path

import numpy as np
import onnx
import pytest

import onnxgrad
from onnxgrad import lora
from onnxgrad.autodiff.rewrite import rewrite_for_training
from onnxgrad.autodiff.trainable import parameter_reasons
from onnxgrad.testing import assert_allclose_scaled, run_gradients

ort = pytest.importorskip("onnxruntime")

DATA = Path(__file__).resolve().parents[1] / "data"
FP32, INT4, HF = (
    DATA / "genai_llama_fp32" / "model.onnx",
    DATA / "genai_llama_int4" / "model.onnx",
    DATA / "genai_llama_hf",
)
LAYERS, KV_HEADS, HEAD, VOCAB = 2, 2, 16, 128
CACHES = ("cos_cache", "sin_cache")


def _session(model: onnx.ModelProto | Path) -> ort.InferenceSession:
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(data, providers=["CPUExecutionProvider"])


def _past(batch: int, length: int = 0) -> dict[str, np.ndarray]:
    return {
        f"past_key_values.{i}.{t}": np.zeros((batch, KV_HEADS, length, HEAD), np.float32)
        for i in range(LAYERS)
        for t in ("key", "value")
    }


@functools.cache
def _case(name: str) -> dict[str, np.ndarray]:
    """The feeds of a scenario: ``padded`` (2 sequences of 6 and 4 tokens, right-padded, no past),
    ``past`` (3 new tokens after 4 in the cache, from the model's own first run), ``decode`` (1 new
    token for 2 sequences after a cache of 4), ``padded_decode`` (the same, the second sequence's
    prompt 2 tokens long: its cache rows 2 and 3 are padding, its new key goes to row 2)."""
    r = np.random.default_rng({"padded": 0, "past": 1, "decode": 2, "padded_decode": 3}[name])
    if name == "padded":
        ids = r.integers(0, VOCAB, (2, 6))
        mask = np.ones((2, 6), np.int64)
        mask[1, 4:] = 0
        return {"input_ids": ids, "attention_mask": mask, **_past(2)}
    batch, before, new = (1, 4, 3) if name == "past" else (2, 4, 1)
    first_mask = np.ones((batch, before), np.int64)
    if name == "padded_decode":
        first_mask[1, 2:] = 0
    first = {"input_ids": r.integers(0, VOCAB, (batch, before)), "attention_mask": first_mask}
    session = _session(FP32)
    presents = session.run(None, {**first, **_past(batch)})[1:]
    names = [o.name for o in session.get_outputs()][1:]
    past = {n.replace("present", "past_key_values"): v for n, v in zip(names, presents)}
    ids = r.integers(0, VOCAB, (batch, new))
    mask = np.concatenate([first_mask, np.ones((batch, new), np.int64)], axis=1)
    return {"input_ids": ids, "attention_mask": mask, **past}


def _positions(feeds: dict[str, np.ndarray]) -> np.ndarray:
    """The positions of the new tokens: each sequence's own count of earlier tokens onwards (as
    onnxruntime numbers them, where torch would count the padding of the cache too)."""
    new = feeds["input_ids"].shape[1]
    if feeds["past_key_values.0.key"].shape[2] == 0:
        return np.broadcast_to(np.arange(new), feeds["input_ids"].shape)
    return feeds["attention_mask"].sum(axis=1, keepdims=True) - new + np.arange(new)


CASES = ["padded", "past", "decode", "padded_decode"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("path", [FP32, INT4], ids=["fp32", "int4"])
def test_unfused_attention_computes_the_builders_outputs_bit_for_bit(path: Path, case: str) -> None:
    model = onnx.load(path)
    unfused = rewrite_for_training(onnx.load(path))
    ops = [n.op_type for n in unfused.graph.node]
    assert ops.count("RotaryEmbedding") == 2 * LAYERS and ops.count("GroupQueryAttention") == LAYERS
    assert all(not any(a.name == "do_rotary" and a.i for a in n.attribute) for n in unfused.graph.node)
    feeds = _case(case)
    want = _session(model).run(None, feeds)
    got = _session(unfused).run(None, feeds)
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g, w)


# ---- against torch ----------------------------------------------------------------------------------
def _torch_grads(case: str, cotangent: np.ndarray) -> dict[str, np.ndarray]:
    """d sum(logits * cotangent) / d (each weight of the fp32 file, each past input), by torch
    float64 autograd on the HF model, keyed by the fp32 file's names and laid out as it stores them
    (the builder packs q, k, v into one qkv_proj and stores every linear weight transposed)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM.from_pretrained(
        HF, dtype=torch.float64, attn_implementation="eager"
    ).eval()
    feeds = _case(case)
    kwargs: dict = {
        "input_ids": torch.tensor(feeds["input_ids"]),
        "attention_mask": torch.tensor(feeds["attention_mask"]),
        "position_ids": torch.tensor(_positions(feeds)),
    }
    past: dict[str, torch.Tensor] = {}
    if feeds["past_key_values.0.key"].shape[2]:
        cache = transformers.DynamicCache()
        for i in range(LAYERS):
            for t in ("key", "value"):
                name = f"past_key_values.{i}.{t}"
                past[name] = torch.tensor(feeds[name], dtype=torch.float64, requires_grad=True)
            cache.update(past[f"past_key_values.{i}.key"], past[f"past_key_values.{i}.value"], i)
        kwargs["past_key_values"] = cache
    (hf(**kwargs).logits * torch.tensor(cotangent, dtype=torch.float64)).sum().backward()
    p = {n: q.grad for n, q in hf.named_parameters()}
    out = {
        "model.embed_tokens.weight": p["model.embed_tokens.weight"],
        "lm_head.MatMul.weight": p["lm_head.weight"].T,
    }
    out[f"model.layers.{LAYERS}.final_norm_layernorm.weight"] = p["model.norm.weight"]
    for i in range(LAYERS):
        layer = f"model.layers.{i}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{layer}.{norm}.weight"] = p[f"{layer}.{norm}.weight"]
        qkv = [p[f"{layer}.self_attn.{x}_proj.weight"] for x in "qkv"]
        out[f"{layer}.attn.qkv_proj.MatMul.weight"] = torch.cat(qkv, 0).T
        out[f"{layer}.attn.o_proj.MatMul.weight"] = p[f"{layer}.self_attn.o_proj.weight"].T
        for proj in ("gate", "up", "down"):
            out[f"{layer}.mlp.{proj}_proj.MatMul.weight"] = p[f"{layer}.mlp.{proj}_proj.weight"].T
    out.update({n: v.grad for n, v in past.items()})
    return {n: v.numpy() for n, v in out.items()}


@pytest.mark.parametrize("case", CASES)
def test_weight_gradients_of_the_fp32_file_are_torchs(case: str) -> None:
    """The fp32 file's gradients (every weight; with a past, the past keys and values too) against
    torch float64 autograd of the HF model, for sum(logits * C) with C zero at padded positions.

    The bound: float32 rounding through the two layers' products and reductions (about 20 in a
    row, each within a few eps = 1.2e-7 of the tensor's scale) adds up to a few 1e-6 of scale
    (measured: 1.9e-6 at most, padded_decode); a wrong term (a rotation not undone, a key's
    gradient at the wrong position, a missed head group) moves a gradient by 1e-2 of scale or more
    (the padded_decode case before its fix: 0.58). 1e-5 of scale lies between."""
    feeds = _case(case)
    r = np.random.default_rng(10)
    cotangent = (
        r.standard_normal((*feeds["input_ids"].shape, VOCAB))
        * feeds["attention_mask"][:, -feeds["input_ids"].shape[1] :, None]
    )
    past = (
        [n for n in feeds if n.startswith("past_key_values")]
        if feeds["past_key_values.0.key"].shape[2]
        else []
    )
    graphs = onnxgrad.build_gradient(onnx.load(FP32), inputs_requiring_grad=past)
    assert not set(CACHES) & set(graphs.trainable)
    _, grads = run_gradients(graphs, feeds, {"logits": cotangent.astype(np.float32)})
    want = _torch_grads(case, cotangent)
    assert set(grads) == set(want)
    for name, value in grads.items():
        assert_allclose_scaled(value, want[name], rtol=1e-5, err_msg=name)


# ---- what trains ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", [FP32, INT4], ids=["fp32", "int4"])
def test_rotary_tables_are_never_trained_by_default(path: Path) -> None:
    model = onnx.load(path)
    reasons = parameter_reasons(model)
    assert {n: reasons[n] for n in CACHES} == {n: "rotary cache" for n in CACHES}
    assert reasons["model.embed_tokens.weight"] is None  # a weight
    trainable = onnxgrad.build_gradient(model).trainable
    assert not set(CACHES) & set(trainable)
    assert "model.layers.0.input_layernorm.weight" in trainable
    if path == INT4:  # the QLoRA model trains its adapters only
        adapted = lora.add_adapters(model, "*", rank=4)
        assert set(onnxgrad.build_gradient(adapted).trainable) == set(lora.adapter_names(adapted))


def _cross_entropy_step(fb: onnxgrad.ForwardBackward, feeds: dict, targets: np.ndarray, lr: float) -> float:
    """One SGD step on ``fb``'s parameters for the mean cross-entropy of ``targets``; its loss."""
    res = fb.forward(feeds)
    logits = res.outputs[0].astype(np.float64).reshape(-1, VOCAB)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    rows = np.arange(len(targets))
    loss = float(-np.log(p[rows, targets]).mean())
    p[rows, targets] -= 1
    grads = res.backward({"logits": (p / len(targets)).reshape(res.outputs[0].shape).astype(np.float32)})
    fb.set_parameters({n: fb.parameters[n] - lr * g for n, g in grads.items()})
    return loss


def test_qlora_on_the_int4_file_trains() -> None:
    """Adapters on every MatMulNBits of the int4 file, as written (accuracy_level=4: onnxruntime
    quantizes the activations to int8; add_adapters warns that the gradients are the float
    product's): 20 SGD steps on a next-token batch bring the loss down."""
    with pytest.warns(onnxgrad.errors.GradientWarning, match="accuracy_level=4"):
        adapted = lora.add_adapters(onnx.load(INT4), "*", rank=4, alpha=8)
    assert len(lora.adapter_names(adapted)) == 2 * (5 * LAYERS + 1)  # qkv, o, gate, up, down; the head
    shapes = {t.name: tuple(t.dims) for t in adapted.graph.initializer}
    r = np.random.default_rng(5)
    start = {n: (r.standard_normal(shapes[n]) * 0.05).astype(np.float32) for n in lora.adapter_names(adapted)}
    fb = onnxgrad.ForwardBackward(lora.with_values(adapted, start), session_options=lora.session_options())
    ids = r.integers(0, VOCAB, (2, 9))
    feeds = {"input_ids": ids[:, :-1], "attention_mask": np.ones((2, 8), np.int64), **_past(2)}
    losses = [_cross_entropy_step(fb, feeds, ids[:, 1:].reshape(-1), 0.1) for _ in range(20)]
    print(f"QLoRA on the builder's int4 file: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert losses[-1] < 0.5 * losses[0]
    assert all(b < a for a, b in itertools.pairwise(losses[:10]))


def _accuracy_level(model: onnx.ModelProto, level: int) -> onnx.ModelProto:
    """``model`` with every MatMulNBits at ``accuracy_level`` (as docs/finetune_deployed.md shows)."""
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            for a in node.attribute:
                if a.name == "accuracy_level":
                    a.i = level
    return model


def test_qlora_on_the_int4_file_at_accuracy_level_1_is_the_float_model_of_its_weights() -> None:
    """With accuracy_level=1 (float activations), the int4 file with adapters computes the fp32 file
    holding its dequantized weights (whose gradients are torch's, above), with the same adapters:
    logits and adapter gradients to float32 reordering (1e-5 of scale; measured: equal). At the
    builder's accuracy_level=4 they are 1.7e-2 (logits) and 3.4e-2 (adapter gradients) off."""
    q = _accuracy_level(onnx.load(INT4), 1)
    deq = {
        t.name[: -len("_Q4")]: lora.dequantized_weight(q, t.name).T
        for t in q.graph.initializer
        if t.name.endswith("_Q4")
    }
    ref = lora.with_values(onnx.load(FP32), deq)
    feeds = _case("padded")
    r = np.random.default_rng(7)
    cotangent = (r.standard_normal((2, 6, VOCAB)) * feeds["attention_mask"][..., None]).astype(np.float32)
    results = []
    for model in (q, ref):
        adapted = lora.add_adapters(model, "*", rank=4, alpha=8)
        shapes = {t.name: tuple(t.dims) for t in adapted.graph.initializer}
        start = {
            n: (np.random.default_rng(3).standard_normal(shapes[n]) * 0.05).astype(np.float32)
            for n in lora.adapter_names(adapted)
        }
        fb = onnxgrad.ForwardBackward(
            lora.with_values(adapted, start), session_options=lora.session_options()
        )
        res = fb.forward(feeds)
        results.append((res.outputs[0], res.backward({"logits": cotangent})))
    (logits, grads), (want_logits, want_grads) = results
    assert_allclose_scaled(logits, want_logits, rtol=1e-5, err_msg="logits")
    assert set(grads) == set(want_grads)  # the adapters are named after the float weights
    for name, value in grads.items():
        assert_allclose_scaled(value, want_grads[name], rtol=1e-5, err_msg=name)
