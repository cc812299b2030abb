"""Federated QLoRA of onnxruntime-genai's tiny int4 Llama: the task, the ClientApp, the ServerApp."""
