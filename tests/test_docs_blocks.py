"""The code blocks a reader copies: README.md's and docs/getting-started.md's Python blocks run
as written (the README's with its placeholders bound to a small real model, optimizer,
scheduler and training step, on CUDA too where there is one); every Python block under docs/
compiles, and those marked ``<!-- not run: why -->`` are counted (the others run in
tests/test_docs_guides.py).

Written by hand rather than with a doctest plugin (pytest-markdown-docs, phmdoctest): the
README's block is a fragment whose names (``model``, ``train_step``) must be bound to real
objects first and then run twice (a first run and a resume); the plugins run a block as it
stands. The count of blocks not run is pinned, so a page that gains one says so.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from docs_blocks import marked_blocks

ROOT = Path(__file__).resolve().parent.parent


def blocks(page: Path) -> list[str]:
    return [code for code, _ in marked_blocks(page)]


def _bound(total_steps: int, device: str = "cpu") -> dict[str, Any]:
    """The README's placeholders: a small real model, optimizer, scheduler and step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=50)

    def train_step(step: int) -> float:
        x = torch.randn(8, 4, device=device)
        loss = (model(x) - 1).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        return loss.item()

    return {"model": model, "opt": opt, "sched": sched, "train_step": train_step,
            "total_steps": total_steps}


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_readme_quick_start_runs_and_resumes(tmp_path: Path, monkeypatch: Any,
                                             device: str) -> None:
    (code,) = [b for b in blocks(ROOT / "README.md") if "CheckpointManager" in b]
    monkeypatch.chdir(tmp_path)
    first = _bound(200, device)
    exec(compile(code, "README.md", "exec"), first)  # noqa: S102 - the README's own block
    assert first["start"] == 0 and sorted(p.name for p in (tmp_path / "ckpts").iterdir()
                                          if p.name.startswith("step-")) == ["step-100",
                                                                             "step-200"]
    again = _bound(200, device)  # fresh objects, the same block: it restores step 200
    exec(compile(code, "README.md", "exec"), again)  # noqa: S102
    assert again["start"] == 200
    assert torch.equal(again["model"].weight, first["model"].weight)
    assert again["opt"].state_dict()["state"][0]["step"] == 200


def test_getting_started_runs_as_written(tmp_path: Path, monkeypatch: Any, capsys: Any) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {}
    for code in blocks(ROOT / "docs" / "getting-started.md"):
        exec(compile(code, "getting-started.md", "exec"), namespace)  # noqa: S102
    assert "every loss after it bitwise equal" in capsys.readouterr().out
    assert min(namespace["second"]) == 9


RUN = {ROOT / "README.md", ROOT / "docs" / "getting-started.md"}
PAGES = sorted(p for p in (ROOT / "docs").rglob("*.md") if p not in RUN)
# Marked <!-- not run: why --> in their pages: 12 probes that measure (docs/PROBES.md,
# docs/results/s3), torchtitan's hook and its config registry (torchtitan is not in the test
# extra; its Trainer needs triton), a dp x tp CUDA mesh, an NCCL job across hosts, Megatron-Core's
# strategies (Python >= 3.12; tests/test_megatron.py), DeepSpeed ranks (examples/deepspeed_zero.py
# runs the same), real GCS (docs/guides/gcs.md: a Google project and credentials; its emulator
# block runs), the recovery without a relaunch (docs/guides/redundancy.md: needs a lost rank and a
# spare; tests/test_inprocess_recovery.py runs it). Every other block runs:
# tests/test_docs_guides.py.
NOT_RUN_COUNT = 20


def test_every_block_compiles_and_those_not_run_are_counted() -> None:
    """Every Python block under docs/ is Python; those not run here are marked and counted."""
    broken, not_run = [], 0
    for page in PAGES:
        for number, (code, why) in enumerate(marked_blocks(page), start=1):
            not_run += why is not None
            try:
                ast.parse(code)
            except SyntaxError as exc:
                broken.append(f"{page.relative_to(ROOT)}, Python block {number}: {exc}")
    assert not broken, "\n".join(broken)
    assert not_run == NOT_RUN_COUNT, f"{not_run} blocks not run (update NOT_RUN_COUNT, say why)"


def test_the_readme_fits_and_its_links_resolve() -> None:
    """Two screens, the quick start near the top, and every relative link names a file."""
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail into docs/"
    assert any(line.startswith("## Quick start") for line in lines[:40])
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert links, "README.md links to nothing"
    broken = [link for link in links if "://" not in link and not (ROOT / link).exists()]
    assert not broken, f"README.md links to missing files: {broken}"


def test_the_sites_home_page_has_the_install_and_the_quick_start() -> None:
    """docs/index.md (the site's home) shows the install line and the README's quick start,
    the same block, so the README's test above runs it."""
    index = (ROOT / "docs" / "index.md").read_text()
    assert ".venv/bin/pip install -q torch==2.13.0 -e ." in index
    (readme_quick,) = [b for b in blocks(ROOT / "README.md") if "CheckpointManager" in b]
    assert readme_quick in blocks(ROOT / "docs" / "index.md")
