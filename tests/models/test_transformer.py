"""TransformerLM: shapes, causality, the tied head, GPT-2 initialisation, the optimizer's groups and warmup,
per-character validation means, argument checks, and that the loss falls on a tiny corpus."""

import math

import lightning as L
import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_dist.data import StdlibTextDataModule
from lightning_dist.models import TransformerLM

TINY = dict(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32)


def tiny_model(**kwargs) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(**{**TINY, **kwargs}).eval()


def trainer(**kwargs) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, **kwargs)


def test_forward_shapes_and_sequence_length_limit():
    model = tiny_model()
    for time in (1, 5, 16):
        assert model(torch.randint(0, 256, (3, time))).shape == (3, time, 256)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 17, dtype=torch.int64))


def test_attention_is_causal():
    """Logits at positions <= t do not depend on tokens after t; a token at t does change positions after it."""
    model = tiny_model()
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(x)
        for t in (0, 7, 14):
            later_changed = x.clone()
            later_changed[:, t + 1:] = (later_changed[:, t + 1:] + 1) % 256
            assert torch.allclose(model(later_changed)[:, : t + 1], logits[:, : t + 1], rtol=0, atol=1e-6)
            this_changed = x.clone()
            this_changed[:, t] = (this_changed[:, t] + 1) % 256
            moved = (model(this_changed) - logits).abs().amax(dim=-1)  # (B, T)
            assert torch.equal(moved[:, :t], torch.zeros_like(moved[:, :t]))
            assert bool((moved[:, t:] > 1e-4).all())  # position t and every later position see the change


def test_head_is_tied_to_the_token_embedding_and_counted_once():
    model = tiny_model(vocab_size=50, block_size=12, n_layer=3, n_head=4, n_embd=24)
    assert model.head.weight is model.token_embedding.weight
    # By hand: embeddings V*C + T*C; per block 2 LayerNorms (4C), qkv (3C^2 + 3C), output projection (C^2 + C),
    # MLP C->4C->C (8C^2 + 5C); final LayerNorm 2C.
    V, T, C, layers = 50, 12, 24, 3
    expected = V * C + T * C + layers * (4 * C + 3 * C * C + 3 * C + C * C + C + 8 * C * C + 5 * C) + 2 * C
    assert model.num_parameters == expected == sum(p.numel() for p in set(model.parameters()))
    optimizer = model.configure_optimizers()
    model.train()
    x = torch.randint(0, 50, (4, 12))
    model.training_step((x, x.roll(-1, dims=1)), 0)["loss"].backward()
    optimizer.step()
    assert model.head.weight is model.token_embedding.weight
    # A state_dict round trip keeps one matrix.
    fresh = TransformerLM(vocab_size=50, block_size=12, n_layer=3, n_head=4, n_embd=24)
    fresh.load_state_dict(model.state_dict())
    assert fresh.head.weight is fresh.token_embedding.weight
    assert torch.equal(fresh.head.weight, model.token_embedding.weight)


@pytest.mark.parametrize("n_layer", [2, 8])
def test_gpt2_initialisation(n_layer):
    torch.manual_seed(0)
    model = TransformerLM(n_layer=n_layer, n_embd=256, n_head=4)
    residual_std = 0.02 / math.sqrt(2 * n_layer)
    for name, parameter in model.named_parameters():
        if name.endswith("bias"):
            assert torch.equal(parameter, torch.zeros_like(parameter)), name
        elif "ln_" in name:
            assert torch.equal(parameter, torch.ones_like(parameter)), name
        else:
            is_residual_projection = name.endswith("attention.proj.weight") or name.endswith("mlp.2.weight")
            expected = residual_std if is_residual_projection else 0.02
            assert float(parameter.std()) == pytest.approx(expected, rel=0.05), name
            assert abs(float(parameter.mean())) < 0.1 * expected, name


def test_weight_decay_on_matrices_only_and_linear_warmup():
    model = tiny_model(learning_rate=0.01, weight_decay=0.3, betas=(0.8, 0.9), warmup_steps=4)
    configured = model.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]
    assert isinstance(optimizer, torch.optim.AdamW) and scheduler["interval"] == "step"
    decay, no_decay = optimizer.param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.3, 0.0)
    assert decay["betas"] == (0.8, 0.9)
    decayed = sorted(names[id(p)] for p in decay["params"])
    assert decayed == sorted(n for n, p in model.named_parameters() if n.endswith("weight") and "ln_" not in n)
    assert "token_embedding.weight" in decayed and "position_embedding.weight" in decayed
    assert all(n.endswith("bias") or "ln_" in n for n in (names[id(p)] for p in no_decay["params"]))
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    rates = []
    for _ in range(6):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler["scheduler"].step()
    assert rates == pytest.approx([0.0025, 0.005, 0.0075, 0.01, 0.01, 0.01])
    assert isinstance(tiny_model(warmup_steps=0).configure_optimizers(), torch.optim.AdamW)


