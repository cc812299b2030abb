"""The one place where onnxgrad meets the APIs of onnxruntime and torch that moved between releases.

Each capability is probed once, by trying it on a tiny value (not by reading version strings), and
the form that works is bound to a module-level function at import (onnxruntime) or on first use
(torch, which ``import onnxgrad`` must not load). Everything else in onnxgrad calls these functions
and never the moved API itself:

==========================  ==============================================================
what                        forms seen
==========================  ==============================================================
OrtValue from DLPack        ``from_dlpack(capsule, is_bool)`` (onnxruntime <= 1.31; bool
                            travels as uint8 plus the flag); ``from_dlpack(capsule)``
                            (1.32; bool travels as DLPack bool)
OrtValue to a torch tensor  ``OrtValue.to_dlpack()`` then torch's capsule reader; bool
                            comes back as uint8 from onnxruntimes that export it so
running on OrtValues        ``InferenceSession._sess.run_with_ort_values`` (C-level values,
                            one call); the public wrapper as the fallback
results to torch            ``OrtValueVector.dlpack_at(i)`` (no OrtValue object made), else
                            each ``OrtValue.to_dlpack()``
many tensors at once        torch's capsules straight to ``from_dlpack(capsule)`` where it
                            refuses strided ones (probed), else one tensor at a time
OrtValue from numpy         ``OrtValue.ortvalue_from_numpy(array, OrtDevice)``; bfloat16, which
                            the numpy bridge lacks both ways, as uint16 bits
CPU device                  ``OrtDevice(type, memory type, id)`` or with a vendor id
torch DLPack                ``torch._C._from_dlpack`` (no protocol checks) or
                            ``torch.from_dlpack``; ``torch.utils.dlpack.to_dlpack``
``Function.apply``          a Python classmethod in front of ``_C._FunctionBase.apply``
                            (torch <= 2.13: functorch's checks), or that C method itself
                            (2.14)
==========================  ==============================================================

A release outside the supported range, or one missing a capability, raises
:class:`~onnxgrad.errors.DependencyError` naming the installed version and the supported range, at
the first use that needs it (:func:`require_onnxruntime`, :func:`require_torch`).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np
import onnxruntime as ort
from onnxruntime.capi import _pybind_state as C

from .errors import DependencyError

__all__ = [
    "CPU",
    "SUPPORTED",
    "C",
    "DependencyError",
    "function_apply_direct",
    "ortvalue_from_capsule",
    "ortvalue_from_numpy",
    "ortvalue_to_numpy",
    "require_onnxruntime",
    "require_torch",
    "run_with_ort_values",
    "session_run",
    "torch_interop",
]

#: The lower bounds that CI's oldest leg tests; pyproject.toml declares the same (a test checks).
SUPPORTED: dict[str, str] = {"onnxruntime": "1.31", "onnx": "1.23", "numpy": "1.24", "torch": "2.13"}


def version_tuple(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: ``'2.13.0+cpu'`` -> ``(2, 13, 0)``."""
    return tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0].split("rc")[0])[:3])


def _check_range(package: str, installed: str) -> None:
    minimum = SUPPORTED[package]
    if version_tuple(installed) < version_tuple(minimum):
        raise DependencyError(
            f"onnxgrad needs {package}>={minimum}; {package} {installed} is installed "
            f"(supported: {package}>={minimum})"
        )


def _missing(package: str, installed: str, what: str, why: BaseException | None = None) -> DependencyError:
    detail = f" ({type(why).__name__}: {why})" if why is not None else ""
    return DependencyError(
        f"{package} {installed} does not offer {what}, which onnxgrad needs{detail}; "
        f"supported: {package}>={SUPPORTED[package]}"
    )


# ---- onnx ----------------------------------------------------------------------------------------
_REGISTERED: list[Any] = []


def register_onnx_schema(schema: Any) -> None:
    """Register an ``onnx.defs.OpSchema`` for this process.

    A schema whose shape inference is a Python function is deregistered at exit, while the
    interpreter still runs: onnx 1.19 otherwise destroys that function in its static registry
    after Python has finalized, and the process hangs on exit waiting for the GIL.
    """
    import onnx

    onnx.defs.register_schema(schema)
    if not _REGISTERED:
        atexit.register(_deregister_onnx_schemas)
    _REGISTERED.append((schema.name, schema.since_version, schema.domain))


def _deregister_onnx_schemas() -> None:
    import onnx

    while _REGISTERED:
        name, version, domain = _REGISTERED.pop()
        with contextlib.suppress(Exception):  # already gone: nothing to release
            onnx.defs.deregister_schema(name, version, domain)


