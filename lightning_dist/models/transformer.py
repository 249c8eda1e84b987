"""A decoder-only (GPT-style) character-level language model, the workload of the language-model benchmark.

Bytes in, next-byte logits out: token and learned position embeddings, ``n_layer`` pre-norm blocks
(LayerNorm, causal multi-head self-attention through
:func:`torch.nn.functional.scaled_dot_product_attention`, residual; LayerNorm, a 4x-wide GELU MLP,
residual), a final LayerNorm and a head that shares its weight with the token embedding
(Radford et al. 2019, GPT-2; Karpathy's nanoGPT). It is sized by config:

========================  ==================================  ==========
config                    arguments                           parameters
========================  ==================================  ==========
default                   4 layers, n_embd 128, 4 heads       842,496
small (the LM configs)    4 layers, n_embd 160, 4 heads       1,298,880
large                     6 layers, n_embd 384, 6 heads       10,795,008
100m (large-model study)  15 layers, n_embd 768, 12 heads     106,614,528
========================  ==================================  ==========

(``vocab_size`` 256, ``block_size`` 128). :meth:`TransformerLM.preset` builds each by name
(``TransformerLM.preset("100m")``; in a LightningCLI YAML give the table's arguments). ``100m`` has GPT-2
small's width and heads with 15 layers instead of 12: with a byte vocabulary GPT-2 small's 12 layers hold
85M parameters (its 124M include a 38.6M-parameter embedding of 50,257 tokens), so three more layers take
it past 100M. In float32 it is 426 MB; its gradients and AdamW's two moments make 1.7 GB per replica
before activations (``benchmarks/large_model``). With ``V = vocab_size``, ``T = block_size``, ``C = n_embd``
and ``L = n_layer`` the count is ``V*C + T*C + L*(12*C**2 + 13*C) + 2*C``: the embeddings (the head
reuses the token embedding), per block two LayerNorms (``4C``), the query/key/value projection
(``3C**2 + 3C``), the attention output projection (``C**2 + C``) and the MLP (``8C**2 + 5C``), and the
final LayerNorm (``2C``). :attr:`TransformerLM.num_parameters` counts them on the built model.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_dist.algorithms.arguments import check_count, check_number


PRESETS: dict[str, dict[str, int]] = {
    "default": {"n_layer": 4, "n_head": 4, "n_embd": 128},
    "small": {"n_layer": 4, "n_head": 4, "n_embd": 160},
    "large": {"n_layer": 6, "n_head": 6, "n_embd": 384},
    "100m": {"n_layer": 15, "n_head": 12, "n_embd": 768},
}
"""The sizes of the module docstring's table, by name: :meth:`TransformerLM.preset`'s arguments."""


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position ``t`` attends to positions ``<= t`` only."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.residual_dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        batch, time, channels = x.shape
        # (B, T, 3C) -> three (B, heads, T, C / heads) tensors.
        q, k, v = self.qkv(x).view(batch, time, 3, self.n_head, channels // self.n_head).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        return self.residual_dropout(self.proj(attended.transpose(1, 2).reshape(batch, time, channels)))


class Block(nn.Module):
    """A pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_attention = nn.LayerNorm(n_embd)
        self.attention = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_mlp = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout)
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.ln_attention(x))
        return x + self.mlp(self.ln_mlp(x))


