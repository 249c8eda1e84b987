"""LightningModules used by the examples, configs, benchmarks and tests.

``MLPClassifier`` (``mlp.py``) is the small classifier of the MNIST-1D and digits workloads;
``TransformerLM`` (``transformer.py``) the character-level language model of the
Python-standard-library workload (:class:`~lightning_dist.data.StdlibTextDataModule`).
"""

from lightning_dist.models.mlp import MLPClassifier
from lightning_dist.models.transformer import TransformerLM

__all__ = ["MLPClassifier", "TransformerLM"]
