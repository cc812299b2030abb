"""The PyTorch bridge: ONNX graphs as ``torch.nn.Module``s, and custom autograd Functions exported
as PythonOp nodes (requires torch)."""

from ..pythonop.registry import register_function
from .export import export
from .module import OnnxModule

__all__ = ["OnnxModule", "export", "register_function"]
