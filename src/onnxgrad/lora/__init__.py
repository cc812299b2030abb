"""LoRA: trainable low-rank adapters beside the weights of a frozen ONNX model.

:func:`add_adapters` rewrites every MatMul/Gemm that reads a chosen weight ``W`` so that it computes
``y = x W + (alpha / rank) * dropout(x) A B``, with ``A`` random (kaiming-uniform, as PEFT) and ``B``
zeros: the adapted model starts equal to the base. The adapted model names its default trainable set
in ``metadata_props`` (``onnxgrad.trainable``: exactly the adapters), so ``build_gradient``,
``ForwardBackward``, ``OnnxModule``, ``Trainer`` and ``onnxgrad.artifacts.generate`` train only them
by default. :func:`merge` folds the adapters into the weights (a plain model again);
:func:`save_adapters` / :func:`load_adapters` keep the adapters apart from the base (safetensors
layout, or ``.npz``).

Where the weight sits, as exporters write it:

* ``MatMul(x, W)`` (``W``: ``[in, out]``): ``A`` is ``[in, r]``, ``B`` is ``[r, out]``;
* ``MatMul(W, x)`` (``W``: ``[out, in]``): ``y = W x + s * B (A x)``, ``A`` ``[r, in]``, ``B`` ``[out, r]``;
* ``Gemm(x, W)`` with ``transB`` (``W``: ``[out, in]``, torch's Linear) or without (``[in, out]``),
  ``transA``, ``alpha`` honoured; the bias stays as it is.

Quantized weights (QLoRA: the adapters are float, the quantized product stays as it is, frozen):

* ``DequantizeLinear(q, scale, zero_point)`` feeding MatMul/Gemm as above (``quantize_static`` QDQ,
  ``MatMulNBitsQuantizer(quant_format=QDQ)``): int8/uint8/int4/uint4..., per tensor, per axis or
  blocked; ``q`` is the weight (targets match its name, or the name without ``_quantized`` /
  ``_DQ_Q4`` ...);
* ``com.microsoft.MatMulNBits(x, q, scales, ...)`` (``q`` packed, ``W`` ``[N, K]``): as ``Gemm``
  with ``transB``; the adapter adds to its output, bias included;
* ``MatMulInteger`` of ``quantize_dynamic``: ``DynamicQuantizeLinear(x) -> MatMulInteger(x_q, q)
  -> Cast -> Mul(x_scale * w_scale)``: the adapter reads the float ``x`` and adds to the Mul's output.

The adapters' gradient is the one of the graph onnxruntime runs when its
``DequantizeLinear -> MatMul`` to ``MatMulNBits`` fusion is off: with it on, onnxruntime computes the
forward with ``x`` quantized to int8 per block (``session.qdq_matmulnbits_accuracy_level``, 4 by
default) while the backward differentiates the float product. Every session onnxgrad makes for
such a model (``ForwardBackward``, ``OnnxModule``, ``Trainer``, ``artifacts.Runner``) runs under
options that keep what runs equal to what is differentiated, unless given others
(:mod:`onnxgrad.runtime.options`); :func:`session_options` gives them for the serving session.
:func:`merge` on a quantized base writes float weights (see there).

The package's modules: :mod:`.adapters` (:func:`add_adapters`, :func:`adapter_names`,
:func:`with_values`), :mod:`.quantized` (recognising quantized weights, :func:`dequantized_weight`,
:func:`session_options`), :mod:`.merge`, :mod:`.files` (:func:`save_adapters`,
:func:`read_adapters`, :func:`load_adapters`: safetensors or ``.npz``) and :mod:`.serving`
(onnxruntime's adapter format).

onnxruntime serves adapters itself: :func:`serving_model` gives the adapted model whose adapters are
inputs with initializer defaults (zeros: no adapter active is the base model), :func:`save_ort_adapter`
writes a ``.onnx_adapter`` file (``onnxruntime.AdapterFormat``) that ``onnxruntime.LoraAdapter`` and
``RunOptions.add_active_adapter`` switch per request over one ``InferenceSession``.
"""

from __future__ import annotations

from .adapters import LORA_KEY, Targets, adapter_names, add_adapters, with_values
from .files import load_adapters, read_adapters, save_adapters
from .merging import merge
from .quantized import dequantized_weight, session_options
from .serving import read_ort_adapter, save_ort_adapter, serving_model

__all__ = [
    "LORA_KEY",
    "Targets",
    "adapter_names",
    "add_adapters",
    "dequantized_weight",
    "load_adapters",
    "merge",
    "read_adapters",
    "read_ort_adapter",
    "save_adapters",
    "save_ort_adapter",
    "serving_model",
    "session_options",
    "with_values",
]
