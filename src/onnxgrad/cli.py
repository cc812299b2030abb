"""The ``onnxgrad`` command line (also ``python -m onnxgrad``).

Subcommands: ``grad`` (write the forward and backward graphs of a model), ``coverage`` (the ops
with gradient rules), ``info`` (what a model contains and which of its ops lack a rule) and ``demo``
(train an MLP on the digits data set). Errors that onnxgrad raises are printed as one line on
stderr with exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from collections.abc import Callable, Sequence

import onnx
from onnx import helper

from ._version import __version__
from .autodiff import build_gradient, rules_table, supported_ops
from .autodiff.graph import FLOAT_TYPES, load_model, opset_of, value_info_from_proto
from .autodiff.registry import lookup
from .errors import OnnxGradError

Command = Callable[[argparse.Namespace], int]


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


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="onnxgrad", description="Backward graphs for ONNX models, run on stock onnxruntime."
    )
    parser.add_argument("--version", action="version", version=f"onnxgrad {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("grad", help="write the forward and backward graphs of a model")
    p.add_argument("model", metavar="MODEL", help="path of the ONNX model")
    p.add_argument(
        "-o",
        "--output-dir",
        required=True,
        metavar="DIR",
        help="directory for forward.onnx and backward.onnx",
    )
    p.add_argument(
        "--trainable",
        nargs="+",
        metavar="NAME",
        help="initializers to differentiate (default: every floating-point one)",
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

    p = sub.add_parser("coverage", help="the ops with gradient rules")
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")
    p.set_defaults(func=_coverage)

    p = sub.add_parser("info", help="inputs, outputs, parameters and ops of a model")
    p.add_argument("model", metavar="MODEL", help="path of the ONNX model")
    p.set_defaults(func=_info)

    p = sub.add_parser("demo", help="train an MLP on scikit-learn's digits with onnxruntime")
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "-o",
        "--output",
        default=None,
        metavar="PATH",
        help="where to write the trained model (default: out/digits_mlp.onnx)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=_demo)
    return parser


# ---- subcommands -------------------------------------------------------------------------------
def _grad(args: argparse.Namespace) -> int:
    graphs = build_gradient(
        args.model,
        trainable=args.trainable,
        inputs_requiring_grad=args.inputs_requiring_grad,
        outputs=args.outputs,
    )
    fwd_path, bwd_path = graphs.save(args.output_dir)
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
    header = ("op", "domain", "since opset", "kind")
    rows = [(r.op_type, r.domain or "ai.onnx", str(r.since), r.kind) for r in rules_table()]
    print(_markdown(header, rows) if args.markdown else _table(header, rows))
    kinds = Counter(supported_ops().values())
    counts = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
    print(f"\n{sum(kinds.values())} ops ({counts}); {len(rows)} rule versions")
    return 0


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

    params = [t for t in g.initializer if t.data_type in FLOAT_TYPES]
    total = sum(_numel(t.dims) for t in params)
    print(f"\ntrainable parameters: {len(params)} tensors, {total:,} values")
    rows = [(t.name, _dtype(t.data_type), _shape(tuple(t.dims)), f"{_numel(t.dims):,}") for t in params]
    if rows:
        print(_table(("name", "type", "shape", "size"), rows, indent=2))
    others = len(g.initializer) - len(params)
    if others:
        print(f"  (+ {others} non-floating-point initializers, never trainable)")

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

    kwargs = {"path": args.output} if args.output else {}
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
