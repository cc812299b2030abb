"""``onnxgrad artifacts MODEL --loss L --optimizer O -o DIR``: write a training folder."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from ..errors import InputError
from ..train.losses import LOSSES
from ..train.optimizers import DEFAULT_LR, DEFAULT_OPTIMIZER, definition
from .optim import OPTIMIZERS
from .targets import DEFAULT_TARGETS, MISSING_KERNELS

__all__ = ["add_deprecated", "add_parameter_arguments", "add_parser", "registry_defaults"]


class _Deprecated(argparse.Action):
    """An old spelling of an option: stores into the new option's destination and says so on stderr."""

    def __init__(self, option_strings: Sequence[str], dest: str, new: str = "", **kwargs: Any) -> None:
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: Any = None
    ) -> None:
        print(f"onnxgrad: note: {option} is deprecated, use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_deprecated(parser: argparse.ArgumentParser, old: str, new: str, dest: str, **kwargs: Any) -> None:
    """Accept ``old`` as a hidden spelling of option ``new`` (destination ``dest``), with a note."""
    parser.add_argument(old, dest=dest, action=_Deprecated, new=new, help=argparse.SUPPRESS, **kwargs)


def registry_defaults(option: str, names: Sequence[str] = ("adamw", "adam", "sgd")) -> str:
    """Each optimizer's default of ``option``, read from the registry (:mod:`onnxgrad.train.optimizers`)
    for a help text: ``"adamw 0.01, adam 0, sgd 0"``."""
    found = [(n, definition(n).defaults[option]) for n in names if option in definition(n).defaults]
    return ", ".join(f"{n} {v:g}" for n, v in found)


def add_parameter_arguments(parser: argparse.ArgumentParser, verb: str = "train") -> None:
    """``--trainable NAME...`` and ``--frozen NAME...``, the ``trainable=`` / ``frozen=`` of every
    front end (:func:`onnxgrad.autodiff.params.select_parameters`), on a subcommand."""
    parser.add_argument(
        "--trainable",
        nargs="+",
        metavar="NAME",
        help=f"initializers to {verb} (default: the parameters `onnxgrad info` lists)",
    )
    parser.add_argument(
        "--frozen",
        nargs="+",
        default=[],
        metavar="NAME",
        help="initializers left out of those (a tied one: all its copies)",
    )


def add_parser(sub: Any) -> None:
    """Register the ``artifacts`` subcommand on the ``onnxgrad`` subparsers."""
    p = sub.add_parser(
        "artifacts",
        help="write one-graph training steps (train_step.onnx...) that any onnxruntime runs",
        description=(
            "Write train_step.onnx (forward, loss, backward and optimizer update in one graph), "
            "eval_step.onnx, inference.onnx, state.safetensors and manifest.json."
        ),
    )
    p.add_argument("model", metavar="MODEL", help="path of the ONNX model")
    p.add_argument("-o", "--out-dir", dest="out_dir", metavar="DIR", help="the folder to write (required)")
    add_deprecated(p, "--output-dir", "--out-dir", "out_dir")
    p.add_argument("--loss", required=True, choices=[*LOSSES, "none"], help="loss appended to the model")
    p.add_argument(
        "--loss-output", metavar="NAME", help="model output the loss reads (default: the first output)"
    )
    p.add_argument(
        "--optimizer",
        default=DEFAULT_OPTIMIZER,
        choices=list(OPTIMIZERS),
        help=f"optimizer of the step (default {DEFAULT_OPTIMIZER})",
    )
    p.add_argument(
        "--lr",
        type=float,
        default=DEFAULT_LR,
        help=f"default learning rate (an input of the step; default {DEFAULT_LR:g})",
    )
    p.add_argument(
        "--weight-decay", type=float, help=f"default: the optimizer's ({registry_defaults('weight_decay')})"
    )
    p.add_argument("--momentum", type=float, help=f"SGD momentum (default {registry_defaults('momentum')})")
    p.add_argument("--dampening", type=float, help="SGD dampening")
    p.add_argument("--nesterov", action="store_true", help="SGD Nesterov momentum")
    p.add_argument("--betas", type=float, nargs=2, metavar=("B1", "B2"), help="Adam/AdamW betas")
    p.add_argument("--eps", type=float, help="Adam/AdamW epsilon")
    add_parameter_arguments(p)
    add_deprecated(p, "--requires-grad", "--trainable", "trainable", nargs="+")
    p.add_argument(
        "--target",
        nargs="+",
        dest="targets",
        choices=sorted(MISSING_KERNELS),
        default=list(DEFAULT_TARGETS),
        metavar="RUNTIME",
        help=f"runtimes the folder must run on (default: {' '.join(DEFAULT_TARGETS)}; "
        f"known: {', '.join(sorted(MISSING_KERNELS))})",
    )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.out_dir is None:  # not required=True: the deprecated --output-dir fills it too
        raise InputError("-o/--out-dir DIR is required: the folder to write the artifacts to")
    from .generate import generate

    options = {
        k: v
        for k, v in {
            "weight_decay": args.weight_decay,
            "momentum": args.momentum,
            "dampening": args.dampening,
            "betas": tuple(args.betas) if args.betas else None,
            "eps": args.eps,
        }.items()
        if v is not None
    }
    if args.nesterov:
        options["nesterov"] = True
    loss_options = {"output": args.loss_output} if args.loss_output else {}
    art = generate(
        args.model,
        trainable=args.trainable,
        frozen=args.frozen,
        loss=None if args.loss == "none" else args.loss,
        loss_options=loss_options,
        optimizer=args.optimizer,
        lr=args.lr,
        out_dir=args.out_dir,
        targets=args.targets,
        optimizer_options=options,
    )
    m = art.manifest
    print(f"wrote {args.out_dir}: {', '.join(m['files'].values())}")
    print(f"opset {m['opset']}, IR {m['ir_version']}, {len(art.train_step.graph.node)} nodes in the step")
    print(f"batch: {', '.join(b['name'] for b in m['batch'])}")
    print(f"parameters ({len(m['parameters'])}): {', '.join(p['name'] for p in m['parameters'])}")
    print(f"optimizer: {m['optimizer']}")
    return 0
