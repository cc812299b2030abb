"""The node side of a federated run: a Flower ``ClientApp`` that trains with onnxgrad's core.

Each message from the server carries the global trainable parameters (an ``ArrayRecord`` keyed by
parameter name). The node copies them into a fresh :class:`~onnxgrad.train.Trainer` (an ONNX model)
or :class:`~onnxgrad.artifacts.Runner` (an artifacts folder: onnxruntime alone, no torch), trains on
its own examples, and replies with the same arrays, updated, and a ``MetricRecord``. The frozen
parameters, and the examples, never leave the node.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..artifacts import Runner
from ..errors import InputError
from ..train import BatchLoader, Trainer, as_feeds
from ..train.data import n_samples
from .model import ModelSource, is_artifacts_folder
from .records import arrays_of, reply_record

__all__ = ["client_app"]

DataFn = Callable[[Any], Mapping[str, np.ndarray]]
# run-config keys a Flower App may set (flwr run --run-config "lr=0.01 local-epochs=2"), with their types
RUN_CONFIG = {"lr": float, "local-epochs": int, "local-steps": int, "batch-size": int}


@dataclass
class _Local:
    """How a node trains: the arguments of :func:`client_app`, after the run config's overrides."""

    model: ModelSource
    loss: str | None
    loss_options: Mapping[str, Any] | None
    optimizer: str | None
    lr: float | None
    optimizer_options: Mapping[str, Any] | None
    local_epochs: int
    local_steps: int | None
    batch_size: int | None
    trainable: Iterable[str] | None
    frozen: Iterable[str]
    metrics: Mapping[str, Any] | None
    seed: int
    trainer_options: dict[str, Any] = field(default_factory=dict)

    def overridden(self, run_config: Mapping[str, Any]) -> _Local:
        """A copy with the run config's values of :data:`RUN_CONFIG` (``0`` local steps: none)."""
        changes = {
            k.replace("-", "_"): cast(run_config[k]) for k, cast in RUN_CONFIG.items() if k in run_config
        }
        if changes.get("local_steps") == 0:
            changes["local_steps"] = None
        if changes.get("batch_size") == 0:
            changes["batch_size"] = None
        return _Local(**{**self.__dict__, **changes})

    def check(self) -> None:
        if not (isinstance(self.local_epochs, int) and self.local_epochs >= 1):
            raise InputError(f"local_epochs must be an integer >= 1, got {self.local_epochs!r}")
        if self.local_steps is not None and not (isinstance(self.local_steps, int) and self.local_steps >= 1):
            raise InputError(f"local_steps must be an integer >= 1 or None, got {self.local_steps!r}")
        if self.batch_size is not None and not (isinstance(self.batch_size, int) and self.batch_size >= 1):
            raise InputError(
                f"batch_size must be an integer >= 1 or None (full batch), got {self.batch_size!r}"
            )

    # ---- training ----------------------------------------------------------------------------
    def train(
        self, incoming: dict[str, np.ndarray], data: Mapping[str, np.ndarray], seed: int
    ) -> tuple[dict[str, np.ndarray], float, int]:
        """(the updated arrays of ``incoming``, the mean training loss, the examples) after the local
        epochs or steps from ``incoming``."""
        n = n_samples(data)
        if n == 0:
            raise InputError("the node's data(context) returned no examples")
        batch = min(self.batch_size or n, n)  # None: full batch; never more than the node has
        if is_artifacts_folder(self.model):
            return self._train_runner(incoming, data, batch, seed)
        trainer = self._trainer(batch, shuffle=self.local_steps is None or self.batch_size is None, seed=seed)
        trainer.set_parameters(_only_known(incoming, trainer.parameters))
        feeds = as_feeds(data, trainer.inputs)
        if self.local_steps is None:
            trainer.fit(feeds, epochs=self.local_epochs)
        elif self.batch_size is None:  # N full-batch steps
            trainer.fit(feeds, epochs=self.local_steps)
        else:  # N mini-batches, drawn as the loader draws them, then one pass over them in order
            trainer.fit(_steps(feeds, batch, self.local_steps, seed), epochs=1)
        losses = trainer.history["loss"]
        params = trainer.parameters
        return {k: params[k].copy() for k in incoming}, float(np.mean(losses)), n

    def _trainer(self, batch_size: int, *, shuffle: bool, seed: int) -> Trainer:
        return Trainer(
            self.model,
            loss=self.loss,
            loss_options=self.loss_options,
            optimizer=self.optimizer or "sgd",
            lr=self.lr,
            optimizer_options=self.optimizer_options,
            batch_size=batch_size,
            shuffle=shuffle,
            seed=seed,
            progress=False,
            trainable=self.trainable,
            frozen=self.frozen,
            metrics=self.metrics,
            **self.trainer_options,
        )

    def _runner(self) -> Runner:
        return Runner(self.model, lr=self.lr)  # type: ignore[arg-type]

    def _train_runner(
        self, incoming: dict[str, np.ndarray], data: Mapping[str, np.ndarray], batch: int, seed: int
    ) -> tuple[dict[str, np.ndarray], float, int]:
        runner = self._runner()
        runner.set_parameters(incoming)
        loader = BatchLoader(dict(data), batch, shuffle=True, rng=seed)
        if self.local_steps is None:
            batches = [b for _ in range(self.local_epochs) for b in loader]
        else:
            batches = list(_draw(loader, self.local_steps))
        losses = [runner.step(b) for b in batches]
        params = runner.parameters
        return {k: params[k] for k in incoming}, float(np.mean(losses)), n_samples(data)

    def evaluate(self, incoming: dict[str, np.ndarray], data: Mapping[str, np.ndarray]) -> dict[str, float]:
        """``{"eval_loss", <metric>...}`` of the model holding ``incoming`` on ``data``."""
        if is_artifacts_folder(self.model):
            runner = self._runner()
            runner.set_parameters(incoming)
            total, seen = 0.0, 0
            for b in BatchLoader(dict(data), 256, shuffle=False):
                k = n_samples(b)
                total, seen = total + runner.evaluate(b)[runner.loss_name] * k, seen + k
            return {"eval_loss": total / seen}
        trainer = self._trainer(self.batch_size or 32, shuffle=False, seed=0)
        trainer.set_parameters(_only_known(incoming, trainer.parameters))
        return {f"eval_{k}": v for k, v in trainer.evaluate(data).items()}


