"""Decoders exported the way optimum exports them for generation: with a KV cache.

optimum writes three files for a causal LM: ``decoder_model.onnx`` (no past: ``input_ids``,
``attention_mask`` -> ``logits``, ``present.{i}.key`` / ``present.{i}.value``),
``decoder_with_past_model.onnx`` (the same plus ``past_key_values.{i}.key`` / ``.value`` of shape
(batch, kv heads, past length, head size), past length dynamic) and ``decoder_model_merged.onnx``:
one If on a bool ``use_cache_branch`` input whose then-branch is the with-past graph and whose
else-branch is the no-past graph, the initializers of both moved to the main graph and shared
(``optimum.onnx.merge_decoders``), every branch output named like the If output. Here both are
exported by ``torch.onnx.export(dynamo=True)`` of a wrapper around the zoo's tiny GPT-2 / Llama that
builds a ``DynamicCache`` from the flat past tensors, and merged by :func:`merge_decoders`
(optimum itself is not needed: it only writes this structure).

Training runs on the no-cache path: the with-past model fed empty caches (past length 0), the merged
model fed ``use_cache_branch = False`` (and empty caches, which the else-branch ignores).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import warnings

import numpy as np
import onnx
import pytest
from onnx import helper

from tests.zoo._util import model_and_inputs

torch = pytest.importorskip("torch")

IR_VERSION = 10  # what the dynamo exporter writes; onnxruntime 1.32 loads <= 13


def _layout(name: str) -> tuple[int, int, int]:
    """(layers, KV heads, head size) of the zoo model ``name``."""
    cfg = model_and_inputs(name)[0].model.config
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    return cfg.num_hidden_layers, kv, cfg.hidden_size // heads


class _Decoder(torch.nn.Module):
    """``(input_ids, attention_mask, *past) -> (logits, *present)`` as optimum's export has it."""

    def __init__(self, lm: torch.nn.Module, layers: int) -> None:
        super().__init__()
        self.lm, self.layers = lm, layers

    def forward(self, input_ids, attention_mask, *past):
        from transformers import DynamicCache

        cache = DynamicCache()
        for i in range(self.layers if past else 0):
            cache.update(past[2 * i], past[2 * i + 1], i)
        out = self.lm(
            input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True
        )
        present = []
        for layer in out.past_key_values.layers:
            present += [layer.keys, layer.values]
        return (out.logits, *present)


def io_names(name: str, past: bool) -> tuple[list[str], list[str]]:
    layers = _layout(name)[0]
    kv = [f"{i}.{t}" for i in range(layers) for t in ("key", "value")]
    inputs = ["input_ids", "attention_mask"] + ([f"past_key_values.{n}" for n in kv] if past else [])
    return inputs, ["logits"] + [f"present.{n}" for n in kv]


def empty_past(name: str, batch: int, length: int = 0) -> list[np.ndarray]:
    """The past keys and values of ``length`` positions (zeros; length 0: an empty cache)."""
    layers, kv, head = _layout(name)
    return [np.zeros((batch, kv, length, head), np.float32) for _ in range(2 * layers)]


@functools.cache
def export_decoder(name: str, past: bool) -> bytes:
    """optimum's ``decoder_model`` (``past=False``) or ``decoder_with_past_model`` (``past=True``,
    exported with a 3-position cache, the past length dynamic), the zoo's perturbed weights."""
    module, inputs = model_and_inputs(name)
    lm = copy.deepcopy(module.model).eval()
    layers = _layout(name)[0]
    ids = inputs[0]
    batch, seq = ids.shape
    cache = [torch.from_numpy(a) + 0.1 for a in empty_past(name, batch, 3)] if past else []
    mask = torch.ones(batch, seq + (3 if past else 0), dtype=torch.int64)
    in_names, out_names = io_names(name, past)
    b, s = torch.export.Dim("batch_size"), torch.export.Dim("sequence_length")
    shapes: tuple = ({0: b, 1: s}, {0: b, 1: torch.export.Dim("total_sequence_length")})
    if past:
        shapes += (tuple({0: b, 2: torch.export.Dim("past_sequence_length")} for _ in cache),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            _Decoder(lm, layers), (ids, mask, *cache), dynamo=True, verbose=False,
            input_names=in_names, output_names=out_names, dynamic_shapes=shapes,
        )  # fmt: skip
    return program.model_proto.SerializeToString()


def decoder(name: str, past: bool) -> onnx.ModelProto:
    pytest.importorskip("transformers")
    pytest.importorskip("onnxscript")
    return onnx.load_from_string(export_decoder(name, past))


def _rename_inputs(graph: onnx.GraphProto, renames: dict[str, str]) -> None:
    """Rename the values ``graph`` (and its subgraphs) reads."""
    for node in graph.node:
        node.input[:] = [renames.get(i, i) for i in node.input]
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                _rename_inputs(attr.g, renames)
            for g in attr.graphs:
                _rename_inputs(g, renames)


def merge_decoders(no_past: onnx.ModelProto, with_past: onnx.ModelProto) -> onnx.ModelProto:
    """``decoder_model_merged``: an If on ``use_cache_branch`` (then: with past, else: no past), as
    ``optimum.onnx.merge_decoders`` builds it: initializers moved to the main graph, one copy of
    each value (a duplicate is renamed to the first name), outputs named like the If's."""
    shared: dict[str, str] = {}
    initializers: list[onnx.TensorProto] = []
    branches = []
    for model in (with_past, no_past):
        graph = copy.deepcopy(model.graph)
        renames = {}
        for init in graph.initializer:
            anonymous = copy.deepcopy(init)
            anonymous.name = ""
            key = hashlib.sha256(anonymous.SerializeToString(deterministic=True)).hexdigest()
            if key in shared:
                renames[init.name] = shared[key]
                continue
            name = init.name
            while name in {i.name for i in initializers}:
                name += "_merged"
            renames[init.name] = shared[key] = name
            moved = copy.deepcopy(init)
            moved.name = name
            initializers.append(moved)
        if model is no_past:  # the two exports number their values alike: one set renamed apart
            outs = {o.name for o in graph.output}
            for node in graph.node:
                for i, out in enumerate(node.output):
                    if out and out not in outs:
                        renames[out] = node.output[i] = f"no_past/{out}"
            for vi in graph.value_info:
                vi.name = renames.get(vi.name, vi.name)
        _rename_inputs(graph, renames)
        del graph.initializer[:]
        del graph.input[:]  # a branch reads the main graph's inputs from the outer scope
        graph.name = "with_past" if model is with_past else "no_past"
        branches.append(graph)
    inputs = [i for i in with_past.graph.input if i.name not in {t.name for t in with_past.graph.initializer}]
    inputs.append(helper.make_tensor_value_info("use_cache_branch", onnx.TensorProto.BOOL, [1]))
    outputs = list(with_past.graph.output)
    node = helper.make_node(
        "If", ["use_cache_branch"], [o.name for o in outputs], name="optimum::if",
        then_branch=branches[0], else_branch=branches[1],
    )  # fmt: skip
    graph = helper.make_graph([node], "merged_decoder", inputs, outputs, initializer=initializers)
    merged = helper.make_model(graph, opset_imports=with_past.opset_import, ir_version=IR_VERSION)
    merged.functions.extend(with_past.functions)
    names = {f.name for f in merged.functions}
    merged.functions.extend(f for f in no_past.functions if f.name not in names)
    return merged
