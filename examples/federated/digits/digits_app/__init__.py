"""onnxgrad's digits MLP on Flower: the task (model, non-IID data), the ClientApp, the ServerApp."""
