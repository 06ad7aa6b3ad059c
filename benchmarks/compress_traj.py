"""Real training trajectories for the compression study and benchmark (issue 28).

Owns: training the demo's GPT (ckptio/demo/model.py: byte-level, on Python's documentation) in
mixed precision as large-model training keeps its state (bf16 weights that the forward and
backward run on, fp32 master weights that AdamW updates, fp32 ``exp_avg`` and ``exp_avg_sq``),
a LoRA-style run over a frozen base (the trained GPT, frozen in bf16, with rank-r adapters on
every attention ``qkv`` projection: only the adapters have master weights and moments), snapshots
of that state at chosen steps, and the tensor class of a state's key. Does not own: codecs and
their measurement (compress_study.py), checkpoint engines (compress_engines.py).

A snapshot is ``{"weights": {name: bf16}, "master": {name: fp32}, "exp_avg": {...},
"exp_avg_sq": {...}}`` (clones, detached from training).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from dataclasses import replace

import torch
from torch import nn

from ckptio.demo import model as demo

__all__ = ["CLASSES", "PRESETS", "tensor_class", "trajectory"]

CLASSES = ("weights", "master", "exp_avg", "exp_avg_sq")  # bf16, fp32, fp32, fp32
Snapshot = dict[str, dict[str, torch.Tensor]]

PRESETS = {
    # ~3.2 M parameters (45 MB of state); a step takes a fraction of a second on 2 cores
    "study": replace(demo.PRESETS["default"], d_model=256, batch_size=8, warmup=10),
    # the demo's quick model: tests
    "tiny": demo.PRESETS["quick"],
}


def tensor_class(key: str) -> str:
    """The class of a state key (``"master/blocks.0.qkv.weight"`` -> ``"master"``)."""
    head = key.split("/", 1)[0].split(".", 1)[0]
    if head not in CLASSES:
        raise ValueError(f"{key!r} is not a key of a trajectory snapshot")
    return head


class LoRALinear(nn.Module):
    """``base(x) + (x A^T) B^T * alpha / r``: base frozen, B zero at start (LoRA's init)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float = 8.0) -> None:
        super().__init__()
        self.base = base
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) / math.sqrt(rank))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t() @ self.lora_b.t()) * self.scale


class MixedPrecision:
    """A bf16 model for forward/backward, fp32 master copies of its trainable parameters, AdamW
    on the masters; after each step the bf16 weights are the masters rounded to bf16."""

    def __init__(self, model: nn.Module, cfg: demo.Config, total: int) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.master = [p.detach().float().clone().requires_grad_(True) for _, p in named]
        self.model = model.to(torch.bfloat16)  # the same Parameter objects, now bf16
        self.low = [p for _, p in named]
        groups = [{"params": [m for m in self.master if m.dim() >= 2],
                   "weight_decay": cfg.weight_decay},
                  {"params": [m for m in self.master if m.dim() < 2], "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr,
                                     betas=(0.9, 0.95))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt,
                                                       demo.WarmupCosine(cfg.warmup, total))

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        loss = self.model(x, y)
        loss.backward()
        for lo, hi in zip(self.low, self.master):
            hi.grad = lo.grad.float()
            lo.grad = None
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for lo, hi in zip(self.low, self.master):
                lo.copy_(hi)
        return float(loss.detach())

    def snapshot(self) -> Snapshot:
        weights = {n: t.detach().clone() for n, t in self.model.state_dict().items()}
        snap: Snapshot = {"weights": weights, "master": {}, "exp_avg": {}, "exp_avg_sq": {}}
        for name, m in zip(self.names, self.master):
            state = self.opt.state.get(m, {})
            snap["master"][name] = m.detach().clone()
            for moment in ("exp_avg", "exp_avg_sq"):
                if moment in state:
                    snap[moment][name] = state[moment].detach().clone()
        return snap


def _lora(model: demo.GPT, rank: int) -> demo.GPT:
    """``model`` (trained) frozen, with adapters on every attention qkv projection."""
    model = copy.deepcopy(model).float()
    model.requires_grad_(False)
    for block in model.blocks:
        block.attn.qkv = LoRALinear(block.attn.qkv, rank)
    return model


def trajectory(kind: str, steps: Iterable[int], preset: str = "study", seed: int = 0,
               lora_rank: int = 4, base_steps: int = 100,
               lr: float | None = None) -> tuple[dict[int, Snapshot], dict]:
    """Train and return ``{step: snapshot}`` after each of ``steps`` (1-based step counts) and a
    description (parameters, losses). ``kind`` is ``"full"`` (the GPT from scratch) or
    ``"lora"`` (the GPT first trained ``base_steps`` steps in full, then frozen, then adapters
    trained; steps count the adapters' steps). ``lr``: the peak learning rate (default the
    preset's, 3e-3)."""
    cfg = PRESETS[preset] if lr is None else replace(PRESETS[preset], lr=lr)
    wanted = sorted(set(steps))
    total = wanted[-1]
    parts = demo.build(cfg, total, seed)
    model: nn.Module = parts.model
    info: dict = {"kind": kind, "preset": preset, "seed": seed, "lr": cfg.lr,
                  "text": parts.source}
    if kind == "lora":
        pre = MixedPrecision(model, cfg, base_steps)
        for _ in range(base_steps):
            pre.step(*parts.loader.next_batch())
        model = _lora(pre.model, lora_rank)
        info.update(base_steps=base_steps, lora_rank=lora_rank)
    elif kind != "full":
        raise ValueError(f"kind must be 'full' or 'lora', not {kind!r}")
    mp = MixedPrecision(model, cfg, total)
    info["params"] = sum(p.numel() for p in model.parameters())
    info["trainable"] = sum(p.numel() for p in mp.low)
    snaps: dict[int, Snapshot] = {}
    losses = []
    for step in range(1, total + 1):
        losses.append(mp.step(*parts.loader.next_batch()))
        if step in wanted:
            snaps[step] = mp.snapshot()
    info["loss_first"], info["loss_last"] = round(losses[0], 3), round(losses[-1], 3)
    return snaps, info
