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

__all__ = [
    "add_deprecated",
    "add_optimizer_arguments",
    "add_parameter_arguments",
    "add_parser",
    "optimizer_options_from_args",
    "registry_defaults",
]

OPTIMIZER_NAMES = ("adamw", "adam", "sgd")  # the optimizers the commands offer, by registry name
# what each hyperparameter means, for the help only: the options, which optimizer takes each and
# their defaults come from the registry (onnxgrad.train.optimizers)
_OPTION_HELP = {
    "weight_decay": "weight decay",
    "momentum": "SGD momentum",
    "dampening": "SGD dampening",
    "nesterov": "SGD Nesterov momentum",
    "betas": "Adam/AdamW betas",
    "eps": "Adam/AdamW epsilon",
}


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
    return ", ".join(f"{n} {_fmt_default(v)}" for n, v in found)


def _fmt_default(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return " ".join(f"{v:g}" for v in value)
    return f"{value:g}"


def _takers(names: Sequence[str] = OPTIMIZER_NAMES) -> dict[str, list[str]]:
    """Each hyperparameter of the registry's ``names`` optimizers -> the optimizers that take it."""
    takers: dict[str, list[str]] = {}
    for name in names:
        for option in definition(name).defaults:
            takers.setdefault(option, []).append(name)
    return takers


def add_optimizer_arguments(parser: argparse.ArgumentParser, names: Sequence[str] = OPTIMIZER_NAMES) -> None:
    """An option per hyperparameter of the registry's ``names`` optimizers (``--weight-decay``,
    ``--momentum``, ``--dampening``, ``--nesterov``, ``--betas B1 B2``, ``--eps``), typed after its
    default: one definition of the optimizer options for every command (``train``, ``artifacts``).
    Read them back with :func:`optimizer_options_from_args`."""
    for option, takers in _takers(names).items():
        default = definition(takers[0]).defaults[option]
        flag = "--" + option.replace("_", "-")
        what = _OPTION_HELP.get(option, option.replace("_", " "))
        text = f"{what} (default: {registry_defaults(option, names)})"
        if isinstance(default, bool):
            parser.add_argument(flag, action="store_true", default=None, help=text)
        elif isinstance(default, tuple):
            metavar = tuple(f"{option[0].upper()}{k + 1}" for k in range(len(default)))
            parser.add_argument(flag, type=float, nargs=len(default), metavar=metavar, help=text)
        else:
            parser.add_argument(flag, type=float, metavar="X", help=text)


def optimizer_options_from_args(
    args: argparse.Namespace, optimizer: str, names: Sequence[str] = OPTIMIZER_NAMES
) -> dict[str, Any]:
    """The ``optimizer_options`` the options of :func:`add_optimizer_arguments` give, for
    ``optimizer``; an :class:`InputError` for one that ``optimizer`` does not take (the registry
    checks the values)."""
    options: dict[str, Any] = {}
    for option, takers in _takers(names).items():
        value = getattr(args, option, None)
        if value is None:
            continue
        if optimizer not in takers:
            flag = "--" + option.replace("_", "-")
            raise InputError(f"{flag} applies to --optimizer {' or '.join(takers)} only")
        options[option] = tuple(value) if isinstance(value, list) else value
    return options


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
    add_optimizer_arguments(p)
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

    options = optimizer_options_from_args(args, args.optimizer)
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
