"""The server side of a federated run: a Flower ``ServerApp`` around any Flower strategy.

The strategy (``flwr.serverapp.strategy``: FedAvg by default) does the sampling, the transport and
the aggregation. onnxgrad adds what a training run needs around it:

- the initial arrays are the model's trainable parameters (:class:`~.model.GlobalModel`);
- before the strategy aggregates a round, every reply is checked against them (the same names,
  shapes and dtypes, finite values); a bad one is dropped with a log line that names the node, and
  an aggregate that is not finite is not taken: the global model is never corrupted;
- after every round: ``out_dir/model.onnx`` (the global model), ``out_dir/history.json`` (one
  record per round: losses, replies, rejections, bytes sent and received, seconds) and
  ``out_dir/checkpoint.npz``, from which a new run resumes (``resume=True`` or the run config's
  ``resume = true``); for a LoRA model, ``out_dir/adapters.onnx_adapter`` too (onnxruntime's
  adapter format). Each file is written to a temporary name first, then moved.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Mapping
from logging import INFO, WARNING
from typing import Any

import numpy as np
import onnx

from ..errors import InputError
from ..lora import LORA_KEY, adapter_names, save_ort_adapter
from ..train.checkpoint import read_checkpoint, write_checkpoint
from .model import GlobalModel, ModelSource, Spec
from .records import array_record, arrays_of

__all__ = ["CHECKPOINT", "server_app"]

CHECKPOINT = "checkpoint.npz"
KIND = "onnxgrad.federated"
Evaluate = Callable[[int, dict[str, np.ndarray]], Mapping[str, float] | None]


def _log(level: int, text: str, *args: Any) -> None:
    from flwr.common.logger import log

    log(level, "onnxgrad.federated: " + text, *args)


class _Round:
    """What one round's hooks gathered for its history record."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.sent = self.received = 0
        self.replies = self.failed = 0
        self.rejected: list[dict[str, Any]] = []
        self.train: Mapping[str, Any] = {}
        self.evaluate: Mapping[str, Any] = {}


