"""The PyTorch bridge: ONNX graphs as ``torch.nn.Module``s (requires torch)."""

from .module import OnnxModule

__all__ = ["OnnxModule"]
