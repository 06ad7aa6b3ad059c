"""The demo's training job: a small GPT, the text it learns, its data loader and its optimizer.

Owns: the model (token + position embeddings, pre-LayerNorm transformer blocks with causal
self-attention, dropout, a head tied to the token embedding), the byte-level text (Python's own
documentation, ``pydoc_data.topics``, or the standard library's source where that is missing),
``TextLoader`` (shuffled windows per epoch; ``state_dict()`` holds its position and the state of
its own torch.Generator), AdamW with weight decay on matrices only, and a warmup + cosine
learning-rate schedule. ``build()`` makes all of them from a seed, the same on every call.
Does not own: the training loop, checkpoints or ranks (train.py).
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["PRESETS", "build", "n_params"]

VOCAB = 256  # bytes


@dataclass(frozen=True)
class Config:
    n_layer: int
    n_head: int
    d_model: int
    block_size: int  # tokens per sequence
    batch_size: int  # sequences per step and rank
    dropout: float = 0.1
    lr: float = 3e-3
    warmup: int = 10  # steps
    weight_decay: float = 0.1
    corpus_bytes: int | None = None  # use only the text's first bytes (None: all of it)


PRESETS = {
    # ~0.8 M parameters, 1024 tokens per step: a few steps per second on 2 cores
    "default": Config(n_layer=4, n_head=4, d_model=128, block_size=64, batch_size=16),
    # ~60 K parameters: a step takes milliseconds (CI, tests); a small text so epochs roll over
    "quick": Config(n_layer=2, n_head=2, d_model=48, block_size=32, batch_size=8, warmup=4,
                    corpus_bytes=40_000),
    # quick's model on 1.4 KB of text: an epoch is 5 steps (2 on 2 ranks), so a short test
    # restores a loader several epochs in (its generator's state matters), mid-epoch
    "tiny": Config(n_layer=2, n_head=2, d_model=48, block_size=32, batch_size=8, warmup=4,
                   corpus_bytes=1_400),
}


# ------------------------------------------------------------------------------------ the model


class CausalSelfAttention(nn.Module):
    mask: torch.Tensor  # a buffer (register_buffer below)

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)
        mask = torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool).tril()
        self.register_buffer("mask", mask, persistent=False)  # derived: not checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.n_head)
        att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(dim=-1)
        y = (self.attn_drop(att) @ v).transpose(1, 2).reshape(b, t, d)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(),
                                 nn.Linear(4 * cfg.d_model, cfg.d_model), nn.Dropout(cfg.dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Next-byte prediction; ``forward(idx, targets)`` -> the mean cross-entropy loss."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, VOCAB, bias=False)
        self.head.weight = self.tok_emb.weight  # tied: saved once, restored as one tensor
        self.apply(_init)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1])
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))


def _init(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------------ the text


def corpus(limit: int | None = None) -> tuple[torch.Tensor, str]:
    """The training text as bytes (a uint8 tensor) and where it came from."""
    text, source = _pydoc_topics()
    if not text:
        text, source = _stdlib_sources(), "the standard library's source files"
    data = text.encode("utf-8")[:limit]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8), source


def _pydoc_topics() -> tuple[str, str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip it; the sources below always exist
        return "", ""
    return "\n".join(topics[k] for k in sorted(topics)), "Python's documentation (pydoc_data.topics)"


def _stdlib_sources(limit: int = 1 << 20) -> str:
    root = os.path.dirname(os.__file__)
    parts: list[str] = []
    for name in sorted(os.listdir(root)):
        if name.endswith(".py") and sum(map(len, parts)) < limit:
            with open(os.path.join(root, name), encoding="utf-8", errors="replace") as f:
                parts.append(f.read())
    return "\n".join(parts)


# ------------------------------------------------------------------------------------ the loader


class TextLoader:
    """Batches of (input, target) byte windows. Each epoch visits every window once, in an order
    drawn from the loader's own generator; with ``world`` ranks, each step's windows are split
    between them (rank r takes its own ``batch_size``). Resumable: ``state_dict()`` holds the
    epoch, the batch index in it and the generator's state at the start of the epoch (the order
    is drawn again from it on load)."""

    def __init__(self, data: torch.Tensor, cfg: Config, seed: int, rank: int = 0,
                 world: int = 1) -> None:
        self.data, self.batch, self.block = data.long(), cfg.batch_size, cfg.block_size
        self.rank, self.world = rank, world
        self.n_windows = (len(data) - 1) // self.block
        self.steps_per_epoch = self.n_windows // (self.batch * world)
        if self.steps_per_epoch < 1:
            raise ValueError(f"the text ({len(data)} bytes) is too short for one step of "
                             f"{world} x {self.batch} windows of {self.block + 1} bytes")
        self.generator = torch.Generator().manual_seed(seed)
        self.epoch, self.index = 0, 0
        self._new_order()

    def _new_order(self) -> None:
        self._epoch_state = self.generator.get_state()
        self._order = torch.randperm(self.n_windows, generator=self.generator)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.index == self.steps_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
            self._new_order()
        first = (self.index * self.world + self.rank) * self.batch
        starts = self._order[first:first + self.batch] * self.block
        windows = self.data[starts[:, None] + torch.arange(self.block + 1)]
        self.index += 1
        return windows[:, :-1], windows[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index, "generator": self._epoch_state.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self.generator.set_state(state["generator"])
        self._new_order()


# ------------------------------------------------------------------------------------ optimizer


class WarmupCosine:
    """LR factor: linear warmup, then cosine decay to 10% at ``total`` steps. A class, not a
    closure: LambdaLR saves a callable object's attributes in its state_dict."""

    def __init__(self, warmup: int, total: int) -> None:
        self.warmup, self.total = warmup, total

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        done = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * done))


def adamw(model: nn.Module, cfg: Config) -> torch.optim.AdamW:
    """AdamW, weight decay on matrices only (not on biases and LayerNorm gains)."""
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))


@dataclass
class Parts:
    model: GPT
    opt: torch.optim.AdamW
    sched: torch.optim.lr_scheduler.LambdaLR
    loader: TextLoader
    source: str  # where the text came from


def build(cfg: Config, total_steps: int, seed: int, rank: int = 0, world: int = 1) -> Parts:
    """Everything a run trains, freshly made: the same on every call with the same arguments.
    The model is initialised from ``seed`` (the same on every rank); then the global generators
    are seeded per rank (dropout differs between ranks); the loader has its own generator."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    opt = adamw(model, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, WarmupCosine(cfg.warmup, total_steps))
    data, source = corpus(cfg.corpus_bytes)
    loader = TextLoader(data, cfg, seed + 1, rank, world)
    torch.manual_seed(seed + 1000 * (rank + 1))
    random.seed(seed + rank)
    return Parts(model, opt, sched, loader, source)
