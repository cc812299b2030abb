"""The ClientApp: each SuperNode trains the MLP on its own part of the digits."""

from flwr.app import Context

from onnxgrad.federated import client_app

from .task import model, partition


def data(context: Context):
    return partition(int(context.node_config["partition-id"]), int(context.node_config["num-partitions"]))


app = client_app(
    model(), data, loss="cross_entropy", optimizer="adamw", lr=1e-3, local_epochs=1, batch_size=32
)
