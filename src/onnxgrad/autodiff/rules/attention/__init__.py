"""The attention family, one module per idea: the ONNX Attention op (:mod:`.standard`, which reads
the forward's probabilities), onnxruntime's fused attention ops (:mod:`.fused`: Attention,
MultiHeadAttention, GroupQueryAttention, which recompute them), both RotaryEmbedding ops
(:mod:`.rotary`) and LinearAttention (:mod:`.linear`). Importing the package registers their rules.
"""

from . import fused, linear, rotary, standard  # noqa: F401
from .rotary import rotary_cache_grads, rotated_pairs

__all__ = ["rotary_cache_grads", "rotated_pairs"]
