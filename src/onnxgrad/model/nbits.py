"""The layout of ``com.microsoft.MatMulNBits``'s quantized weight, in numpy: the one place onnxgrad
packs and unpacks it (its gradient rule, :mod:`onnxgrad.lora` reading and merging 4-bit weights).

``Y = A W^T + bias`` with ``W`` ``[N, K]`` stored blockwise along K: ``B`` is uint8
``[N, n_blocks, block_size * bits / 8]``, ``bits`` values per byte, **low bits first**; ``scales``
``[N * n_blocks]``; ``zero_points`` either uint8 packed like ``B`` (each row of ``n_blocks`` values
padded to whole bytes) or of the scales' type ``[N * n_blocks]``; absent, the zero point is
``2^(bits - 1)``. ``W[n, k] = (q[n, k] - zero_point[n, k // block_size]) * scale[n, k // block_size]``
for ``k < K`` (the last block is padded).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from .graph import to_array

__all__ = ["NBitsLayout", "default_zero_point", "dequantize_nbits", "pack_bits", "unpack_bits"]


def default_zero_point(bits: int) -> int:
    """The zero point of a MatMulNBits without a ``zero_points`` input: ``2^(bits - 1)``."""
    return 2 ** (bits - 1)


def unpack_bits(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """``packed`` bytes ``[rows, ...]`` -> int64 values ``[rows, count]``: each row's bytes read as
    ``8 / bits`` values each, low bits first, cut to ``count`` values."""
    packed = np.asarray(packed).reshape(np.shape(packed)[0], -1).astype(np.int64)
    per_byte, mask = 8 // bits, (1 << bits) - 1
    values = np.stack([(packed >> (bits * j)) & mask for j in range(per_byte)], axis=-1)
    return values.reshape(packed.shape[0], -1)[:, :count]


def pack_bits(values: np.ndarray, bits: int) -> np.ndarray:
    """uint8 bytes of ``values`` (integers in ``[0, 2^bits)``) along the last axis: ``8 / bits``
    values a byte, low bits first, the last axis padded with zeros to whole bytes (the inverse of
    :func:`unpack_bits`)."""
    values = np.asarray(values).astype(np.uint8)
    per_byte = 8 // bits
    pad = -values.shape[-1] % per_byte
    if pad:
        values = np.concatenate([values, np.zeros((*values.shape[:-1], pad), np.uint8)], axis=-1)
    groups = values.reshape(*values.shape[:-1], -1, per_byte)
    out = np.zeros(groups.shape[:-1], np.uint8)
    for j in range(per_byte):
        out |= (groups[..., j] << (bits * j)).astype(np.uint8)
    return out


@dataclass(frozen=True)
class NBitsLayout:
    """The attributes of a MatMulNBits node that place its weight: ``W`` is ``[n, k]`` in
    ``blocks`` blocks of ``block_size`` along K, ``bits`` bits a value."""

    bits: int
    block_size: int
    n: int
    k: int

    @property
    def blocks(self) -> int:
        return -(-self.k // self.block_size)

    @classmethod
    def of(cls, node: onnx.NodeProto) -> NBitsLayout:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        return cls(
            int(attrs.get("bits", 4)),
            int(attrs.get("block_size", 0)),
            int(attrs.get("N", 0)),
            int(attrs.get("K", 0)),
        )

    def zero_points(self, zero_points: np.ndarray | None) -> np.ndarray:
        """The zero point of each block, float64 ``[n, blocks]``, from the ``zero_points`` input
        (uint8: packed; else of the scales' type; None: absent)."""
        if zero_points is None:
            return np.full((self.n, self.blocks), float(default_zero_point(self.bits)))
        if zero_points.dtype == np.uint8:
            return unpack_bits(zero_points.reshape(self.n, -1), self.bits, self.blocks).astype(np.float64)
        return zero_points.astype(np.float64).reshape(self.n, self.blocks)

    def dequantize(
        self, packed: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None = None
    ) -> np.ndarray:
        """The float64 weight ``W`` ``[n, k]`` of the MatMulNBits inputs ``B``, ``scales`` and
        ``zero_points``."""
        n, blocks, block = self.n, self.blocks, self.block_size
        q = unpack_bits(packed, self.bits, blocks * block).reshape(n, blocks, block).astype(np.float64)
        scale = scales.astype(np.float64).reshape(n, blocks, 1)
        zero = self.zero_points(zero_points).reshape(n, blocks, 1)
        return ((q - zero) * scale).reshape(n, blocks * block)[:, : self.k]


def dequantize_nbits(node: onnx.NodeProto, inits: Mapping[str, onnx.TensorProto]) -> np.ndarray:
    """The ``[N, K]`` float64 weight of a MatMulNBits node whose ``B``, ``scales`` and
    ``zero_points`` are the initializers ``inits`` names."""
    zp = node.input[3] if len(node.input) > 3 else ""
    return NBitsLayout.of(node).dequantize(
        to_array(inits[node.input[1]]), to_array(inits[node.input[2]]), to_array(inits[zp]) if zp else None
    )