def _only_known(
    incoming: Mapping[str, np.ndarray], params: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """``incoming``, refused when it names parameters this node does not train (server and node
    chose different parameters) or misses some."""
    if sorted(incoming) != sorted(params):
        raise InputError(
            f"the server sent arrays {sorted(incoming)}, this node trains {sorted(params)}: give "
            "client_app and server_app the same model, trainable= and frozen="
        )
    return dict(incoming)


def _draw(loader: BatchLoader, steps: int) -> Iterable[dict[str, np.ndarray]]:
    """``steps`` mini-batches of ``loader``, passes after passes."""
    done = 0
    while done < steps:
        for b in loader:
            yield b
            done += 1
            if done == steps:
                return


def _steps(data: Mapping[str, np.ndarray], batch: int, steps: int, seed: int) -> dict[str, np.ndarray]:
    """The ``steps`` mini-batches a shuffled pass (then the next) gives, end to end: one epoch over
    them in order, at ``batch``, makes exactly those steps."""
    drawn = list(
        _draw(
            BatchLoader(dict(data), batch, shuffle=True, drop_last=n_samples(data) >= batch, rng=seed), steps
        )
    )
    return {k: np.concatenate([b[k] for b in drawn]) for k in data}


def client_app(
    model: ModelSource,
    data: DataFn,
    *,
    loss: str | None = None,
    loss_options: Mapping[str, Any] | None = None,
    optimizer: str | None = None,
    lr: float | None = None,
    optimizer_options: Mapping[str, Any] | None = None,
    local_epochs: int = 1,
    local_steps: int | None = None,
    batch_size: int | None = 32,
    trainable: Iterable[str] | None = None,
    frozen: Iterable[str] = (),
    eval_data: DataFn | None = None,
    metrics: Mapping[str, Any] | None = None,
    seed: int = 0,
    **trainer_options: Any,
) -> Any:
    """A Flower ``ClientApp`` (``flwr.clientapp.ClientApp``) that trains ``model`` on a node's data.

    ``model``: an ONNX model (proto or path), or a folder written by
    :func:`onnxgrad.artifacts.generate` (the node then runs the one-graph step with onnxruntime
    alone; its loss and optimizer are the folder's). ``data(context)``: the node's examples, input
    name -> array with the ``target`` (read from Flower's ``Context``: ``context.node_config``,
    ``context.run_config``). ``loss``, ``loss_options``, ``optimizer`` (default ``"sgd"``), ``lr``,
    ``optimizer_options``, ``trainable``, ``frozen``, ``metrics`` and ``trainer_options`` are
    :class:`~onnxgrad.train.Trainer`'s. Each round trains ``local_epochs`` epochs, or ``local_steps``
    mini-batches, from the global parameters (a fresh optimizer every round); ``batch_size=None``:
    full batch. ``eval_data(context)``: the examples of the evaluate messages (default ``data``).
    The run config overrides ``lr``, ``local-epochs``, ``local-steps`` and ``batch-size``.

    Replies to ``train``: the trained arrays (those the server sent: the trainable parameters) and
    ``{"train_loss", "num-examples"}``; to ``evaluate``: ``{"eval_loss", "eval_<metric>"...,
    "num-examples"}``.
    """
    from flwr.app import Context, Message
    from flwr.clientapp import ClientApp

    if is_artifacts_folder(model):
        given = {
            "loss": loss,
            "optimizer": optimizer,
            "trainable": trainable,
            "optimizer_options": optimizer_options,
        }
        given = {k: v for k, v in given.items() if v is not None}
        if frozen:
            given["frozen"] = frozen
        if given or trainer_options or metrics:
            raise InputError(
                f"an artifacts folder has its loss, optimizer and parameters: do not pass {sorted(given)}"
            )
    elif not callable(data):
        raise InputError(f"data must be a function context -> arrays, got {type(data).__name__}")
    local = _Local(
        model=model,
        loss=loss,
        loss_options=loss_options,
        optimizer=optimizer,
        lr=lr,
        optimizer_options=optimizer_options,
        local_epochs=local_epochs,
        local_steps=local_steps,
        batch_size=batch_size,
        trainable=trainable,
        frozen=frozen,
        metrics=metrics,
        seed=seed,
        trainer_options=dict(trainer_options),
    )
    local.check()
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        run = local.overridden(context.run_config)
        run.check()
        config = _config(msg)
        if float(config.get("proximal-mu", 0.0)) > 0:
            raise InputError(
                "the strategy asks for FedProx's proximal term (proximal-mu > 0), which onnxgrad's "
                "client does not add to the loss: use proximal_mu=0 or another strategy"
            )
        round_ = int(config.get("server-round", 0)) + int(config.get("round-offset", 0))
        node_seed = run.seed + 1_000_003 * round_ + int(context.node_id) % 1_000_003
        updated, train_loss, n = run.train(arrays_of(msg.content), data(context), node_seed)
        content = reply_record(updated, {"train_loss": train_loss, "num-examples": n})
        return Message(content, reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        run = local.overridden(context.run_config)
        examples = (eval_data or data)(context)
        metrics = run.evaluate(arrays_of(msg.content), examples)
        content = reply_record(None, {**metrics, "num-examples": n_samples(examples)})
        return Message(content, reply_to=msg)

    return app


def _config(msg: Any) -> dict[str, Any]:
    """The message's config records, merged."""
    out: dict[str, Any] = {}
    for record in msg.content.config_records.values():
        out.update(record)
    return out
