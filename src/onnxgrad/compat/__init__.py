"""``onnxcustom.training.ortgradient`` rebuilt on onnxgrad: the same classes, on stock onnxruntime.

onnxcustom's :class:`OrtGradientForwardBackward` relied on onnxruntime-training's private graph
builder, which no published onnxruntime ships any more. This package keeps its interface and runs it
on onnxgrad's engine (:func:`~onnxgrad.autodiff.engine.build_gradient`) and runtime
(:class:`~onnxgrad.runtime.runner.Runner`)::

    from onnxgrad.compat import OrtGradientForwardBackward

    fb = OrtGradientForwardBackward(onx, weights_to_train=["coef", "intercept"])
    fn = fb.new_instance()
    outputs = fn.forward([X, coef, intercept], training=True)  # features, then weights
    grads = fn.backward([grad_of_output])  # gradients of X, coef, intercept

Differences with the original:

* the weights may be listed in any order (the original required them sorted alphabetically and in
  initializer order); inputs and gradients follow the order given;
* ``providers`` accepts ``'cpu'``, ``'cuda'``, ``'cuda:N'``, ``'gpu'`` and a ``torch.device``; CUDA
  is checked for availability and anything else is a :class:`ValueError`;
* ``graph_builder_config`` (an onnxruntime-training object) and ``run_options`` are accepted and
  ignored; pickling keeps the usual ``SessionOptions`` settings but not its config entries;
* ``enable_logging`` logs on logger ``onnxgrad.compat`` (the original's was ``onnxcustom``);
* a bare onnxruntime ``OrtValueVector`` given as an output cache is overwritten in place only when
  the new values have the shapes of the old (the C++ vector cannot be emptied from Python); a list
  or an :class:`OrtValueVector` takes any values;
* errors are onnxgrad's: :class:`~onnxgrad.errors.InputError` (a ``ValueError``) for bad
  arguments, :class:`~onnxgrad.errors.OnnxGradRuntimeError` (a ``RuntimeError``) for the protocol.
"""

from .forward_backward import OrtGradientForwardBackward
from .function import OrtGradientForwardBackwardFunction
from .values import OrtValueVector

__all__ = ["OrtGradientForwardBackward", "OrtGradientForwardBackwardFunction", "OrtValueVector"]

# the public classes name the package (reprs, pickles), not the module that defines them
for _cls in (OrtGradientForwardBackward, OrtGradientForwardBackwardFunction, OrtValueVector):
    _cls.__module__ = __name__
del _cls
