"""Compressed and delta checkpoints on the object store (issue 28), against a real SeaweedFS
server: "auto" compresses what shrinks (an object store is slow), a delta references and XORs
against its sibling step under the same prefix, whole and partial loads are bit-exact."""

from __future__ import annotations

import json

import torch

import ckptio
from ckptio.storage.select import store_for
from special_values import bits_equal, specials

OPTIONS = ckptio.Options(buffer_bytes=5 << 20, pool_bytes=20 << 20, compression="auto")
MiB = 1 << 20


def rows(url: str) -> tuple[int, dict[str, dict]]:
    head, body = store_for(url, OPTIONS).read_manifest().split(b"\n")[:2]
    return json.loads(head)["version"], {t["key"]: t for t in json.loads(body)["tensors"]}


def test_auto_compression_and_deltas_on_s3(s3_env):
    g = torch.Generator().manual_seed(0)
    weights = torch.randn(1024, 1536, generator=g).to(torch.bfloat16)  # 3 MiB: 3 frames
    state = {"w": weights, "noise": specials(torch.float32, (300_000,), 2),
             "frozen": torch.randn(700, 700, generator=g)}
    ck = ckptio.Checkpointer(OPTIONS)
    ck.save(state, f"{s3_env}/run/step-1")
    version, base = rows(f"{s3_env}/run/step-1")
    assert version == 4 and base["w"]["stored"]["codec"] == "bytegroup2+zstd"
    assert base["w"]["stored"]["nbytes"] < 0.8 * base["w"]["nbytes"]
    assert "stored" not in base["noise"]  # random bits: the sample does not pay
    new = dict(state, w=(weights.float() + 1e-3).to(torch.bfloat16))
    ck.save(new, f"{s3_env}/run/step-2", base=f"{s3_env}/run/step-1")
    _version, delta = rows(f"{s3_env}/run/step-2")
    assert delta["frozen"]["ref"] == {"checkpoint": "step-1"}
    assert delta["noise"]["ref"] == {"checkpoint": "step-1"}
    assert "xor" in delta["w"] or "stored" in delta["w"]
    out = ck.load(f"{s3_env}/run/step-2")
    assert all(bits_equal(out[k], v) for k, v in new.items())
    band = ckptio.TensorShard(torch.zeros(100, 1536, dtype=torch.bfloat16), (1024, 1536), (600, 0))
    ck.load(f"{s3_env}/run/step-2", {"w": band}, strict=False)
    assert bits_equal(band.local, new["w"][600:700])
    ck.verify(f"{s3_env}/run/step-2")
