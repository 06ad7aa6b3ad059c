"""The benchmark state, its empty twin for in-place loads, and the digest for the bitwise check.

Owns: the GPT-like model + one-step AdamW state sized to a byte target (12 bytes per parameter:
fp32 weights, exp_avg, exp_avg_sq), the all-large-tensor state of the same byte count, the
empty destination with identical structure, shapes and dtypes, the byte count S, and digest().
Does not own: saving or loading (engines.py) or timing (save_load.py).

Sizes are decimal: 1 GB = 1e9 bytes, as in the GB/s figures. Everything is deterministic by seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import xxhash
from torch import nn

__all__ = ["Filler", "GB", "GPT", "GPTConfig", "LARGE_TENSORS", "build_large_state", "build_model",
           "build_state", "digest", "empty_destination", "gpt_config", "prefault", "rng_nbytes", "state_nbytes",
           "tensor_leaves", "tensor_nbytes"]

GB = 1e9
VOCAB = 32768
CONTEXT = 1024
MIN_LAYERS = 8
WIDTHS = (128, 256, 512, 768, 1024, 1536, 2048, 2560, 3072, 4096)
TENSORS_PER_BLOCK = 12
LARGE_TENSORS = 4
INIT_SCALE = 0.02
FILL_BLOCK = 1 << 20  # floats per distinct fill block (4 MiB)


@dataclass(frozen=True)
class GPTConfig:
    d_model: int
    n_layers: int
    vocab: int
    context: int = CONTEXT

    @property
    def n_params(self) -> int:
        """Unique parameters (the lm_head is tied to the token embedding)."""
        d = self.d_model
        per_block = 12 * d * d + 13 * d
        return (self.vocab + self.context) * d + self.n_layers * per_block + 2 * d

    @property
    def n_param_tensors(self) -> int:
        return 2 + self.n_layers * TENSORS_PER_BLOCK + 2


def gpt_config(gb: float) -> GPTConfig:
    """Widest model with at least MIN_LAYERS blocks; the vocabulary absorbs the remainder."""
    target = max(1, int(gb * GB / 12))
    d, layers = WIDTHS[0], 1
    for width in WIDTHS:
        fit = _layers_that_fit(target, width)
        if fit < MIN_LAYERS:
            break
        d, layers = width, fit
    if layers < MIN_LAYERS:
        layers = max(1, _layers_that_fit(target, d))
    rest = target - CONTEXT * d - layers * (12 * d * d + 13 * d) - 2 * d
    return GPTConfig(d_model=d, n_layers=layers, vocab=max(256, rest // d))


def _layers_that_fit(target: int, d: int) -> int:
    return (target - (VOCAB + CONTEXT) * d - 2 * d) // (12 * d * d + 13 * d)


def rng_nbytes() -> int:
    return torch.get_rng_state().numel()


def state_nbytes(cfg: GPTConfig) -> int:
    """S for the GPT state, without building it: params x3, one fp32 step per param, CPU RNG."""
    return 12 * cfg.n_params + 4 * cfg.n_param_tensors + rng_nbytes()


class Block(nn.Module):
    def __init__(self, d: int, device: torch.device) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d, device=device)
        self.qkv = nn.Linear(d, 3 * d, device=device)
        self.proj = nn.Linear(d, d, device=device)
        self.ln2 = nn.LayerNorm(d, device=device)
        self.fc = nn.Linear(d, 4 * d, device=device)
        self.fc_out = nn.Linear(4 * d, d, device=device)


class GPT(nn.Module):
    """Structure only: no forward pass is needed to produce a realistic state dict."""

    def __init__(self, cfg: GPTConfig, device: torch.device) -> None:
        super().__init__()
        self.tok_emb = _embedding(cfg.vocab, cfg.d_model, device)
        self.pos_emb = _embedding(cfg.context, cfg.d_model, device)
        self.blocks = nn.ModuleList(Block(cfg.d_model, device) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model, device=device)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False, device=device)
        self.lm_head.weight = self.tok_emb.weight


class Filler:
    """Cheap deterministic fill: one seeded random block, shifted by a running counter, so every
    block written is distinct (a misplaced byte range changes the digest) at memory speed."""

    def __init__(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.base = torch.empty(FILL_BLOCK).uniform_(-1.0, 1.0, generator=gen)
        self.count = 0

    @torch.no_grad()
    def fill(self, t: torch.Tensor, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        flat = t.view(-1)
        for start in range(0, flat.numel(), FILL_BLOCK):
            n = min(FILL_BLOCK, flat.numel() - start)
            self.count += 1
            block = flat[start : start + n]
            torch.mul(self.base[:n], scale, out=block)
            block.add_(shift + scale * (self.count % 1024) / 1024)
        return t


def _embedding(rows: int, dim: int, device: torch.device) -> nn.Embedding:
    """Skip Embedding's normal_ init: on the meta device it imports torch._dynamo (slow:
    docs/PROBES.md, "Figures moved out of the code")."""
    return nn.Embedding(rows, dim, _weight=torch.empty(rows, dim, device=device))


def build_model(cfg: GPTConfig, fill: Filler) -> GPT:
    """Allocate without the default (slow) init, then fill cheaply and deterministically (the
    head tied to the embedding). Public for benchmarks/train.py, which trains this model."""
    model = GPT(cfg, torch.device("meta"))
    model.to_empty(device="cpu")
    model.lm_head.weight = model.tok_emb.weight  # to_empty unties
    for name, p in model.named_parameters():
        is_norm_weight = (".ln" in name or name.startswith("ln_f")) and name.endswith("weight")
        fill.fill(p, INIT_SCALE, 1.0 if is_norm_weight else 0.0)
    return model


def _adamw_step(model: nn.Module, fill: Filler) -> torch.optim.Optimizer:
    """One fused AdamW step (the for-loop implementation is several times slower:
    docs/PROBES.md, "Figures moved out of the code")."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    for p in model.parameters():
        p.grad = fill.fill(torch.empty_like(p))
    opt.step()
    opt.zero_grad(set_to_none=True)
    return opt