# ---- onnxruntime ---------------------------------------------------------------------------------
ORT_VERSION: str = getattr(ort, "__version__", "0")


def _cpu_device() -> Any:
    """The CPU ``OrtDevice`` of the C layer, in whichever constructor form this release has."""
    cpu, memory = C.OrtDevice.cpu(), C.OrtDevice.default_memory()
    for args in ((cpu, memory, 0), (cpu, memory, 0, 0)):  # (type, mem, id) / (type, mem, vendor, id)
        try:
            return C.OrtDevice(*args)
        except TypeError:
            continue
    return None


CPU: Any = _cpu_device()


_BFLOAT16 = ml_dtypes.bfloat16  # the numpy type onnx gives bfloat16 tensors
_ONNX_BFLOAT16 = 16  # TensorProto.BFLOAT16


def ortvalue_from_numpy(arr: np.ndarray) -> Any:
    """A C-level OrtValue sharing ``arr``'s buffer (``arr`` must be C-contiguous and kept alive).

    onnxruntime's numpy bridge knows no bfloat16: such an array (``ml_dtypes.bfloat16``) goes as
    its bits (uint16) with the ONNX element type."""
    if arr.dtype.type is _BFLOAT16:
        return C.OrtValue.ortvalue_from_numpy_with_onnx_type(arr.view(np.uint16), _ONNX_BFLOAT16)
    return C.OrtValue.ortvalue_from_numpy(arr, CPU)


def ortvalue_to_numpy(value: Any) -> np.ndarray:
    """The array of a C-level OrtValue on the CPU: ``value.numpy()``, or for bfloat16, which
    onnxruntime has no numpy type for, a copy of its bits as an ``ml_dtypes.bfloat16`` array."""
    try:
        return value.numpy()
    except RuntimeError:
        if value.data_type() != "tensor(bfloat16)" or value.device_name().lower() != "cpu":
            raise
    shape = tuple(value.shape())
    n = math.prod(shape)
    bits = np.frombuffer((ctypes.c_uint16 * n).from_address(value.data_ptr()), np.uint16) if n else ()
    return np.array(bits, dtype=np.uint16).reshape(shape).view(_BFLOAT16)


FromCapsule = Callable[[Any, bool], Any]  # (capsule, is_bool) -> OrtValue
_Converter = Callable[[Any], Any]  # one object (capsule, tensor) to another


def probe_from_dlpack(
    from_dlpack: Callable[..., Any] | None,
) -> tuple[str, FromCapsule | None]:
    """Which form of ``OrtValue.from_dlpack`` ``from_dlpack`` is, tried on a numpy int64 scalar.

    Returns the form's name (``"capsule+flag"``, ``"capsule"`` or ``"none"``) and an adapter
    ``(capsule, is_bool) -> OrtValue`` for it.
    """
    if from_dlpack is None:
        return "none", None
    probe = np.zeros((), np.int64)
    try:
        from_dlpack(probe.__dlpack__(), False)
        return "capsule+flag", from_dlpack
    except TypeError:
        pass
    try:
        from_dlpack(probe.__dlpack__())
    except TypeError:
        return "none", None
    return "capsule", lambda capsule, is_bool: from_dlpack(capsule)


DLPACK_FORM, _from_dlpack_adapter = probe_from_dlpack(getattr(C.OrtValue, "from_dlpack", None))


def ortvalue_from_capsule(capsule: Any, is_bool: bool = False) -> Any:
    """A C-level OrtValue from a DLPack capsule (``is_bool``: the capsule holds uint8 standing for
    bool, as torch tensors are handed over to onnxruntimes whose DLPack has no bool)."""
    if _from_dlpack_adapter is None:
        raise _missing("onnxruntime", ORT_VERSION, "OrtValue.from_dlpack")
    return _from_dlpack_adapter(capsule, is_bool)


_RUN_ON_VALUES = hasattr(C.InferenceSession, "run_with_ort_values")


def _native(feeds: Mapping[str, Any], outputs: Sequence[str]) -> bool:
    return (
        type(feeds) is dict
        and isinstance(outputs, (list, tuple))
        and all(type(v) is C.OrtValue for v in feeds.values())
    )


def _unwrap(value: Any) -> Any:
    return getattr(value, "_ortvalue", value)


