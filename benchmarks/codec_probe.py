"""Codec probe (issue 28): ratio and single-core speed of candidate lossless codecs on the tensors
of a small GPT trained a few dozen steps (bf16 weights, fp32 master weights and Adam moments),
in independent 1 MiB frames as ckptio stores them. A probe, not a benchmark (docs/PROBES.md).

    flock -x /tmp/cpu.lock timeout 600 .venv/bin/python benchmarks/codec_probe.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import blosc2
import numpy as np
import torch
import zstandard

from ckptio.demo.model import Config, build

FRAME = 1 << 20
STEPS = 30


def tensors() -> dict[str, bytes]:
    cfg = Config(n_layer=4, n_head=4, d_model=256, block_size=64, batch_size=16,
                 corpus_bytes=200_000)
    parts = build(cfg, STEPS, seed=0)
    snaps: dict[int, list[torch.Tensor]] = {}
    for step in range(1, STEPS + 1):
        x, y = parts.loader.next_batch()
        loss = parts.model(x, y)
        loss.backward()
        parts.opt.step()
        parts.opt.zero_grad(set_to_none=True)
        parts.sched.step()
        if step in (STEPS - 10, STEPS - 1, STEPS):
            snaps[step] = [p.detach().to(torch.bfloat16).clone() for p in parts.model.parameters()]
    params = list(parts.model.parameters())
    state = [parts.opt.state[p] for p in params]

    def cat(ts: list[torch.Tensor]) -> bytes:
        return b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in ts)

    def xor(a: list[torch.Tensor], b: list[torch.Tensor]) -> bytes:
        return (np.frombuffer(cat(a), np.uint8) ^ np.frombuffer(cat(b), np.uint8)).tobytes()

    return {
        "bf16 weights": cat(snaps[STEPS]),
        "fp32 master": cat([p.detach() for p in params]),
        "fp32 exp_avg": cat([s["exp_avg"] for s in state]),
        "fp32 exp_avg_sq": cat([s["exp_avg_sq"] for s in state]),
        "bf16 xor k=1": xor(snaps[STEPS], snaps[STEPS - 1]),
        "bf16 xor k=10": xor(snaps[STEPS], snaps[STEPS - 10]),
    }


def planes(frame: bytes, itemsize: int) -> bytes:
    return np.frombuffer(frame, np.uint8).reshape(-1, itemsize).T.tobytes()


def zstd(level: int, group: int) -> tuple[Callable[[bytes], bytes], Callable[[bytes], bytes]]:
    c = zstandard.ZstdCompressor(level=level)
    d = zstandard.ZstdDecompressor()
    if group == 1:
        return c.compress, d.decompress

    def enc(frame: bytes) -> bytes:
        return c.compress(planes(frame, group))

    def dec(data: bytes) -> bytes:
        raw = d.decompress(data)
        return np.frombuffer(raw, np.uint8).reshape(group, -1).T.tobytes()
    return enc, dec


def blosc(codec: blosc2.Codec, level: int, filt: list[blosc2.Filter], typesize: int
          ) -> tuple[Callable[[bytes], bytes], Callable[[bytes], bytes]]:
    def enc(frame: bytes) -> bytes:
        return blosc2.compress2(frame, codec=codec, clevel=level, filters=filt,
                                typesize=typesize, nthreads=1)

    def dec(data: bytes) -> bytes:
        return blosc2.decompress2(data, nthreads=1)
    return enc, dec


def measure(data: bytes, enc: Callable[[bytes], bytes], dec: Callable[[bytes], bytes]
            ) -> tuple[float, float, float]:
    frames = [data[i:i + FRAME] for i in range(0, len(data), FRAME)]
    best_c = best_d = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        out = [enc(f) for f in frames]
        best_c = min(best_c, time.perf_counter() - t0)
        t0 = time.perf_counter()
        back = [dec(o) for o in out]
        best_d = min(best_d, time.perf_counter() - t0)
    assert b"".join(back) == data
    stored = sum(len(o) for o in out)
    return len(data) / stored, len(data) / best_c / 1e9, len(data) / best_d / 1e9


def main() -> None:
    blosc2.set_nthreads(1)
    data = tensors()
    for name, raw in data.items():
        size = 2 if name.startswith("bf16") else 4
        cands = {f"zstd-{lv}": zstd(lv, 1) for lv in (1, 3)}
        cands.update({f"bytegroup{size}+zstd-{lv}": zstd(lv, size) for lv in (1, 3)})
        cands["blosc2 zstd-1 shuffle"] = blosc(blosc2.Codec.ZSTD, 1, [blosc2.Filter.SHUFFLE], size)
        cands["blosc2 zstd-1 shuffle+bytedelta"] = blosc(
            blosc2.Codec.ZSTD, 1, [blosc2.Filter.SHUFFLE, blosc2.Filter.BYTEDELTA], size)
        cands["blosc2 lz4-5 shuffle"] = blosc(blosc2.Codec.LZ4, 5, [blosc2.Filter.SHUFFLE], size)
        cands["blosc2 zstd-1 bitshuffle"] = blosc(blosc2.Codec.ZSTD, 1, [blosc2.Filter.BITSHUFFLE], size)
        print(f"\n{name}: {len(raw) / 1e6:.1f} MB")
        print("| codec | ratio | compress GB/s/core | decompress GB/s/core |")
        print("|---|---|---|---|")
        for cname, (enc, dec) in cands.items():
            r, c, d = measure(raw, enc, dec)
            print(f"| {cname} | {r:.3f} | {c:.2f} | {d:.2f} |")


if __name__ == "__main__":
    main()
