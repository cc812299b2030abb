"""What to train in a model: the one selection every front end makes.

Every front end (:func:`~onnxgrad.autodiff.engine.build_gradient`, ``ForwardBackward``,
``OnnxModule``, ``Trainer``, ``generate``, the scikit-learn estimators, the command line,
``onnxgrad info``) chooses what to train with :func:`select_parameters`, their ``trainable=`` and
``frozen=`` handed as they are (the freezing of tied copies, the refusal of running statistics and
the "nothing to train" errors are decided here, once), which asks two modules:

- :mod:`onnxgrad.autodiff.trainable`: which initializers train by default, each with the reason
  that decided (what the file declares first, then how the graph uses the value);
- :mod:`onnxgrad.autodiff.ties`: which initializers are several parameters stored once (aliases,
  split apart first) and which are one parameter stored several times (tied).

The names these modules define are importable from here too, as before the split.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import InputError
from ..model.graph import FLOAT_TYPES, node_operands, np_dtype, to_array
from .ties import (
    BROADCAST_MIN_DISTINCT,
    GATHER_MIN_REPEAT,
    TIE_MIN_SIZE,
    Tie,
    find_ties,
    merge_suspects,
    shared_constants,
    split_aliases,
    split_shared,
    tie_parameters,
    untie,
)
from .trainable import (
    CONSTANT_SLOTS,
    MASK_NEGATIVE,
    RULES,
    TRAINABLE_KEY,
    Decision,
    decisions,
    declared_trainable,
    default_trainable,
    padding_rows,
    parameter_reasons,
)

__all__ = [
    "BROADCAST_MIN_DISTINCT", "CONSTANT_SLOTS", "GATHER_MIN_REPEAT", "MASK_NEGATIVE", "RULES",
    "TIE_MIN_SIZE", "TRAINABLE_KEY", "Decision", "Selection", "Tie", "apply_parameters", "checked_names",
    "decisions", "declared_trainable", "default_trainable", "find_ties", "padding_rows",
    "parameter_reasons", "require_trainable", "running_statistics", "select_parameters",
    "shared_constants", "split_aliases", "split_shared", "tie_parameters", "untie", "values_reaching",
]  # fmt: skip


@dataclass
class Selection:
    """The result of :func:`select_parameters`.

    ``model``: the model, with aliases split and tied initializers computed from their parameter (a
    copy; the input model when there was nothing to split or tie). ``trainable``: the names to
    train. ``reasons``: for every initializer left out of the default set, why. ``ties``: the
    initializers now computed from a parameter. ``aliases``: initializers the file read under
    another's name through ``Identity`` (alias -> the initializer it read), now apart.
    ``decisions``: every initializer's default decision with its reason (``onnxgrad info``).
    ``unreached``: parameters left out because none of the outputs the loss uses depends on them
    (``outputs=`` of :func:`select_parameters`). ``shared``: parameters holding one value repeated
    that several nodes read, the file not saying whether they are one parameter or several an
    exporter merged (name -> the nodes; :func:`~onnxgrad.autodiff.ties.merge_suspects`).
    """

    model: onnx.ModelProto
    trainable: list[str]
    reasons: dict[str, str] = field(default_factory=dict)
    ties: list[Tie] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)
    decisions: dict[str, Decision] = field(default_factory=dict)
    unreached: list[str] = field(default_factory=list)
    shared: dict[str, list[str]] = field(default_factory=dict)

    @property
    def groups(self) -> dict[str, list[Tie]]:
        """Parameter -> the initializers computed from it."""
        out: dict[str, list[Tie]] = {}
        for t in self.ties:
            out.setdefault(t.source, []).append(t)
        return out


def checked_names(names: Iterable[str] | str, problem: Callable[[str], str | None]) -> list[str]:
    """``names`` in order, without repeats (one name may be given as a string), each checked:
    :class:`InputError` with the message ``problem(name)`` returns for the first name it faults."""
    selected = [names] if isinstance(names, str) else list(dict.fromkeys(names))
    for n in selected:
        message = problem(n)
        if message is not None:
            raise InputError(message)
    return selected


def select_parameters(
    model: onnx.ModelProto,
    trainable: Iterable[str] | str | None = None,
    *,
    frozen: Iterable[str] | str = (),
    tie_weights: bool = True,
    buffers: Iterable[str] = (),
    outputs: Iterable[str] | None = None,
) -> Selection:
    """What to train in ``model``: the default set (``trainable=None``) or the named initializers,
    checked, less the ``frozen`` ones; with ``tie_weights``, initializers that are one parameter
    become one (see the module's documentation). Every front end's ``trainable=`` / ``frozen=``
    comes here.

    ``frozen``: names left out: an initializer of the model or a name the selection made (an alias
    trained apart, a table rebuilt as ``<name>_core``); freezing any copy of a tied parameter
    freezes the parameter, and its copies stay constants. ``buffers``: running statistics, never
    trained (those a BatchNormalization in training mode reads are found in ``model`` too).
    ``outputs``: the outputs the loss uses (``None``: every output). A parameter of the default set
    that none of them depends on gets no gradient (torch's grad stays ``None`` and its optimizers
    skip it, weight decay and momentum included): it is left out, named in
    :attr:`Selection.unreached` and in a :class:`UserWarning`, and stays as it is in the model. One
    named in ``trainable`` is kept (the caller's choice), with a warning.

    Raises :class:`InputError` for a ``trainable`` name that is not a floating-point initializer
    or is a running statistic, for a ``frozen`` name that is none of the names above, and when
    ``frozen`` (or ``outputs``) leaves nothing to train.
    """
    stats = set(buffers) | set(running_statistics(model))
    if trainable is not None:
        trainable = [trainable] if isinstance(trainable, str) else list(trainable)
        fed = [n for n in trainable if n in stats]
        if fed:
            raise InputError(
                f"{fed} are running statistics (BatchNormalization updates them in training); they cannot be "
                "trained"
            )
    selection = _select(model, trainable, tie_weights)
    if trainable is None and selection.shared:
        _warn_shared(selection.shared)
    frozen = [frozen] if isinstance(frozen, str) else list(dict.fromkeys(frozen))
    if not frozen:
        return _reaching(selection, outputs, trainable is not None)
    groups: dict[str, set[str]] = {}  # any name of a tied parameter -> every name of it
    for source, ties in selection.groups.items():
        names = {source, *(t.name for t in ties)}
        for n in names:
            groups[n] = names
    known = {i.name for i in model.graph.initializer if i.data_type in FLOAT_TYPES}
    known |= set(selection.trainable) | set(groups)
    unknown = [n for n in frozen if n not in known]
    if unknown:
        raise InputError(
            f"frozen names {unknown} are not floating-point initializers of the model (trainable: "
            f"{selection.trainable})"
        )
    off = set().union(*(groups.get(n, {n}) for n in frozen))
    made = {t.source: t.name for t in selection.ties if t.made}  # a rebuilt table: named by its copy
    kept = [made.get(n, n) for n in selection.trainable if n not in off]
    if not kept:
        raise InputError("nothing to train: every parameter is frozen")
    selection = _select(model, kept, tie_weights)
    names = {i.name for i in selection.model.graph.initializer}
    for n in sorted(off & names):
        selection.reasons.setdefault(n, "frozen (frozen=)")
    return _reaching(selection, outputs, trainable is not None)


def _warn_shared(shared: dict[str, list[str]]) -> None:
    """The warning every front end gives for :attr:`Selection.shared` (the default choice)."""
    listed = "; ".join(f"{name!r} by {nodes}" for name, nodes in shared.items())
    warnings.warn(
        f"initializers holding one value repeated are each read by several nodes, and trained as one "
        f"parameter: {listed}. An exporter that merges equal initializers (torch.onnx.export(dynamo=True) "
        "of a freshly initialised model: zero biases, ones norm weights) stores several parameters so. "
        "If they are several, keep them apart: export after loading trained weights or with "
        "optimize=False, or give each node its own copy with onnxgrad.autodiff.params.split_shared(model) "
        "before training; if they are one parameter (a layer applied several times), this is right",
        UserWarning,
        stacklevel=3,
    )


def values_reaching(graph: onnx.GraphProto, outputs: Iterable[str]) -> set[str]:
    """The values of ``graph`` that ``outputs`` depend on (the outputs included): the operands of
    every node computing one, transitively, the values a node's subgraphs read included."""
    producer = {o: n for n in graph.node for o in n.output if o}
    needed = set(outputs)
    stack = list(needed)
    while stack:
        node = producer.get(stack.pop())
        if node is None:
            continue
        for i in node_operands(node):
            if i and i not in needed:
                needed.add(i)
                stack.append(i)
    return needed


def _reaching(selection: Selection, outputs: Iterable[str] | None, named: bool) -> Selection:
    """``selection`` less the parameters of the default choice that none of ``outputs`` depends on,
    with a warning naming them; parameters ``named`` by the caller are kept, with a warning
    (``outputs=None``, or a name that is no output, which the caller reports: as is)."""
    if outputs is None:
        return selection
    outputs = list(dict.fromkeys(outputs))
    graph = selection.model.graph
    if not outputs or not set(outputs) <= {o.name for o in graph.output}:
        return selection
    reached = values_reaching(graph, outputs)
    unreached = [n for n in selection.trainable if n not in reached]
    if not unreached:
        return selection
    if named:
        warnings.warn(
            f"{unreached} (named in trainable=) reach none of the outputs {outputs}: their gradient is "
            "zero, and weight decay or momentum still move them (torch's optimizers would skip them); "
            "leave them out of trainable= to keep them as they are",
            UserWarning,
            stacklevel=3,
        )
        return selection
    kept = [n for n in selection.trainable if n in reached]
    if not kept:
        raise InputError(
            f"nothing to train: no parameter reaches the outputs {outputs} (the loss does not depend on "
            f"{unreached})"
        )
    warnings.warn(
        f"{unreached} reach none of the outputs {outputs}: they get no gradient and are left out of "
        "training (torch's optimizers skip a parameter whose grad is None, weight decay and momentum "
        "included); they keep their values",
        UserWarning,
        stacklevel=3,
    )
    reasons = dict(selection.reasons)
    for n in unreached:
        reasons[n] = f"reaches none of the outputs {outputs}"
    return Selection(
        selection.model,
        kept,
        reasons,
        selection.ties,
        selection.aliases,
        selection.decisions,
        unreached,
        selection.shared,
    )


def require_trainable(names: Iterable[str]) -> list[str]:
    """``names`` (the parameters chosen), checked to hold one: a training step (``generate``, the
    ``Trainer``, the scikit-learn estimators) raises :class:`InputError` when there is nothing to
    train."""
    names = list(names)
    if not names:
        raise InputError("nothing to train: the model has no trainable initializer")
    return names


def running_statistics(model: onnx.ModelProto) -> list[str]:
    """The running statistics of the BatchNormalization nodes in training mode (their mean and
    variance inputs, which the node updates and no gradient reaches), in node order."""
    found: list[str] = []
    for node in model.graph.node:
        if node.op_type != "BatchNormalization" or node.domain not in ("", "ai.onnx"):
            continue
        training = next((a.i for a in node.attribute if a.name == "training_mode"), 0)
        if training:
            found += [n for n in node.input[3:5] if n and n not in found]
    return found


def _select(model: onnx.ModelProto, trainable: list[str] | None, tie_weights: bool) -> Selection:
    """The selection of the names ``trainable`` (``None``: the default set), tied or not."""
    model, aliases = split_aliases(model)  # several parameters stored once: apart first
    inits = {i.name: i for i in model.graph.initializer}
    # named initializers, untied: the reasons are not needed (a front end building a variant)
    judged = decisions(model) if trainable is None or tie_weights else {}
    for alias, source in aliases.items():  # what info shows: the file read it under another name
        if alias in judged and judged[alias].trainable:
            judged[alias] = Decision(True, f"{judged[alias].reason}; Identity alias of {source}, apart")
    reasons = {n: None if d.trainable else d.reason for n, d in judged.items()}
    if trainable is None:
        names = [n for n, r in reasons.items() if r is None]
        explicit: list[str] = []
    else:

        def problem(n: str) -> str | None:
            if n not in inits:
                return f"trainable name {n!r} is not an initializer of the model"
            if inits[n].data_type not in FLOAT_TYPES:
                return (
                    f"initializer {n!r} has type {helper.tensor_dtype_to_string(inits[n].data_type)}: "
                    "only floating-point initializers can be trained"
                )
            return None

        names = explicit = checked_names(trainable, problem)
    left_out = {n: r for n, r in reasons.items() if r is not None and n not in names}
    ties: list[Tie] = []
    if tie_weights:
        chosen = set(names)
        separate = set(declared_trainable(model) or ())
        candidates = [n for n in inits if (reasons.get(n) is None or n in chosen) and n not in separate]
        found = find_ties(model, candidates, prefer=explicit)
        by_source: dict[str, list[Tie]] = {}
        for t in found:
            by_source.setdefault(t.source, []).append(t)
        for source, group in by_source.items():
            if source in chosen or any(t.name in chosen for t in group):
                ties.extend(group)
    shared = merge_suspects(model, names)
    if not ties:
        return Selection(model, names, left_out, [], aliases, judged, shared=shared)
    tied = {t.name: t.source for t in ties}
    selected: list[str] = []
    for n in names:
        n = tied.get(n, n)
        if n not in selected:
            selected.append(n)
    for t in ties:
        left_out.pop(t.name, None)
    return Selection(tie_parameters(model, ties), selected, left_out, ties, aliases, judged, shared=shared)


def apply_parameters(
    model: onnx.ModelProto, params: Mapping[str, np.ndarray], *, tie_weights: bool = True
) -> onnx.ModelProto:
    """A copy of ``model`` holding the trained values ``params`` (name -> array, dtypes kept), as
    every front end chose and tied its parameters (the default :func:`select_parameters`).

    A tied parameter's copies are computed from its new value (GPT-2's folded transposed head
    follows its embedding; a gathered copy follows its rebuilt table ``<name>_core``, a broadcast
    copy its core); an alias trained apart (an ``Identity`` of a value the exporter stored once,
    TorchScript BERT's biases) becomes an initializer of its own. A copy named without its
    parameter, or with a value that is not computed from the parameter's, would be left stale:
    :class:`InputError` naming the copies and their parameter. ``tie_weights=False``: every name is
    an initializer written as given (a model trained with ``tie_weights=False``).

    :class:`InputError` also for a name that is no initializer (nor a rebuilt core, nor an alias)
    and for a value of another shape.
    """
    base, _ = split_aliases(model)  # aliases apart: a value written under one name changes no other
    ties = _select(model, None, True).ties if tie_weights else []  # found on ``base``
    inits = {i.name: i for i in base.graph.initializer}
    made = {t.source: t for t in ties if t.made}
    copies = {t.name: t for t in ties if not t.made}
    unknown = [n for n in params if n not in inits and n not in made]
    if unknown:
        raise InputError(f"{unknown} are not initializers of the model (nor tables or cores it trains)")

    def value_of(name: str, like: str) -> np.ndarray:
        init = inits[like]
        value = np.asarray(params[name], dtype=np_dtype(init.data_type))
        shape = tuple(made[name].core(to_array(init)).shape) if name in made else tuple(init.dims)
        if tuple(value.shape) != shape:
            raise InputError(f"{name!r} has shape {shape}, got {value.shape}")
        return value

    new: dict[str, np.ndarray] = {}
    for name in params:
        if name in made:  # a rebuilt table or core: the copy it computes is what the file holds
            new[made[name].name] = made[name].compute(value_of(name, made[name].name))
    for t in made.values():  # the copy named with its core: one of them would be lost
        if t.name in params and t.source in params:
            copies[t.name] = t
    for name in params:
        if name not in made and name not in copies:
            new[name] = value_of(name, name)
    for t in ties:  # every copy follows its parameter
        if not t.made and t.source in new:
            new[t.name] = t.compute(new[t.source])
    stale = []
    for name in params:
        if name in copies:
            t = copies[name]
            given = value_of(name, name)
            if t.source not in params or not _same_bits(given, new[name]):
                stale.append(f"{name!r} (computed from {t.source!r}: {t.how})")
    if stale:
        raise InputError(
            f"{', '.join(stale)} would be left stale: these are copies of one tied parameter; pass the "
            "parameter's value only (the copies follow it), or tie_weights=False to write each as given"
        )
    out = _copy(base)
    for init in out.graph.initializer:
        if init.name in new:
            init.CopyFrom(
                numpy_helper.from_array(np.asarray(new[init.name], order="C"), init.name)
            )  # 0-d kept
    return out


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    bits = np.dtype(f"u{a.dtype.itemsize}")
    return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a.view(bits), b.view(bits)))