def run_with_ort_values(
    sess: ort.InferenceSession,
    feeds: Mapping[str, Any],
    outputs: Sequence[str],
    run_options: ort.RunOptions | None = None,
) -> list[Any]:
    """Run ``sess`` on OrtValues (C-level or wrappers); returns C-level OrtValues, one per output."""
    if not _RUN_ON_VALUES:
        raise _missing("onnxruntime", ORT_VERSION, "InferenceSession.run_with_ort_values")
    try:  # the common case, a dict of C-level values and a list of names, goes through as it is
        result = sess._sess.run_with_ort_values(feeds, outputs, run_options)
    except (TypeError, RuntimeError):  # what pybind11 raises when it cannot convert an argument
        if _native(feeds, outputs):  # the arguments were fine: the run itself failed
            raise
        c_feeds = {k: _unwrap(v) for k, v in feeds.items()}  # wrappers, another mapping type
        outputs = list(outputs)  # an iterator of names
        result = sess._sess.run_with_ort_values(c_feeds, outputs, run_options)
    # indexing, not list(result): the vector type has no __iter__, and Python's fallback (calling
    # __getitem__ up to an IndexError raised through pybind11) costs ~30 µs
    return [result[i] for i in range(len(outputs))]


def session_run(sess: ort.InferenceSession) -> Callable[[dict[str, Any], list[str], Any], Any]:
    """The C-level run of ``sess``, for hot loops that checked their arguments once:
    ``run(feeds, names, None)`` takes a dict of C-level OrtValues and a list of output names and
    returns onnxruntime's vector of results (read it with :meth:`TorchInterop.tensors_at`).

    It skips :func:`run_with_ort_values`'s conversions and its copy of the results to a list
    (about 2 µs a run)."""
    if not _RUN_ON_VALUES:
        raise _missing("onnxruntime", ORT_VERSION, "InferenceSession.run_with_ort_values")
    return sess._sess.run_with_ort_values


def require_onnxruntime() -> None:
    """Raise :class:`DependencyError` if the installed onnxruntime cannot run onnxgrad's graphs."""
    _check_range("onnxruntime", ORT_VERSION)
    if CPU is None:
        raise _missing("onnxruntime", ORT_VERSION, "an OrtDevice constructor onnxgrad knows")
    if not _RUN_ON_VALUES:
        raise _missing("onnxruntime", ORT_VERSION, "InferenceSession.run_with_ort_values")


