"""The PyTorch bridge: ONNX graphs as ``torch.nn.Module``s, and custom autograd Functions exported
as PythonOp nodes (requires torch)."""

from ..deps import require_torch

require_torch()  # an unsupported torch fails here, with the installed and the supported versions

from ..pythonop.registry import register_function  # noqa: E402
from .export import export  # noqa: E402
from .module import OnnxModule  # noqa: E402

__all__ = ["OnnxModule", "export", "register_function"]
