"""Probe: the manifest's encoding per save of the memory tier's loop state (section 17's 0.15 GB
GPT + AdamW), in full and through its layout's template (format/splice.py). Saves the state a
few times with its plan reused, keeps the manifests the saves encoded, then encodes the last
one --reps times each way, interleaved: the encoding thread's CPU per call, and the longest
stretch a second thread (appending the time in a loop, the switch interval at 0.5 ms) waited
between two of its iterations from a call's start to its first iteration after the call: the
longest hold of the GIL it saw (the machine's other load adds to it). Prints medians and minima, in ms.

    python dev/manifest_encode.py [--reps 40] [--gb 0.15]
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as `python dev/NAME.py` from the checkout: its benchmarks/ and ckptio/ first.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import gc
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--gb", type=float, default=0.15)
    args = p.parse_args()
    import ckptio
    import torch

    from benchmarks.train import build_training, checkpoint_state, train_step
    from ckptio.format import manifest, splice

    model, opt, cfg = build_training(args.gb, 0)
    train_step(model, opt, torch.randint(cfg.vocab, (2, 129)))  # the optimizer's state
    records: list[Any] = []
    real = manifest.encode

    def keeping(m: Any, templates: Any = None) -> bytes:
        records.append(m)
        return real(m, templates)
    manifest.encode = keeping  # type: ignore[assignment]
    ck = ckptio.Checkpointer()
    with tempfile.TemporaryDirectory() as work:
        for step in range(4):
            ck.save(checkpoint_state(model, opt, step, 2), f"{work}/s{step}")
    ck.close()
    manifest.encode = real  # type: ignore[assignment]
    m = records[-1]

    def full(m: Any) -> bytes:
        return splice.full_text(m).encode()

    templates = splice.Templates()  # a saver's: the layout seen, then its template made
    assert real(m, templates).split(b"\n")[1] == full(m)
    assert real(m, templates).split(b"\n")[1] == full(m)

    def spliced(m: Any) -> bytes:
        return real(m, templates)
    sys.setswitchinterval(0.0005)
    ticks: list[float] = []
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            ticks.append(time.perf_counter())

    probe = threading.Thread(target=spin, daemon=True)
    probe.start()
    runs: dict[str, tuple[list[float], list[float]]] = {"full": ([], []), "template": ([], [])}
    ways: dict[str, Callable[[Any], bytes]] = {"full": full, "template": spliced}
    gc.disable()
    for _ in range(args.reps):
        for name, way in ways.items():
            time.sleep(0.002)
            ticks.clear()
            start = time.perf_counter()
            c0 = time.thread_time()
            way(m)
            runs[name][0].append(time.thread_time() - c0)
            end = time.perf_counter()
            while not ticks or ticks[-1] < end:  # the probe's first tick after the call
                time.sleep(0.0001)
            seen = [start, *(t for t in ticks if t > start)]
            runs[name][1].append(max(b - a for a, b in zip(seen, seen[1:])))
    gc.enable()
    stop.set()
    probe.join()
    print(f"{len(m.tensors)} entries, {len(real(m))} bytes; ms, median (min) of {args.reps}")
    for name, (cpu, held) in runs.items():
        print(f"{name:9s} CPU {statistics.median(cpu) * 1e3:6.2f} ({min(cpu) * 1e3:5.2f})   "
              f"longest wait of the spinning thread {statistics.median(held) * 1e3:6.2f} "
              f"({min(held) * 1e3:5.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