class _Run:
    """The hooks a run puts on the strategy, the global model's files and its history."""

    def __init__(self, model: GlobalModel, out_dir: str, done: int, history: list[dict[str, Any]]) -> None:
        self.model, self.out_dir, self.done, self.history = model, out_dir, done, history
        self.round = _Round()
        proto = model.proto
        lora = proto is not None and any(p.key == LORA_KEY for p in proto.metadata_props)
        # a LoRA model whose travelling arrays are adapters: their file in onnxruntime's format too
        self.adapters = bool(lora) and set(model.initial) <= set(adapter_names(proto))  # type: ignore[arg-type]

    def guard(self, strategy: Any) -> None:
        """Check replies before ``strategy`` aggregates them; count what travels."""
        spec = self.model.spec
        configure, aggregate = strategy.configure_train, strategy.aggregate_train
        aggregate_evaluate = strategy.aggregate_evaluate

        def configure_train(server_round: int, arrays: Any, config: Any, grid: Any) -> Iterable[Any]:
            self.round = _Round()
            messages = list(configure(server_round, arrays, config, grid))
            self.round.sent = sum(_bytes(m.content) for m in messages)
            return messages

        def aggregate_train(server_round: int, replies: Iterable[Any]) -> tuple[Any, Any]:
            good = []
            for msg in replies:
                if msg.has_error():
                    self.round.failed += 1
                    good.append(msg)  # the strategy logs and drops it
                    continue
                problem = spec.problem(arrays_of(msg.content))
                node = msg.metadata.src_node_id
                if problem is not None:
                    _log(
                        WARNING,
                        "round %d: rejected the reply of node %s: %s",
                        self.done + server_round,
                        node,
                        problem,
                    )
                    self.round.rejected.append({"node": int(node), "reason": problem})
                    continue
                self.round.replies += 1
                self.round.received += _bytes(msg.content)
                good.append(msg)
            arrays, metrics = aggregate(server_round, good)
            if arrays is not None:
                values = {k: v.numpy() for k, v in arrays.items()}
                values = {
                    k: v.astype(spec.arrays[k][1]) if k in spec.arrays else v for k, v in values.items()
                }
                problem = spec.problem(values)
                if problem is not None:
                    _log(
                        WARNING,
                        "round %d: the aggregate was not taken (%s): the global model stays",
                        self.done + server_round,
                        problem,
                    )
                    arrays = None
                else:
                    arrays = array_record(values)
            self.round.train = dict(metrics or {})
            return arrays, metrics

        def evaluate_hook(server_round: int, replies: Iterable[Any]) -> Any:
            metrics = aggregate_evaluate(server_round, replies)
            self.round.evaluate = dict(metrics or {})
            return metrics

        strategy.configure_train = configure_train
        strategy.aggregate_train = aggregate_train
        strategy.aggregate_evaluate = evaluate_hook

    def end_round(self, server_round: int, params: dict[str, np.ndarray], extra: Mapping[str, Any]) -> None:
        """The round's record, then the files (the checkpoint last: it names a complete round)."""
        r = self.round
        record: dict[str, Any] = {"round": self.done + server_round}
        record.update({k: v for k, v in r.train.items() if k != "num-examples"})
        record.update({k: v for k, v in r.evaluate.items() if k != "num-examples"})
        record.update(extra)
        record.update(
            replies=r.replies,
            failed=r.failed,
            rejected=r.rejected,
            bytes_sent=r.sent,
            bytes_received=r.received,
            seconds=time.perf_counter() - r.start,
        )
        self.history.append(record)
        self.write(params)
        state = {"kind": KIND, "round": record["round"], "params": params, "history": self.history}
        write_checkpoint(os.path.join(self.out_dir, CHECKPOINT), state)

    def write(self, params: dict[str, np.ndarray]) -> None:
        """``model.onnx``, ``history.json`` (and the adapters of a LoRA model) for ``params``."""
        model = self.model.to_onnx(params)
        _replace(os.path.join(self.out_dir, "model.onnx"), lambda p: onnx.save(model, p))
        _replace(
            os.path.join(self.out_dir, "history.json"),
            lambda p: open(p, "w").write(json.dumps(self.history, indent=1)),  # noqa: SIM115
        )
        if self.adapters:
            path = os.path.join(self.out_dir, "adapters.onnx_adapter")
            _replace(path, lambda p: save_ort_adapter(model, p, params))


def _replace(path: str, write: Callable[[str], Any]) -> None:
    tmp = path + ".tmp"
    write(tmp)
    os.replace(tmp, path)


def _bytes(content: Any) -> int:
    """The bytes of a message's arrays."""
    return sum(int(r.count_bytes()) for r in content.array_records.values())


def resume_state(out_dir: str, spec: Spec) -> tuple[int, dict[str, np.ndarray], list[dict[str, Any]]]:
    """(rounds done, global parameters, history) of ``out_dir``'s checkpoint, checked against the model."""
    path = os.path.join(out_dir, CHECKPOINT)
    state = read_checkpoint(path)
    if state.get("kind") != KIND:
        raise InputError(f"{path!r} is not the checkpoint of a federated run")
    params = {k: np.asarray(v) for k, v in state["params"].items()}
    problem = spec.problem(params)
    if problem is not None:
        raise InputError(f"{path!r} does not hold this model's trainable parameters: {problem}")
    return int(state["round"]), params, list(state["history"])


