"""TransformerLM.preset: the named sizes of the module docstring's table, the 100M one counted on the meta device."""

import pytest
import torch

from lightning_dist.models import TransformerLM
from lightning_dist.models.transformer import PRESETS


def formula(vocab_size: int, block_size: int, n_layer: int, n_embd: int) -> int:
    """The module docstring's count: embeddings, per block 12 C^2 + 13 C, the final LayerNorm."""
    return vocab_size * n_embd + block_size * n_embd + n_layer * (12 * n_embd**2 + 13 * n_embd) + 2 * n_embd


@pytest.mark.parametrize("name, parameters", [("default", 842_496), ("small", 1_298_880), ("large", 10_795_008),
                                              ("100m", 106_614_528)])
def test_presets_have_the_documented_sizes(name, parameters):
    with torch.device("meta"):  # no memory: 106M parameters counted without allocating 426 MB
        model = TransformerLM.preset(name)
    assert next(model.parameters()).device.type == "meta"
    config = PRESETS[name]
    assert model.num_parameters == parameters == formula(256, 128, config["n_layer"], config["n_embd"])
    assert {key: model.hparams[key] for key in config} == config


def test_the_large_model_preset_has_at_least_100m_parameters_and_attention_heads_of_64():
    with torch.device("meta"):
        model = TransformerLM.preset("100m")
    assert model.num_parameters >= 100_000_000
    assert model.hparams.n_embd // model.hparams.n_head == 64  # GPT-2 small's head size
    assert model(torch.zeros(2, 16, dtype=torch.int64, device="meta")).shape == (2, 16, 256)


def test_preset_arguments_override_and_unknown_names_are_refused():
    with torch.device("meta"):
        model = TransformerLM.preset("small", learning_rate=3e-4, block_size=64, n_layer=2)
    assert (model.hparams.learning_rate, model.hparams.block_size, model.hparams.n_layer) == (3e-4, 64, 2)
    assert model.hparams.n_embd == 160
    with pytest.raises(ValueError, match="unknown TransformerLM preset 'huge'.*100m"):
        TransformerLM.preset("huge")