def build_state(gb: float, seed: int = 0) -> dict[str, Any]:
    """The realistic mix: GPT weights, AdamW state after one step, RNG, step, loader position."""
    torch.manual_seed(seed)
    fill = Filler(seed)
    cfg = gpt_config(gb)
    model = build_model(cfg, fill)
    opt = _adamw_step(model, fill)
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "step": 1,
        "rng": torch.get_rng_state(),
        "loader": {"epoch": 0, "index": 12345, "seed": 7},
    }


def build_large_state(nbytes: int, seed: int = 0, count: int = LARGE_TENSORS) -> dict[str, Any]:
    """``count`` big fp32 tensors holding ``nbytes`` in all (rounded down to whole floats)."""
    fill = Filler(seed)
    numel = nbytes // 4
    sizes = [numel // count] * count
    sizes[-1] += numel - sum(sizes)
    return {f"large{i}": fill.fill(torch.empty(n)) for i, n in enumerate(sizes)}


def tensor_nbytes(state: Any) -> int:
    """S: bytes of every tensor, storage shared between keys (tied weights) counted once."""
    seen: dict[tuple[int, int, tuple[int, ...]], int] = {}
    for _, t in tensor_leaves(state):
        seen[(t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape))] = (
            t.numel() * t.element_size()
        )
    return sum(seen.values())


def tensor_leaves(state: Any) -> list[tuple[str, torch.Tensor]]:
    """(dotted key, tensor) for every tensor leaf, tied keys included."""
    return [(k, v) for k, v in iter_leaves(state) if isinstance(v, torch.Tensor)]


def iter_leaves(value: Any, key: str = "") -> list[tuple[str, Any]]:
    """(dotted key, leaf) for every leaf, dict keys visited in sorted order of their repr."""
    if isinstance(value, dict):
        out: list[tuple[str, Any]] = []
        for k in sorted(value, key=repr):
            out.extend(iter_leaves(value[k], f"{key}.{k!r}"))
        return out
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        out = []
        for i, item in enumerate(value):
            out.extend(iter_leaves(item, f"{key}[{i}]"))
        return out
    return [(key, value)]


def digest(state: Any) -> str:
    """xxh3_64 over every leaf in sorted-key order: key, dtype, shape and raw bytes of tensors,
    repr of everything else. Equal digests mean bitwise-equal states."""
    h = xxhash.xxh3_64()
    for key, leaf in iter_leaves(state):
        h.update(key.encode())
        if isinstance(leaf, torch.Tensor):
            h.update(f"{leaf.dtype}{tuple(leaf.shape)}".encode())
            h.update(_raw_bytes(leaf))
        else:
            h.update(f"{type(leaf).__name__}={leaf!r}".encode())
    return h.hexdigest()


def _raw_bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data


def empty_destination(state: Any, poison: bool = True) -> Any:
    """Same nesting, shapes, dtypes and strides; tensors from torch.empty (no init cost).

    Tensors that alias exactly in ``state`` (tied weights) alias in the result too. With
    ``poison``, scalar leaves held by a dict or list get a different value of the same type, so
    the bitwise check also proves the engine restored them; leaves inside tuples (AdamW betas)
    are copied, as a freshly built optimizer would already hold them.
    """
    return _empty(state, {}, poison)


def _empty(value: Any, aliases: dict[tuple[Any, ...], torch.Tensor], poison: bool) -> Any:
    if isinstance(value, torch.Tensor):
        storage = value.untyped_storage().data_ptr()
        ident = (storage, value.storage_offset(), value.shape, value.stride())
        if ident not in aliases:
            aliases[ident] = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype)
        return aliases[ident]
    if isinstance(value, dict):
        out = type(value)() if _default_constructible(value) else {}
        for k, v in value.items():
            out[k] = _empty_child(v, aliases, poison)
        return out
    if isinstance(value, list):
        return [_empty_child(v, aliases, poison) for v in value]
    if isinstance(value, tuple) and not isinstance(value, torch.Size):
        return tuple(_empty(v, aliases, False) for v in value)
    return value


def _empty_child(value: Any, aliases: dict[tuple[Any, ...], torch.Tensor], poison: bool) -> Any:
    if poison and not isinstance(value, (torch.Tensor, dict, list, tuple)):
        return poisoned(value)
    return _empty(value, aliases, poison)


def _default_constructible(value: dict[Any, Any]) -> bool:
    try:
        type(value)()
    except TypeError:
        return False
    return True


def poisoned(value: Any) -> Any:
    """A value of the same type that differs from ``value`` (None stays None)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value + 1.0 if math.isfinite(value) and value + 1.0 != value else 0.5
    if isinstance(value, str):
        return value + "?"
    return value


def prefault(state: Any) -> None:
    """Touch every page of every tensor (zeros), as an initialised model would have."""
    for _, t in tensor_leaves(state):
        t.zero_()
