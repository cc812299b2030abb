"""What a Resize (or Upsample) node asks for: its interpolation mode, coordinate transformation,
nearest rounding and aspect policy, with the defaults of its opset. Shared by the taps computed
when building (:mod:`.resize`) and at run time (:mod:`.resize_run_time`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ....errors import GradientNotImplementedError
from ...registry import NodeContext
from ..common import node_label

F32 = np.float32


@dataclass(frozen=True)
class ResizeMode:
    """The attributes of a Resize (or Upsample) that shape its taps."""

    mode: str  # nearest, linear, cubic
    transform: str  # coordinate_transformation_mode
    nearest: str  # nearest_mode; "simple" before opset 11 (ceil when downsampling, else truncate)
    cubic_a: float
    exclude_outside: bool
    antialias: bool


# ---- Resize: reading the node -------------------------------------------------------------------
TRANSFORMS = {
    "half_pixel",
    "half_pixel_symmetric",
    "pytorch_half_pixel",
    "tf_half_pixel_for_nn",
    "align_corners",
    "asymmetric",
    "tf_crop_and_resize",
}
NEAREST = {"round_prefer_floor", "round_prefer_ceil", "floor", "ceil", "simple"}


def resize_mode_of(n: NodeContext) -> ResizeMode:
    """The attributes of a Resize or Upsample node, with the defaults of its opset."""
    resize = n.node.op_type == "Resize" and n.opset >= 11
    mode = n.attr("mode", "nearest")
    mode = {"bilinear": "linear", "trilinear": "linear", "bicubic": "cubic"}.get(mode, mode)
    found = ResizeMode(
        mode=mode,
        transform=n.attr("coordinate_transformation_mode", "half_pixel") if resize else "asymmetric",
        nearest=n.attr("nearest_mode", "round_prefer_floor") if resize else "simple",
        cubic_a=float(n.attr("cubic_coeff_a", -0.75)),
        exclude_outside=bool(n.attr("exclude_outside", 0)),
        antialias=bool(n.attr("antialias", 0)),
    )
    if (
        mode not in ("nearest", "linear", "cubic")
        or found.transform not in TRANSFORMS
        or found.nearest not in NEAREST
    ):
        raise GradientNotImplementedError(
            f"{node_label(n)}: unknown mode {mode!r}, coordinate_transformation_mode "
            f"{found.transform!r} or nearest_mode {found.nearest!r}"
        )
    return found


def aspect_policy(n: NodeContext) -> str:
    """The node's ``keep_aspect_ratio_policy``; refused with negative axes, which onnxruntime then
    ignores (the sizes would not be what the rule computes)."""
    policy = str(n.attr("keep_aspect_ratio_policy", "stretch"))
    if policy != "stretch" and any(a < 0 for a in n.attr("axes") or ()):
        raise GradientNotImplementedError(
            f"{node_label(n)}: onnxruntime ignores negative axes under keep_aspect_ratio_policy "
            f"{policy!r}; give them as non-negative axes"
        )
    return policy
