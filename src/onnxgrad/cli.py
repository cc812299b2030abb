"""The ``onnxgrad`` command line (also ``python -m onnxgrad``).

Subcommands: ``grad`` (write the forward and backward graphs of a model), ``check`` (gradients of
each node and of the whole model against finite differences), ``coverage`` (the ops with gradient
rules), ``info`` (what a model contains and which of its ops lack a rule), ``train`` (fine-tune a
model on a CSV or NPZ file), ``bench`` (time a model's training step and where the time goes) and
``demo`` (train an MLP on the digits data set), ``artifacts`` (one-graph training steps for any
onnxruntime). Errors that onnxgrad raises are printed as one line on stderr with exit code 2; a
failed gradient check exits with 1.

One vocabulary across commands, the same words as the Python API's: ``-o/--out-dir DIR`` for a
folder written (``out_dir=`` in Python), ``-o/--out-file FILE`` for a file written, ``--trainable``
for the initializers trained, ``--loss-output`` for the model output a loss reads,
``--batch-size``, ``--seed``, ``--shape NAME=DIMS``, ``--no-progress``. Older spellings
(``--output-dir``, ``--output-file``, ``train --out``/``--output``, ``demo --output``, ``bench
--batch``, ``artifacts --requires-grad``) still work, hidden from the help, with a deprecation note
on stderr (``add_deprecated``, in :mod:`onnxgrad.artifacts.cli`, the lowest command-line module,
which the ``artifacts`` options use too).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper

from ._version import __version__
from .artifacts.cli import (
    add_deprecated,
    add_optimizer_arguments,
    add_parameter_arguments,
    optimizer_options_from_args,
)
from .artifacts.cli import add_parser as add_artifacts_parser
from .autodiff import build_gradient, rules_table, supported_ops
from .autodiff.params import padding_rows, select_parameters
from .autodiff.registry import lookup
from .errors import InputError, OnnxGradError
from .model.graph import dtype_name, opset_of, value_info_from_proto
from .model.load import CheckedModel, load_checked, load_model
from .runtime.values import check_input


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # e.g. `onnxgrad coverage | head`: the reader left, nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (OnnxGradError, OSError) as exc:
        # One line, no traceback: these are the user's errors, not ours.
        message = " ".join(str(exc).split())
        print(f"onnxgrad: error: {message}", file=sys.stderr)
        return 2


def _model_command(sub: Any, name: str, help: str, **kwargs: Any) -> argparse.ArgumentParser:
    """The parser of a subcommand that reads one model: its ``MODEL`` argument added."""
    p = sub.add_parser(name, help=help, **kwargs)
    p.add_argument("model", metavar="MODEL", help="path of the ONNX model")
    return p


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="onnxgrad", description="Backward graphs for ONNX models, run on stock onnxruntime."
    )
    parser.add_argument("--version", action="version", version=f"onnxgrad {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = _model_command(sub, "grad", "write the forward and backward graphs of a model")
    p.add_argument(
        "-o",
        "--out-dir",
        metavar="DIR",
        help="folder for forward.onnx and backward.onnx (required)",
    )
    add_deprecated(p, "--output-dir", "--out-dir", "out_dir")
    add_parameter_arguments(p, "differentiate")
    p.add_argument(
        "--no-tie-weights",
        action="store_true",
        help="train initializers that hold one parameter (tied weights) apart",
    )
    p.add_argument(
        "--inputs-requiring-grad",
        nargs="+",
        default=[],
        metavar="NAME",
        help="graph inputs whose gradients the backward also returns",
    )
    p.add_argument(
        "--outputs",
        nargs="+",
        metavar="NAME",
        help="outputs that take a gradient (default: every floating-point one)",
    )
    p.set_defaults(func=_grad)

    p = _model_command(
        sub,
        "check",
        help="check the gradients of each node and of the whole model against finite differences",
        description="Feed random inputs, then compare onnxgrad's gradients with central finite "
        "differences, node by node (each node as a one-node model, in float64 when it can) and for "
        "the whole model. Exit code 1 when a check fails.",
    )
    p.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="NAME=DIMS",
        help="shape of an input, e.g. x=2,3,8 (default: the model's, symbolic dimensions set to 2)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs and probes")
    p.add_argument(
        "--max-elements", type=int, default=24, metavar="K", help="elements probed per value (default 24)"
    )
    p.add_argument("--no-nodes", action="store_true", help="check the whole model only")
    p.add_argument("--rtol", type=float, default=None, help="relative tolerance (default: per dtype)")
    p.add_argument("--atol", type=float, default=None, help="absolute tolerance (default: per dtype)")
    p.set_defaults(func=_check)

    p = sub.add_parser("coverage", help="the ops with gradient rules")
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")
    p.set_defaults(func=_coverage)

    p = _model_command(sub, "info", "inputs, outputs, parameters and ops of a model")
    p.set_defaults(func=_info)

    _add_train_parser(sub)

    p = _model_command(
        sub,
        "bench",
        help="time the training step of a model and show where the time goes",
        description="Time forward + backward (output gradient of ones, gradients of every trainable "
        "floating-point initializer) on random inputs: medians over --steps steps after a warm-up, "
        "then the time per op type of the forward and backward graphs and the slowest backward nodes, "
        "from onnxruntime's profiler.",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=1,
        metavar="N",
        help="value of every symbolic dimension, the batch included (default 1)",
    )
    add_deprecated(p, "--batch", "--batch-size", "batch_size", type=int)
    p.add_argument("--steps", type=int, default=20, metavar="K", help="timed steps (default 20)")
    p.add_argument(
        "--threads", type=int, default=None, metavar="T", help="intra-op threads (default: onnxruntime's)"
    )
    p.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="NAME=DIMS",
        help="shape of an input, e.g. x=2,3,8 (overrides --batch-size for that input)",
    )
    p.add_argument("--json", metavar="PATH", help="also write every figure to this JSON file")
    p.set_defaults(func=_bench)

    p = sub.add_parser("demo", help="train an MLP on scikit-learn's digits with onnxruntime")
    p.add_argument("--epochs", type=int, default=15, help="number of epochs (default 15)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, the split and the shuffling")
    p.add_argument(
        "-o",
        "--out-file",
        default=None,
        metavar="FILE",
        help="where to write the trained model (default: out/digits_mlp.onnx)",
    )
    add_deprecated(p, "--output-file", "--out-file", "out_file")
    add_deprecated(p, "--output", "--out-file", "out_file")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=_demo)

    add_artifacts_parser(sub)
    return parser


# ---- subcommands -------------------------------------------------------------------------------
def _grad(args: argparse.Namespace) -> int:
    if args.out_dir is None:  # not required=True: the deprecated --output-dir fills it too
        raise InputError("-o/--out-dir DIR is required: the folder for forward.onnx and backward.onnx")
    graphs = build_gradient(
        args.model,
        trainable=args.trainable,
        frozen=args.frozen,
        inputs_requiring_grad=args.inputs_requiring_grad,
        outputs=args.outputs,
        tie_weights=not args.no_tie_weights,
    )
    fwd_path, bwd_path = graphs.save(args.out_dir)
    print(f"forward   {fwd_path} ({len(graphs.forward.graph.node)} nodes)")
    print(f"backward  {bwd_path} ({len(graphs.backward.graph.node)} nodes)")
    for title, names in (
        ("trainable", graphs.trainable),
        ("inputs requiring grad", graphs.inputs_requiring_grad),
        ("outputs taking a gradient", list(graphs.grad_inputs)),
        ("saved for the backward", graphs.saved),
    ):
        print(f"{title} ({len(names)}): {', '.join(names) if names else '-'}")
    return 0


def _coverage(args: argparse.Namespace) -> int:
    """One row per op: the opset versions with a rule, how, the module that registers it, and the test
    files that exercise it."""
    tested = _tested_ops()
    versions: dict[tuple[str, str], list] = {}
    for r in rules_table():
        versions.setdefault((r.domain or "ai.onnx", r.op_type), []).append(r)
    header = ("op", "domain", "opsets", "status", "rule file", "tested in")
    rows = []
    for (domain, op), rs in versions.items():
        where = ", ".join(sorted(tested.get(op, ()))) if tested else "?"
        status = rs[-1].kind + (f" ({rs[-1].note})" if rs[-1].note and args.markdown else "")
        rows.append((op, domain, ", ".join(f"{r.since}+" for r in rs), status, rs[-1].file, where or "-"))
    print(_markdown(header, rows) if args.markdown else _table(header, rows))
    kinds = Counter(supported_ops().values())
    counts = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
    untested = sum(1 for row in rows if row[-1] == "-")
    note = f"; {untested} without a test" if tested else ""
    print(f"\n{sum(kinds.values())} ops ({counts}); {len(rows)} with versions listed{note}")
    return 0


def _tested_ops() -> dict[str, set[str]]:
    """Op name -> test files of the source checkout that name it (empty when not in a checkout)."""
    tests = Path(__file__).resolve().parents[2] / "tests"
    found: dict[str, set[str]] = {}
    if not tests.is_dir():
        return found
    ops = {r.op_type for r in rules_table()}
    for path in sorted(tests.rglob("test_*.py")):
        text = path.read_text(errors="replace")
        for op in ops:
            if f'"{op}"' in text or f"'{op}'" in text:
                found.setdefault(op, set()).add(path.name)
    return found


def _info(args: argparse.Namespace) -> int:
    model = load_model(args.model)
    g = model.graph
    opsets = ", ".join(f"{o.domain or 'ai.onnx'} {o.version}" for o in model.opset_import)
    print(f"model {args.model}: IR {model.ir_version}, opsets {opsets}, {len(g.node)} nodes")
    inits = {i.name: i for i in g.initializer}
    for title, values in (
        ("inputs", [i for i in g.input if i.name not in inits]),
        ("outputs", list(g.output)),
    ):
        print(f"\n{title}:")
        print(_table(("name", "type", "shape"), [_describe(v) for v in values], indent=2))

    selection = select_parameters(model)
    inits = {i.name: i for i in selection.model.graph.initializer}  # aliases apart, rebuilt tables
    params = [inits[n] for n in selection.trainable]
    total = sum(_numel(t.dims) for t in params)
    print(f"\ntrainable parameters: {len(params)} tensors, {total:,} values")
    why = {n: d.reason for n, d in selection.decisions.items()}
    made = {t.source: f"rebuilt from {t.name}" for t in selection.ties if t.made}
    rows = [
        (
            t.name,
            _dtype(t.data_type),
            _shape(tuple(t.dims)),
            f"{_numel(t.dims):,}",
            why.get(t.name) or made.get(t.name, ""),
        )
        for t in params
    ]
    if rows:
        print(_table(("name", "type", "shape", "size", "why"), rows, indent=2))
    if selection.aliases:
        print(
            "\naliases (one constant initializer read under several names through Identity; trained apart):"
        )
        rows = [(alias, source) for alias, source in selection.aliases.items()]
        print(_table(("parameter", "read from"), rows, indent=2))
    groups = selection.groups
    if groups:
        print("\ntied weights (one parameter stored several times, trained as one unless tie_weights=False):")
        rows = [(source, t.name, t.how) for source, ties in groups.items() for t in ties]
        print(_table(("parameter", "also stored as", "how"), rows, indent=2))
    rows = [
        (node.input[0], str(row), node.name or node.output[0])
        for node in selection.model.graph.node
        for out, row in padding_rows(selection.model, selection.trainable).items()
        if node.output and node.output[0] == out and node.op_type == "Gather"
    ]
    if rows:
        print("\nembedding padding rows (no gradient, as torch's padding_idx):")
        print(_table(("table", "row", "node"), rows, indent=2))
    left = [(n, r) for n, r in selection.reasons.items()]
    if left:
        print(f"\nleft out of the default trainable set: {len(left)} initializers")
        rows = [(n, _dtype(inits[n].data_type), _shape(tuple(inits[n].dims)), reason) for n, reason in left]
        print(_table(("name", "type", "shape", "why"), rows, indent=2))

    ops = Counter((n.domain if n.domain != "ai.onnx" else "", n.op_type) for n in g.node)
    print("\nops:")
    rows = [(_op_name(d, op), str(k)) for (d, op), k in sorted(ops.items(), key=lambda x: -x[1])]
    print(_table(("op", "count"), rows, indent=2))
    supported_ops()  # loads the rules that lookup consults
    missing = sorted(_op_name(d, op) for d, op in ops if lookup(d, op, opset_of(model, d) or 1) is None)
    print(f"\nops without a gradient rule: {', '.join(missing) if missing else 'none'}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from . import demo

    kwargs = {"path": args.out_file} if args.out_file else {}
    try:
        demo.main(epochs=args.epochs, seed=args.seed, progress=not args.no_progress, **kwargs)
    except ModuleNotFoundError as exc:  # an optional dependency, not a bug
        print(
            f"onnxgrad: error: the demo needs scikit-learn and tqdm "
            f"(pip install 'onnxgrad[sklearn,train]'): {exc}",
            file=sys.stderr,
        )
        return 2
    return 0


# ---- train -------------------------------------------------------------------------------------
SCHEDULES = ("constant", "cosine", "step", "invscaling", "plateau")
# what a resumed run must share with its checkpoint: another split would move samples between the
# training and the validation sets
SPLIT_KEYS = ("data", "val_split", "seed")


def _add_train_parser(sub: Any) -> None:
    from .train import LOSSES, OPTIMIZERS
    from .train.optimizers import DEFAULT_LR, DEFAULT_OPTIMIZER

    p = _model_command(
        sub,
        "train",
        help="fine-tune a model on a .csv or .npz file and save the trained model",
        description="Append a loss to MODEL, train it with onnxruntime on the data file and save the "
        "trained model (without the loss). CSV: a header row; the --target column is the target, the "
        "other columns (or --features) feed the model's single input. NPZ: one array per model input, "
        "named after it, plus the --target array.",
    )
    p.add_argument("--data", required=True, metavar="FILE", help="training data, .csv or .npz")
    p.add_argument("--target", required=True, metavar="NAME", help="target column (CSV) or array (NPZ)")
    p.add_argument(
        "--features", metavar="A,B,...", help="CSV feature columns, in order (default: all others)"
    )
    p.add_argument("--loss", default="mse", choices=LOSSES, help="loss appended to the model (default mse)")
    p.add_argument(
        "--loss-output", metavar="NAME", help="model output the loss reads (default: the first output)"
    )
    add_deprecated(p, "--output", "--loss-output", "loss_output")
    add_parameter_arguments(p)
    p.add_argument("--epochs", type=int, default=10, help="most epochs to run (default 10)")
    p.add_argument("--lr", type=float, default=DEFAULT_LR, help=f"learning rate (default {DEFAULT_LR:g})")
    p.add_argument("--batch-size", type=int, default=32, metavar="B", help="mini-batch size (default 32)")
    p.add_argument(
        "--accumulate",
        type=int,
        default=1,
        metavar="K",
        help="update every K mini-batches with their mean gradient (default 1)",
    )
    p.add_argument(
        "--optimizer",
        default=DEFAULT_OPTIMIZER,
        choices=list(OPTIMIZERS),
        help=f"optimizer (default {DEFAULT_OPTIMIZER})",
    )
    add_optimizer_arguments(p)
    p.add_argument(
        "--clip-norm", type=float, metavar="X", help="scale the gradients to this global L2 norm at most"
    )
    p.add_argument("--clip-value", type=float, metavar="X", help="clip every gradient element to [-X, X]")
    p.add_argument(
        "--schedule",
        default="constant",
        choices=SCHEDULES,
        help="learning-rate schedule (default constant; plateau: divide by 10 when the validation loss "
        "(the training loss without --val-split) has not improved for 10 epochs)",
    )
    p.add_argument("--warmup", type=int, default=0, metavar="STEPS", help="linear warm-up steps (default 0)")
    p.add_argument(
        "--val-split", type=float, default=0.0, metavar="F", help="fraction held out for validation"
    )
    p.add_argument(
        "--patience",
        type=int,
        metavar="N",
        help="stop when the validation loss (the training loss without --val-split) has not improved "
        "for N epochs, and keep the best epoch's parameters",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffling and the split")
    p.add_argument(
        "--providers",
        metavar="P1,P2",
        help="onnxruntime execution providers, in order of preference (default: CPUExecutionProvider)",
    )
    p.add_argument("--plot", metavar="PNG", help="write the loss curves to this PNG file")
    p.add_argument("--history", metavar="FILE", help="write one row per epoch to this .csv or .json file")
    p.add_argument("--checkpoint", metavar="FILE", help="save a checkpoint (.npz) after every epoch")
    p.add_argument("--resume", metavar="FILE", help="resume from a checkpoint written by --checkpoint")
    p.add_argument(
        "-o", "--out-file", metavar="FILE", help="where to write the trained model (.onnx; required)"
    )
    add_deprecated(p, "--output-file", "--out-file", "out_file")
    add_deprecated(p, "--out", "--out-file", "out_file")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=_train)


def _schedule(args: argparse.Namespace, steps_per_epoch: int, val: bool, epochs: int) -> Any:
    """The learning rate of ``--schedule``, sized for a run of ``epochs`` epochs (``--epochs``, or
    what the checkpoint's schedule was made for when resuming)."""
    from .train import Constant, Cosine, InverseScaling, LinearWarmup, ReduceLROnPlateau, StepDecay

    total = max(1, epochs * steps_per_epoch - args.warmup)
    lr = args.lr
    sched: Any = {
        "constant": lambda: Constant(lr),
        "cosine": lambda: Cosine(lr, total_steps=total),
        "step": lambda: StepDecay(lr, step_size=max(1, epochs // 3) * steps_per_epoch, gamma=0.1),
        "invscaling": lambda: InverseScaling(lr),
        "plateau": lambda: ReduceLROnPlateau(lr, monitor="val_loss" if val else "loss"),
    }[args.schedule]()
    return LinearWarmup(sched, args.warmup) if args.warmup > 0 else sched


def _check_train_args(args: argparse.Namespace) -> None:
    """One-line errors for option values out of range."""
    if args.out_file is None:  # not required=True: the deprecated spellings fill it too
        raise InputError("-o/--out-file FILE is required: where to write the trained model")
    for flag, value, low in (
        ("--epochs", args.epochs, 1),
        ("--batch-size", args.batch_size, 1),
        ("--accumulate", args.accumulate, 1),
        ("--patience", args.patience, 1),
    ):
        if value is not None and value < low:
            raise InputError(f"{flag} must be >= {low}, got {value}")
    for flag, value in (("--clip-norm", args.clip_norm), ("--clip-value", args.clip_value)):
        if value is not None and not value > 0:
            raise InputError(f"{flag} must be > 0, got {value}")


def _train(args: argparse.Namespace) -> int:
    from .runtime import ForwardBackward
    from .train import (
        EarlyStopping,
        HistoryFile,
        Trainer,
        accuracy_metric,
        add_loss,
        load_dataset,
        remove_loss,
        split,
    )
    from .train.losses import CLASS_LOSSES
    from .train.trainer import input_infos

    start = time.perf_counter()
    _check_train_args(args)
    checked = load_checked(args.model)  # the one validation: add_loss rewrites the checked model
    base = checked.proto
    taken = {v.name for v in (*base.graph.input, *base.graph.output)} | {
        o for n in base.graph.node for o in n.output
    }
    target_input = next(n for n in ("target", "onnxgrad_target", "onnxgrad_target_2") if n not in taken)
    model = add_loss(checked, args.loss, output=args.loss_output, target_name=target_input)
    options = optimizer_options_from_args(args, args.optimizer)
    providers = [p.strip() for p in args.providers.split(",") if p.strip()] if args.providers else None
    fb = ForwardBackward(
        CheckedModel(model),
        trainable=args.trainable,
        frozen=args.frozen,
        outputs=["loss"],
        providers=providers,
    )
    loss_reads = args.loss_output or base.graph.output[0].name
    features = [c.strip() for c in args.features.split(",")] if args.features else None
    data = load_dataset(
        args.data, input_infos(fb), target=args.target, target_input=target_input, features=features
    )
    val = None
    if args.val_split:
        data, val = split(data, args.val_split, seed=args.seed)
    n_train = len(next(iter(data.values())))
    steps = math.ceil(math.ceil(n_train / args.batch_size) / args.accumulate)
    schedule_epochs = _schedule_epochs(args, steps)
    if args.warmup and args.warmup >= args.epochs * steps:
        print(
            f"onnxgrad: warning: --warmup {args.warmup} is longer than the run ({args.epochs * steps} "
            f"updates: {args.epochs} epochs of {steps}): the learning rate never reaches --lr {args.lr:g}",
            file=sys.stderr,
        )
    monitor = "val_loss" if val else "loss"
    stopper = EarlyStopping(monitor=monitor, patience=args.patience) if args.patience else None
    callbacks: list[Any] = [c for c in (stopper,) if c is not None]
    if args.history:
        callbacks.append(HistoryFile(args.history))
    classifier = args.loss in CLASS_LOSSES
    trainer = Trainer(
        fb,
        optimizer=args.optimizer,
        lr=_schedule(args, steps, val is not None, schedule_epochs),
        optimizer_options=options,
        batch_size=args.batch_size,
        seed=args.seed,
        progress=not args.no_progress,
        callbacks=callbacks,
        metrics={"acc": accuracy_metric(loss_reads, target_input)} if classifier else None,
        accumulate=args.accumulate,
        clip_norm=args.clip_norm,
        clip_value=args.clip_value,
    )
    trainer.run_info = {
        "data": os.path.abspath(args.data),
        "val_split": args.val_split,
        "seed": args.seed,
        "lr_schedule": args.schedule,
        "schedule_epochs": schedule_epochs,  # the run length the schedule was sized for
        "warmup": args.warmup,
    }
    resumed_at = 0
    if args.resume:
        trainer.load_checkpoint(args.resume)
        resumed_at = trainer.epoch
        _resume_notes(args.resume, trainer.changed_since_checkpoint)
    done_before = trainer.epoch
    history = trainer.fit(data, val, epochs=args.epochs, checkpoint=args.checkpoint)
    out = os.fspath(args.out_file)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    onnx.save(remove_loss(CheckedModel(fb.to_onnx())), out)  # our own rewrite: not checked again

    n_params = sum(p.size for p in trainer.parameters.values())
    val_text = f" / {len(next(iter(val.values())))} validation" if val else ""
    ran = trainer.epoch - done_before
    epochs = f"{ran} epoch{'s' if ran != 1 else ''}"
    if resumed_at:
        epochs += f" (epochs {resumed_at + 1}-{trainer.epoch}, resumed from epoch {resumed_at})"
    extra = "".join(
        f", {text}"
        for text, on in (
            (f"{args.accumulate} batches per update", args.accumulate > 1),
            (f"gradient norm clipped to {args.clip_norm}", args.clip_norm),
            (f"gradients clipped to ±{args.clip_value}", args.clip_value),
        )
        if on
    )
    print(
        f"trained {args.model}: {epochs} of {args.optimizer} (lr {args.lr}, {args.schedule} schedule, "
        f"batch {args.batch_size}{extra}), {n_train} training{val_text} samples"
    )
    print(f"  stopped       {_stop_reason(trainer, stopper, args.epochs, ran)}")
    losses = history["loss"]
    print(f"  loss          {losses[0]:.6g} -> {losses[-1]:.6g}")
    if val:
        vl = history["val_loss"]
        best = int(np.argmin(vl))
        print(f"  val loss      {vl[0]:.6g} -> {vl[-1]:.6g} (best {vl[best]:.6g} at epoch {best + 1})")
        if classifier:
            acc = history["val_acc"]
            print(f"  val accuracy  {acc[0]:.2%} -> {acc[-1]:.2%}")
    if args.schedule == "plateau" or args.warmup:
        print(f"  lr            {history['lr'][0]:.6g} -> {history['lr'][-1]:.6g}")
    print(f"  parameters    {len(trainer.parameters)} tensors, {n_params:,} values")
    print(f"  saved         {out}")
    if args.plot:
        print(f"  plot          {history.plot(args.plot, title=os.path.basename(args.model))}")
    if args.history:
        print(f"  history       {args.history}")
    if args.checkpoint:
        print(f"  checkpoint    {args.checkpoint}")
    print(f"  time          {time.perf_counter() - start:.1f} s")
    return 0


def _schedule_epochs(args: argparse.Namespace, steps: int) -> int:
    """The run length the learning-rate schedule is sized for: ``--epochs``, or, resuming with the
    same ``--schedule``, the length the checkpoint's schedule was made for, so that the rate goes on
    from where it stopped (a changed ``--epochs`` sized it anew: a cosine ended at 3 epochs jumped
    back up to a rate of its first epochs). A note on stderr says when that differs from
    ``--epochs`` for a schedule whose rates depend on it."""
    if not args.resume:
        return args.epochs
    from .train.checkpoint import read_checkpoint

    saved = read_checkpoint(args.resume).get("setup") or {}
    if saved.get("lr_schedule") != args.schedule or saved.get("schedule_epochs") is None:
        return args.epochs  # another schedule (named as a change), or a checkpoint that did not say
    epochs = int(saved["schedule_epochs"])
    if epochs != args.epochs and args.schedule in ("cosine", "step"):
        after = (
            "past its end the rate follows the cosine back up, as torch's CosineAnnealingLR does"
            if args.schedule == "cosine"
            else f"the rate still falls tenfold every {max(1, epochs // 3) * steps} updates"
        )
        print(
            f"onnxgrad: note: resuming {args.resume}: the {args.schedule} schedule keeps the length it "
            f"was made for, {epochs} epochs ({epochs * steps} updates), not --epochs {args.epochs}; "
            f"{after}; to size a schedule for {args.epochs} epochs, start a run without --resume",
            file=sys.stderr,
        )
    return epochs


def _resume_notes(path: str, changed: dict[str, tuple[Any, Any]]) -> None:
    """Refuse a resumed run whose data split differs from the checkpoint's; note other changes."""
    moved = {k: v for k, v in changed.items() if k in SPLIT_KEYS}
    if moved:
        what = "; ".join(f"{k} {old!r} in the checkpoint, {new!r} now" for k, (old, new) in moved.items())
        raise InputError(
            f"--resume {path}: the data or its split changed ({what}): resuming would move samples "
            f"between training and validation; use the checkpoint's values or start without --resume"
        )
    if changed:
        what = "; ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changed.items())
        print(
            f"onnxgrad: note: resuming {path} with settings changed since the checkpoint: {what}",
            file=sys.stderr,
        )


def _stop_reason(trainer: Any, stopper: Any, epochs: int, ran: int) -> str:
    """Why the run ended: early stopping (with its figures) or the epoch limit."""
    if stopper is not None and trainer.stop_training:
        restored = f"; the parameters of epoch {stopper.best_epoch} kept" if stopper.restore_best else ""
        return (
            f"early stopping at epoch {trainer.epoch}: {stopper.monitor} has not improved for "
            f"{stopper.patience} epochs (best {stopper.best:.6g} at epoch {stopper.best_epoch}){restored}"
        )
    if ran == 0:
        return f"nothing to run: the checkpoint is at epoch {trainer.epoch}, --epochs is {epochs}"
    return f"--epochs {epochs} reached"


# ---- bench -------------------------------------------------------------------------------------
def _bench(args: argparse.Namespace) -> int:
    import onnxruntime

    from .runtime.profile import profile_step, random_feeds

    if args.batch_size < 1:
        raise InputError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.steps < 1:
        raise InputError(f"--steps must be >= 1, got {args.steps}")
    if args.threads is not None and args.threads < 1:
        raise InputError(f"--threads must be >= 1, got {args.threads}")
    checked = load_checked(args.model)  # the one validation of this model
    model = checked.proto
    shapes = _checked_shapes(model, args.shape)
    feeds = random_feeds(model, batch=args.batch_size, shapes=shapes)
    prof = profile_step(checked, feeds, steps=args.steps, threads=args.threads)
    params = sum(prof.trainable.values())
    threads = "onnxruntime's default threads"
    if args.threads:
        threads = f"{args.threads} intra-op thread{'s' if args.threads > 1 else ''}"
    print(
        f"training step of {args.model}: forward + backward, output gradient of ones, "
        f"{len(prof.trainable)} trainable tensors ({params:,} values); onnxruntime "
        f"{onnxruntime.__version__}, {threads}"
    )
    described = ", ".join(f"{k} {v.dtype} {list(v.shape)}" for k, v in feeds.items())
    print(f"random inputs: {described or '-'}")
    notes = _set_dims(model, feeds, shapes)
    if notes:
        print(
            f"symbolic dimensions set to {args.batch_size} ({'; '.join(notes)}); "
            "change them with --batch-size N or --shape NAME=DIMS"
        )
    print()
    print(prof.report())
    if args.json:
        record = {
            "model": os.fspath(args.model),
            "onnxruntime": onnxruntime.__version__,
            "batch": args.batch_size,
        }
        record.update(prof.to_dict())
        os.makedirs(os.path.dirname(os.fspath(args.json)) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
            f.write("\n")
        print(f"\nevery figure written to {args.json}")
    return 0


# ---- random inputs (check, bench) --------------------------------------------------------------
def _parse_shapes(specs: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """The --shape NAME=DIMS options as name -> shape."""
    shapes = {}
    for spec in specs:
        name, sep, dims = spec.partition("=")
        bad = InputError(f"--shape {spec!r}: expected NAME=DIMS, e.g. x=2,3,8")
        if not sep or not name:
            raise bad
        try:
            shape = tuple(int(d) for d in dims.replace("x", ",").split(",") if d.strip())
        except ValueError:
            raise bad from None
        if any(d < 0 for d in shape):
            raise InputError(f"--shape {spec!r}: dimensions cannot be negative")
        shapes[name.strip()] = shape
    return shapes


def _checked_shapes(model: onnx.ModelProto, specs: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """The --shape options, each naming an input of ``model``."""
    shapes = _parse_shapes(specs)
    inits = {i.name for i in model.graph.initializer}
    inputs = [i.name for i in model.graph.input if i.name not in inits]
    unknown = [n for n in shapes if n not in inputs]
    if unknown:
        raise InputError(f"--shape names {unknown}, which are not inputs of the model ({inputs})")
    declared = {vi.name: value_info_from_proto(vi) for vi in model.graph.input}
    for name, shape in shapes.items():
        info = declared.get(name)
        if info is not None:
            try:
                check_input(name, dtype_name(info.dtype), shape, info)
            except InputError as exc:
                raise InputError(f"--shape {name}={','.join(map(str, shape))}: {exc}") from None
    return shapes


def _set_dims(
    model: onnx.ModelProto, feeds: dict[str, np.ndarray], shapes: dict[str, tuple[int, ...]]
) -> list[str]:
    """'name [N, 8] -> [2, 8]' for each input whose symbolic dimensions were given a value."""
    notes = []
    for vi in model.graph.input:
        info = value_info_from_proto(vi)
        if vi.name not in feeds or vi.name in shapes or info is None or info.shape is None:
            continue
        if info.shape != feeds[vi.name].shape:
            notes.append(f"{vi.name} {_shape(info.shape)} -> {list(feeds[vi.name].shape)}")
    return notes


# ---- check -------------------------------------------------------------------------------------
def _check(args: argparse.Namespace) -> int:
    from .runtime.profile import random_feeds
    from .testing import check_gradients, check_nodes, check_settings, result_status

    flags = {"max_elements": "--max-elements", "rtol": "--rtol", "atol": "--atol"}  # usage errors first
    check_settings(max_elements=args.max_elements, rtol=args.rtol, atol=args.atol, names=flags)
    checked = load_checked(args.model)  # the one validation of this model
    model = checked.proto
    shapes = _checked_shapes(model, args.shape)
    feeds = random_feeds(model, batch=2, seed=args.seed, shapes=shapes)
    notes = _set_dims(model, feeds, shapes)
    print(f"gradient check of {args.model} (opset {opset_of(model)}), against central finite differences")
    described = ", ".join(f"{k} {v.dtype} {list(v.shape)}" for k, v in feeds.items())
    print(f"random inputs: {described or '-'}")
    if notes:
        print(f"symbolic dimensions set to 2 ({'; '.join(notes)}); change them with --shape NAME=DIMS")
    rows, details = [], []
    tolerances = {k: v for k, v in (("rtol", args.rtol), ("atol", args.atol)) if v is not None}
    if not args.no_nodes:
        for c in check_nodes(model, feeds, max_elements=args.max_elements, seed=args.seed, **tolerances):
            status = c.status + (f" ({c.note})" if c.note else "")
            rows.append((c.name, c.op_type, c.checked_in, c.max_error, status))
            if c.status == "FAIL" and c.result is not None:
                details.append((f"node {c.name} ({c.op_type})", c.result.report()))
    try:
        whole = check_gradients(checked, feeds, max_elements=args.max_elements, seed=args.seed, **tolerances)
        worst = max(whole.max_error.values(), default=0.0)
        dtypes = sorted({str(v.dtype) for k, v in feeds.items() if v.dtype.kind == "f"}) or ["-"]
        status = result_status(whole)
        notes = "; ".join(n for n in (whole.nondiff_note(), whole.unprobed_note()) if n)
        status += f" ({notes})" if notes else ""
        rows.append(("whole model", "-", f"{'/'.join(dtypes)} onnxruntime", f"{worst:.2e}", status))
        if not whole.ok:
            details.append(("whole model", whole.report()))
    except OnnxGradError as exc:
        rows.append(("whole model", "-", "-", "-", f"FAIL ({' '.join(str(exc).split())})"))
    print()
    print(_table(("node", "op", "checked in", "max error", "status"), rows))
    for title, report in details:
        print(f"\n{title}:\n{report}")
    failed = sum(r[4].startswith("FAIL") for r in rows)
    skipped = sum(r[4].startswith("skipped") for r in rows)
    nondiff = sum(r[4].startswith("NONDIFF") for r in rows)
    empty = sum(r[4].startswith("EMPTY") for r in rows)
    kinks = f"{nondiff} not differentiable at some probed elements, " if nondiff else ""
    nothing = f", {empty} with no element to check" if empty else ""
    print(
        f"\n{len(rows)} checks: {len(rows) - failed - skipped - nondiff - empty} ok, {kinks}{failed} failed, "
        f"{skipped} skipped{nothing}"
    )
    if empty:
        print(
            "EMPTY: no element was compared (an empty input, e.g. --shape with a 0, or every probed "
            "element too large for the step to change it): that check proves nothing."
        )
    if nondiff:
        print(
            "NONDIFF: at those elements the function has a kink within the finite-difference step (a "
            "ReLU zero, a pooling or argmax tie) and the gradient lies between the one-sided slopes; "
            "the other elements agree. Another --seed probes other points."
        )
    if not failed and empty and len(rows) == skipped + empty:
        print("nothing was checked: no check compared a single element", file=sys.stderr)
        return 1
    return 1 if failed else 0


# ---- formatting --------------------------------------------------------------------------------
def _dtype(elem_type: int) -> str:
    return helper.tensor_dtype_to_string(elem_type).removeprefix("TensorProto.").lower()


def _shape(shape: tuple | None) -> str:
    if shape is None:
        return "?"
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def _numel(dims: Sequence[int]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def _describe(vi: onnx.ValueInfoProto) -> tuple[str, str, str]:
    info = value_info_from_proto(vi)
    if info is None:  # sequences, maps, optionals
        return vi.name, vi.type.WhichOneof("value") or "?", "-"
    return vi.name, _dtype(info.dtype), _shape(info.shape)


def _op_name(domain: str, op: str) -> str:
    return f"{domain}.{op}" if domain else op


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], indent: int = 0) -> str:
    """Rows as aligned text columns under ``header``."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    lines = [header, *rows]
    pad = " " * indent
    return "\n".join(
        pad + "  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines
    )


def _markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = [header, ["---"] * len(header), *rows]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


if __name__ == "__main__":
    sys.exit(main())
