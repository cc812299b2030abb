"""Running forward and backward graphs on onnxruntime."""

from .session import ForwardBackward, ForwardResult, gradients, inference_model, resolve_providers

__all__ = ["ForwardBackward", "ForwardResult", "gradients", "inference_model", "resolve_providers"]
