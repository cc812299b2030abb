"""The nodes of tests/federated: onnxgrad's ClientApp on this node's part of the data, set from the
run config. ``bad-node`` (a partition id) replies with bad arrays instead, of the kinds ``bad-kind``
lists (one per round, in turn): ``unknown`` names, a wrong ``shape`` or ``dtype``, ``nan``."""

from __future__ import annotations

import os

import numpy as np
from flwr.app import Array, Context, Message
from flwr.clientapp import ClientApp

from onnxgrad.federated import client_app

app = ClientApp()


def _data(context: Context) -> dict[str, np.ndarray]:
    part = int(context.node_config["partition-id"])
    with np.load(os.path.join(str(context.run_config["data"]), f"part{part}.npz")) as f:
        return {k: f[k] for k in f.files}


def _node(context: Context) -> ClientApp:
    config = context.run_config
    model = str(config["model"])
    if os.path.isdir(model):  # an artifacts folder: its loss and optimizer
        return client_app(model, _data, lr=float(config["lr"]))
    output = str(config["loss-output"])  # the model's output the loss reads (default: the first)
    return client_app(
        model,
        _data,
        loss=str(config["loss"]),
        loss_options={"output": output} if output else None,
        optimizer="sgd",
        lr=float(config["lr"]),
    )


def _corrupt(reply: Message, kind: str) -> Message:
    record = reply.content["arrays"]
    name = next(iter(record.keys()))
    value = record[name].numpy()
    if kind == "unknown":
        record["not_a_parameter"] = Array(value.copy())
    elif kind == "shape":
        record[name] = Array(np.zeros((*value.shape, 2), value.dtype))
    elif kind == "dtype":
        record[name] = Array(value.astype(np.float64))
    elif kind == "nan":
        value = value.copy()
        value.flat[0] = np.nan
        record[name] = Array(value)
    return reply


@app.train()
def train(msg: Message, context: Context) -> Message:
    reply = _node(context)(msg, context)
    if int(context.node_config["partition-id"]) == int(context.run_config["bad-node"]):
        kinds = str(context.run_config["bad-kind"]).split(",")  # one per round, in turn
        round_ = int(msg.content["config"]["server-round"])
        reply = _corrupt(reply, kinds[(round_ - 1) % len(kinds)])
    return reply


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return _node(context)(msg, context)
