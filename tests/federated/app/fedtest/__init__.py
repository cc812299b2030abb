"""The Flower App of tests/federated (see its pyproject.toml)."""