def test_training_step_returns_per_sequence_losses():
    model = tiny_model()
    x = torch.randint(0, 256, (3, 10), generator=torch.Generator().manual_seed(2))
    y = torch.randint(0, 256, (3, 10), generator=torch.Generator().manual_seed(3))
    out = model.training_step((x, y), 0)
    logits = model(x)
    by_hand = torch.stack([F.cross_entropy(logits[i], y[i]) for i in range(3)])
    assert torch.allclose(out["per_example_loss"], by_hand, atol=1e-6) and not out["per_example_loss"].requires_grad
    assert torch.allclose(out["loss"], F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1)), atol=1e-6)


def test_validation_loss_is_the_mean_over_characters_and_bpc_its_base_2_form():
    """Two batches of unequal shapes (2 x 8 and 3 x 4): the epoch's val_loss weighs each character once
    (Lightning's default weight, the batch's first dimension, would weigh 2 against 3)."""
    model = tiny_model()
    generator = torch.Generator().manual_seed(4)
    batches = [(torch.randint(0, 256, shape, generator=generator), torch.randint(0, 256, shape, generator=generator))
               for shape in ((2, 8), (3, 4))]
    with torch.no_grad():
        total = sum(float(F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1), reduction="sum")) for x, y in batches)
    loader = DataLoader(batches, batch_size=None)  # yields the batches as they are
    (metrics,) = trainer().validate(model, dataloaders=loader, verbose=False)
    assert metrics["val_loss"] == pytest.approx(total / (16 + 12), rel=1e-5)
    assert metrics["val_bpc"] == pytest.approx(metrics["val_loss"] / math.log(2), rel=1e-6)
    (tested,) = trainer().test(model, dataloaders=loader, verbose=False)
    assert tested["test_loss"] == pytest.approx(metrics["val_loss"], rel=1e-6)
    assert tested["test_bpc"] == pytest.approx(metrics["val_bpc"], rel=1e-6)


def test_loss_falls_on_a_tiny_corpus(tmp_path):
    """40 AdamW steps on a few short, repetitive files bring the held-out loss from ln(256) to well below it."""
    sentences = [b"def add(a, b):\n    return a + b\n", b"for item in items:\n    print(item)\n",
                 b"class Point:\n    x = 0\n    y = 0\n"]
    for index in range(4):
        (tmp_path / f"m{index}.py").write_bytes(b"".join(sentences[(index + k) % 3] for k in range(30)))
    L.seed_everything(0, verbose=False)
    datamodule = StdlibTextDataModule(block_size=16, batch_size=16, val_fraction=0.25, stdlib_dir=str(tmp_path))
    model = TransformerLM(block_size=16, n_layer=2, n_head=2, n_embd=32, learning_rate=3e-3, warmup_steps=5)
    (before,) = trainer().validate(model, datamodule=datamodule, verbose=False)
    assert before["val_loss"] == pytest.approx(math.log(256), abs=0.1)  # untrained: nearly uniform over bytes
    fit = trainer(max_steps=40, num_sanity_val_steps=0, limit_val_batches=0)
    fit.fit(model, datamodule=datamodule)
    assert fit.global_step == 40
    (after,) = trainer().validate(model, datamodule=datamodule, verbose=False)
    assert after["val_loss"] < 3.0 < before["val_loss"] - 2.0


@pytest.mark.parametrize(
    "kwargs, parameter",
    [
        (dict(vocab_size=0), "vocab_size"),
        (dict(block_size=0), "block_size"),
        (dict(n_layer=1.5), "n_layer"),
        (dict(n_head=0), "n_head"),
        (dict(n_embd=True), "n_embd"),
        (dict(n_embd=30, n_head=4), "divisible by n_head"),
        (dict(dropout=1.0), "dropout"),
        (dict(dropout=-0.1), "dropout"),
        (dict(learning_rate=0.0), "learning_rate"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(weight_decay=float("inf")), "weight_decay"),
        (dict(betas=(0.9, 1.0)), "betas"),
        (dict(betas=(0.9,)), "betas"),
        (dict(warmup_steps=-1), "warmup_steps"),
    ],
)
def test_bad_arguments_name_the_parameter(kwargs, parameter):
    with pytest.raises(ValueError, match=parameter):
        TransformerLM(**kwargs)