def server_app(
    model: ModelSource,
    *,
    strategy: Any = None,
    num_rounds: int = 3,
    out_dir: str | os.PathLike = "out/federated",
    evaluate: Evaluate | None = None,
    trainable: Iterable[str] | None = None,
    frozen: Iterable[str] = (),
    resume: bool = False,
    timeout: float | None = None,
) -> Any:
    """A Flower ``ServerApp`` (``flwr.serverapp.ServerApp``) that trains ``model`` over the nodes.

    ``model``, ``trainable``, ``frozen``: as the nodes' :func:`client_app` has them (their trainable
    parameters are the arrays that travel). ``strategy``: a ``flwr.serverapp.strategy`` instance,
    or a function ``context -> strategy`` (default: ``FedAvg()``). ``num_rounds`` rounds in all (a
    resumed run counts those done). ``evaluate(round, params)``: a centralized evaluation of the
    global parameters after each round, its metrics go into the history. ``timeout``: seconds a
    round waits for replies (a node that does not answer in time is left out of that round).
    ``resume``: continue from ``out_dir``'s checkpoint when there is one.
    The run config overrides ``num-server-rounds``, ``out-dir``, ``resume`` and ``round-timeout``
    (``0``: no limit).
    """
    from flwr.app import ConfigRecord, Context, MetricRecord
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg

    global_model = GlobalModel(model, trainable=trainable, frozen=frozen)
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        config = context.run_config
        rounds = int(config.get("num-server-rounds", num_rounds))
        folder = os.path.abspath(str(config.get("out-dir", os.fspath(out_dir))))
        again = bool(config.get("resume", resume))
        wait = config.get("round-timeout", timeout) or None  # 0: no limit
        os.makedirs(folder, exist_ok=True)
        done, params, history = 0, global_model.initial, list[dict[str, Any]]()
        if again and os.path.exists(os.path.join(folder, CHECKPOINT)):
            done, params, history = resume_state(folder, global_model.spec)
            _log(INFO, "resuming %s at round %d of %d", folder, done, rounds)
        run = _Run(global_model, folder, done, history)
        if done >= rounds:
            _log(INFO, "nothing to run: the checkpoint is at round %d, num-server-rounds is %d", done, rounds)
            run.write(params)
            return
        chosen = FedAvg() if strategy is None else strategy(context) if _is_factory(strategy) else strategy
        check_strategy(chosen)
        run.guard(chosen)

        def end_of_round(server_round: int, arrays: Any) -> Any:
            if server_round == 0:
                return None
            values = {k: v.numpy() for k, v in arrays.items()}
            extra = dict(evaluate(done + server_round, values) or {}) if evaluate is not None else {}
            run.end_round(server_round, values, extra)
            return MetricRecord(extra) if extra else None  # type: ignore[arg-type]

        chosen.start(
            grid=grid,
            initial_arrays=array_record(params),
            num_rounds=rounds - done,
            timeout=3600.0 if wait is None else float(wait),
            train_config=ConfigRecord({"round-offset": done}),
            evaluate_config=ConfigRecord({"round-offset": done}),
            evaluate_fn=end_of_round,
        )

    return app


def check_strategy(strategy: Any) -> None:
    """Refuse a strategy whose nodes would have to do what onnxgrad's client does not: FedProx with
    a proximal term (``proximal_mu > 0``: a term of the nodes' loss), and the client-side
    differential-privacy wrappers, whose nodes must clip their own updates (Flower's
    ``fixedclipping_mod`` / ``adaptiveclipping_mod``): unclipped, the noise the server adds protects
    nothing, while its log says it does."""
    if "ClientSide" in type(strategy).__name__ and "DifferentialPrivacy" in type(strategy).__name__:
        raise InputError(
            f"{type(strategy).__name__} relies on the nodes clipping their updates, which onnxgrad's "
            "client_app does not do: the noise would protect nothing. Use the server-side wrapper "
            "(DifferentialPrivacyServerSideFixedClipping or ...AdaptiveClipping), which clips on the server"
        )
    mu = getattr(strategy, "proximal_mu", 0.0)
    if mu and float(mu) > 0:
        raise InputError(
            f"{type(strategy).__name__}(proximal_mu={mu}) asks the nodes to add a proximal term to their "
            "loss, which onnxgrad's client_app does not: use proximal_mu=0 or another strategy"
        )


def _is_factory(strategy: Any) -> bool:
    """A function ``context -> strategy`` rather than a strategy (which has ``start``)."""
    return callable(strategy) and not hasattr(strategy, "start")
