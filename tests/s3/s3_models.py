"""A small model, optimizer and scheduler, and a training step (for tests and their fresh
processes, which import this file by path)."""

from __future__ import annotations

import torch


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.GELU(), torch.nn.Linear(512, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    return model, opt, sched


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: object, steps: int) -> None:
    for _ in range(steps):
        loss = model(torch.randn(8, 64)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()  # type: ignore[attr-defined]