class TransformerLM(L.LightningModule):
    """Decoder-only byte-level language model; batches are ``(x, y)`` int64 tensors of shape ``(B, T)``, ``T <= block_size``.

    ``y`` is ``x`` shifted by one position (the next byte at every position), as
    :class:`~lightning_dist.data.StdlibTextDataModule` yields. ``training_step`` logs ``train_loss``
    every step and returns ``{"loss": ..., "per_example_loss": ...}`` (each sequence's mean loss, the
    form :class:`~lightning_dist.callbacks.DataGossip` needs). Validation and test log ``val_loss`` /
    ``test_loss`` in nats per character and ``val_bpc`` / ``test_bpc`` in bits per character, both
    means over every predicted character of the epoch on all ranks.

    The optimizer is AdamW with decoupled weight decay on the matrices only (parameters with 2 or more
    dimensions: linear weights and the embeddings), not on biases and LayerNorm gains, as nanoGPT
    does; ``warmup_steps > 0`` adds a linear learning-rate warmup over that many optimizer steps.
    Weights start as GPT-2's: normal with std 0.02, the two projections that end each residual branch
    scaled by ``1 / sqrt(2 * n_layer)`` so the residual stream's variance does not grow with depth.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        learning_rate: float = 1e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
    ) -> None:
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("block_size", block_size), ("n_layer", n_layer),
                            ("n_head", n_head), ("n_embd", n_embd)):
            check_count(name, value, 1)
        if n_embd % n_head != 0:
            raise ValueError(f"n_embd must be divisible by n_head (the heads split it); got n_embd={n_embd}, "
                             f"n_head={n_head}")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
            raise ValueError(f"dropout must be a number with 0 <= dropout < 1; got {dropout!r}")
        check_number("learning_rate", learning_rate, 0.0, strict=True)
        check_number("weight_decay", weight_decay, 0.0, strict=False)
        if (not isinstance(betas, (tuple, list)) or len(betas) != 2 or any(
                isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta < 1 for beta in betas)):
            raise ValueError(f"betas must be two numbers in [0, 1); got {betas!r}")
        check_count("warmup_steps", warmup_steps, 0)
        self.save_hyperparameters()

        self.token_embedding = nn.Embedding(vocab_size, n_embd)
        self.position_embedding = nn.Embedding(block_size, n_embd)
        self.embedding_dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_final = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.token_embedding.weight  # tied: one matrix reads bytes in and scores them out
        self._init_weights(n_layer)

    @classmethod
    def preset(cls, name: str, **kwargs: Any) -> TransformerLM:
        """The model of the module docstring's table named ``name`` (``"default"``, ``"small"``, ``"large"``,
        ``"100m"``; their arguments are ``PRESETS``); ``kwargs`` set the other arguments (``learning_rate``,
        ``block_size``, ...) or override the preset's.

        Built on the current default device: ``with torch.device("meta"): TransformerLM.preset("100m")`` counts the
        parameters of the 100M model without allocating them.
        """
        if name not in PRESETS:
            raise ValueError(f"unknown TransformerLM preset {name!r}; the presets are {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **kwargs})

    def _init_weights(self, n_layer: int) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in self.blocks:
            for projection in (block.attention.proj, block.mlp[2]):
                nn.init.normal_(projection.weight, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @property
    def num_parameters(self) -> int:
        """Number of trainable values; the tied head is counted once (``parameters()`` yields it once)."""
        return sum(parameter.numel() for parameter in self.parameters())

    def forward(self, x: Tensor) -> Tensor:
        """Next-byte logits of shape ``(B, T, vocab_size)`` for byte ids ``x`` of shape ``(B, T)``."""
        time = x.shape[1]
        if time > self.hparams.block_size:
            raise ValueError(f"sequence length must be <= block_size ({self.hparams.block_size}); got {time}")
        positions = torch.arange(time, device=x.device)
        h = self.embedding_dropout(self.token_embedding(x) + self.position_embedding(positions))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_final(h))

    def per_example_loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        """Each sequence's mean next-byte cross-entropy (nats per character), shape ``(B,)``."""
        x, y = batch
        logits = self(x)
        per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
        return per_token.view(y.shape).mean(dim=1)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> dict[str, Tensor]:
        """The mean loss as ``loss``, plus each sequence's loss as ``per_example_loss`` (for DataGossip).

        Every sequence of a batch has the same length, so the mean of the sequences' means is the
        per-character mean.
        """
        per_example = self.per_example_loss(batch)
        loss = per_example.mean()
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return {"loss": loss, "per_example_loss": per_example.detach()}

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def _evaluate(self, batch: tuple[Tensor, Tensor], stage: str) -> None:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        # batch_size = characters, so the epoch value (a batch_size-weighted mean, summed over ranks
        # with sync_dist) is the mean over every character evaluated, whatever the batch sizes.
        characters = y.numel()
        self.log(f"{stage}_loss", loss, sync_dist=True, batch_size=characters)
        self.log(f"{stage}_bpc", loss / math.log(2), sync_dist=True, batch_size=characters)

    def configure_optimizers(self) -> torch.optim.Optimizer | dict:
        hparams = self.hparams
        decay = [p for p in self.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hparams.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=hparams.learning_rate,
            betas=tuple(hparams.betas),
        )
        if hparams.warmup_steps == 0:
            return optimizer
        warmup = hparams.warmup_steps
        # Step s (0-based) runs at lr * (s + 1) / warmup until the full rate is reached.
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