# ---- torch (imported on first use only) ----------------------------------------------------------
class TorchInterop:
    """torch <-> OrtValue without copies, in the forms the installed torch and onnxruntime speak.

    Built once by :func:`torch_interop`; its two methods are bound to plain functions so that each
    call costs a fraction of a microsecond.
    """

    def __init__(
        self,
        torch: Any,
        from_capsule: FromCapsule,
        dlpack_form: str,
        direct: Callable[[Any], Any] | None = None,
    ) -> None:
        """``direct``: onnxruntime's ``OrtValue.from_dlpack`` where it takes a capsule alone (the
        new form), called without the adapter by :meth:`to_ortvalues`."""
        from torch.utils.dlpack import to_dlpack

        self.torch = torch
        self.version: str = torch.__version__
        self._to_dlpack = to_dlpack
        # the capsule reader torch.from_dlpack ends in, without its protocol checks (0.1 µs a call)
        self._from_dlpack = getattr(torch._C, "_from_dlpack", None) or torch.from_dlpack
        self._from_capsule = from_capsule
        self._bool, self._uint8 = torch.bool, torch.uint8
        self.dlpack_form = dlpack_form
        # whether bool crosses as DLPack bool (new form) or as uint8 with a flag (old form)
        self.bool_as_uint8 = dlpack_form == "capsule+flag"
        self._direct = direct
        # read results in place (no OrtValue object per result) where onnxruntime's vector can
        self._at = hasattr(C.OrtValueVector, "dlpack_at") and hasattr(C.OrtValueVector, "element_type_at")

    def to_ortvalue(self, t: Any) -> Any:
        """An OrtValue sharing a CPU tensor's buffer (a contiguous copy for a strided view).

        The value goes through a DLPack capsule whose deleter holds the tensor: the OrtValue keeps
        the buffer alive by itself. ``t`` may require grad (the value only reads the buffer).
        """
        if not t.is_contiguous():  # onnxruntime only takes dense row-major buffers
            t = t.detach().contiguous()
        if t.dtype is self._bool:
            if self.bool_as_uint8:
                return self._from_capsule(self._to_dlpack(t.detach().view(self._uint8)), True)
            return self._from_capsule(self._to_dlpack(t.detach()), False)
        try:
            capsule = self._to_dlpack(t)
        except RuntimeError:  # a torch that refuses to export tensors requiring grad
            capsule = self._to_dlpack(t.detach())
        return self._from_capsule(capsule, False)

    def to_ortvalues(self, tensors: Sequence[Any]) -> list[Any]:
        """:meth:`to_ortvalue` of each tensor, in one call (a third cheaper for contiguous tensors).

        With ``direct``, the capsules go to onnxruntime as they are: it refuses a strided one
        (probed by :func:`torch_interop`), and bool travels as DLPack bool; on a refusal every
        tensor takes :meth:`to_ortvalue`.
        """
        direct = self._direct
        if direct is not None:
            to_dlpack = self._to_dlpack
            try:
                return [direct(to_dlpack(t)) for t in tensors]
            except Exception:  # a strided view, or a torch that refuses tensors requiring grad:
                pass  # to_ortvalue copies or detaches, and raises what it cannot handle
        return [self.to_ortvalue(t) for t in tensors]

    def tensors_at(self, vector: Any, indices: Sequence[int]) -> list[Any]:
        """Tensors sharing the buffers of ``vector[i]`` for ``i`` in ``indices``, where ``vector``
        is the result of a :func:`session_run` (0.6 µs a result less than :meth:`to_tensor`)."""
        at = getattr(vector, "dlpack_at", None) if self._at else None
        if at is None:  # an onnxruntime whose runs give another sequence type
            return [self.to_tensor(vector[i]) for i in indices]
        from_dlpack = self._from_dlpack
        out = [from_dlpack(at(i)) for i in indices]
        if self.bool_as_uint8:  # an older DLPack hands bool over as uint8
            for k, t in enumerate(out):
                if t.dtype is self._uint8 and vector.element_type_at(indices[k]) == _ONNX_BOOL:
                    out[k] = t.view(self._bool)
        return out

    def fast_forms(self) -> tuple[Callable[[Any], Any], _Converter | None, _Converter | None]:
        """The plain functions behind :meth:`to_ortvalues` and :meth:`tensors_at`, for a hot loop
        that writes their common case inline (a Python call and a few lookups fewer each way):
        ``(to_capsule, to_ortvalue, to_tensor)``.

        ``to_ortvalue(to_capsule(t))`` is what :meth:`to_ortvalues` does first; it raises on a
        tensor it cannot take as it is (a strided view), where the caller hands the tensors to
        :meth:`to_ortvalues`. ``to_tensor(vector.dlpack_at(i))`` is :meth:`tensors_at` for a
        vector of results. ``to_ortvalue`` is ``None`` where every tensor must go through
        :meth:`to_ortvalues`, and ``to_tensor`` where every result must go through
        :meth:`tensors_at` (older forms of the exchange).
        """
        in_place = self._at and not self.bool_as_uint8
        return self._to_dlpack, self._direct, self._from_dlpack if in_place else None

    def to_tensor(self, value: Any) -> Any:
        """A tensor sharing a C-level OrtValue's buffer (the tensor keeps the value alive)."""
        t = self._from_dlpack(value.to_dlpack())
        # onnxruntimes with an older DLPack carry bool as uint8; only then is the type worth asking
        if t.dtype is self._uint8 and value.data_type() == "tensor(bool)":
            t = t.view(self._bool)
        return t


_INTEROP: TorchInterop | None = None
_ONNX_BOOL = 9  # onnx.TensorProto.BOOL, as OrtValueVector.element_type_at gives it


def require_torch() -> Any:
    """Import torch, check its release, and return the module (raises :class:`DependencyError`)."""
    try:
        import torch
    except ImportError as exc:
        raise DependencyError(
            f"this part of onnxgrad needs torch>={SUPPORTED['torch']}, which is not installed "
            f"(pip install 'onnxgrad[torch]')"
        ) from exc
    _check_range("torch", torch.__version__)
    return torch


def torch_interop() -> TorchInterop:
    """The :class:`TorchInterop` for the installed torch and onnxruntime (built on first call)."""
    global _INTEROP
    if _INTEROP is None:
        torch = require_torch()
        require_onnxruntime()
        if _from_dlpack_adapter is None:
            raise _missing("onnxruntime", ORT_VERSION, "OrtValue.from_dlpack")
        interop = TorchInterop(torch, _from_dlpack_adapter, DLPACK_FORM, direct_from_dlpack(torch))
        _probe_torch(interop)
        _INTEROP = interop
    return _INTEROP


