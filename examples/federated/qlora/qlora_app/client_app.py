"""The ClientApp: rank-4 adapters trained on this node's sequences (the model path is the run
config's, so the app is made on the first message)."""

import functools

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from onnxgrad.federated import client_app

from .task import adapted, sequences

app = ClientApp()


@functools.cache
def _node(path: str) -> ClientApp:
    return client_app(
        adapted(path),
        lambda context: sequences(int(context.node_config["partition-id"])),
        loss="cross_entropy",
        loss_options={"output": "class_scores"},
        optimizer="sgd",
        lr=0.5,
        local_steps=4,
        batch_size=8,
    )


@app.train()
def train(msg: Message, context: Context) -> Message:
    return _node(str(context.run_config["model"]))(msg, context)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return _node(str(context.run_config["model"]))(msg, context)