def direct_from_dlpack(
    torch: Any, from_dlpack: Callable[..., Any] | None = None, form: str | None = None
) -> Callable[[Any], Any] | None:
    """``from_dlpack`` (by default onnxruntime's ``OrtValue.from_dlpack``, of the form ``form``,
    by default the installed one) where torch's capsules can go to it as they are: it takes a
    capsule alone (the new form) and refuses a strided one (a transposed matrix), which it would
    otherwise read as dense. ``None`` elsewhere: :meth:`TorchInterop.to_ortvalues` then converts
    each tensor with :meth:`TorchInterop.to_ortvalue`."""
    if (DLPACK_FORM if form is None else form) != "capsule":
        return None
    if from_dlpack is None:
        from_dlpack = C.OrtValue.from_dlpack
    try:
        from_dlpack(torch.utils.dlpack.to_dlpack(torch.zeros(2, 3).t()))
    except Exception:  # refused (onnxruntime 1.32: a RuntimeError naming IsContiguousTensor)
        return from_dlpack
    return None


def _probe_torch(interop: TorchInterop) -> None:
    """Round-trip a float and a bool tensor; a release whose DLPack disagrees fails here, clearly."""
    torch = interop.torch
    for sample in (torch.arange(3, dtype=torch.float32), torch.tensor([True, False]), torch.ones(2, 3).t()):
        try:
            back = interop.to_tensor(interop.to_ortvalue(sample))
            ok = back.dtype == sample.dtype and bool((back == sample).all())
            vector = C.OrtValueVector()  # the batched forms, as OnnxModule's calls use them
            vector.push_back(interop.to_ortvalues([sample])[0])
            back = interop.tensors_at(vector, [0])[0]
            ok = ok and back.dtype == sample.dtype and bool((back == sample).all())
        except Exception as exc:  # any failure of the installed pair is a capability we lack
            what = f"a DLPack exchange with torch {interop.version}"
            raise _missing("onnxruntime", ORT_VERSION, what, exc) from exc
        if not ok:
            what = f"a DLPack exchange of {sample.dtype} with torch {interop.version}"
            raise _missing("onnxruntime", ORT_VERSION, what)


def function_apply_direct(cls: type) -> tuple[Callable[..., Any], Callable[[], bool]]:
    """``cls.apply`` for a ``torch.autograd.Function`` subclass without the Python layer that
    torch <= 2.13 puts in front of the C method (1.4 µs a call), and the test of when that layer is
    needed: ``(apply, transforms_active)``. Call ``cls.apply`` itself while ``transforms_active()``
    (a functorch transform, vmap or grad, is running: the layer then routes the call, or refuses a
    class without ``setup_context``); outside one the layer only unwraps tensors left over from
    a finished transform.

    Where ``Function.apply`` is the C method itself (torch 2.14), or the C method is not found,
    ``apply`` is ``cls.apply``. Either way a ``Function.apply`` patched later
    (:func:`function_apply_wrapped`) is not seen by ``apply``: it is bound now.
    """
    torch = require_torch()
    base = getattr(torch._C, "_FunctionBase", None)
    descriptor = getattr(base, "__dict__", {}).get("apply")
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    own = torch.autograd.Function.__dict__.get("apply")
    if descriptor is None or active is None or not isinstance(own, classmethod):
        return cls.apply, lambda: False  # type: ignore[attr-defined]
    return descriptor.__get__(None, cls), active


@contextlib.contextmanager
def function_apply_observed(observe: Callable[[type, Any], None]) -> Any:
    """Within the block, ``observe(cls, outputs)`` runs after every ``torch.autograd.Function.apply``.

    ``observe`` may raise to stop the call. See :func:`function_apply_wrapped`.
    """

    def wrap(cls: type, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        out = call(*args, **kwargs)
        observe(cls, out)
        return out

    with function_apply_wrapped(wrap):
        yield


@contextlib.contextmanager
def function_apply_wrapped(wrap: Callable[..., Any]) -> Any:
    """Within the block, ``Function.apply(*args)`` of every class ``cls`` is ``wrap(cls, call, *args)``,
    where ``call(*args)`` is the original ``apply`` bound to ``cls``.

    torch <= 2.13 defines ``Function.apply`` as a Python classmethod, torch 2.14 as a C
    ``classmethod_descriptor``; both are bound with ``__get__(None, cls)``, so one wrapper serves
    either. The original is put back on exit.
    """
    torch = require_torch()
    function = torch.autograd.Function
    original = function.__dict__.get("apply")
    if original is None or not hasattr(original, "__get__"):
        raise _missing("torch", torch.__version__, "torch.autograd.Function.apply as a class method")

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        return wrap(cls, original.__get__(None, cls), *args, **kwargs)

    function.apply = classmethod(apply)
    try:
        yield
    finally:
        function.apply = original
