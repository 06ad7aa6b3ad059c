"""A DCP checkpoint stored under an s3:// prefix is read by ckptio.load and ckptio.verify through
the S3 store (a real SeaweedFS server): the same code path as a local DCP directory."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

import ckptio
from ckptio.storage.s3.s3path import S3Path


def test_a_dcp_checkpoint_on_s3_loads_and_verifies(s3_env: str, s3_client: object,
                                                   tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 33)
    opt = torch.optim.AdamW(model.parameters(), betas=(0.8, 0.9))
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 1},
                 checkpoint_id=str(tmp_path / "dcp"))
    where = S3Path.parse(f"{s3_env}/dcp")
    for file in (tmp_path / "dcp").iterdir():
        s3_client.put_object(Bucket=where.bucket, Key=f"{where.key}/{file.name}",  # type: ignore[attr-defined]
                             Body=file.read_bytes())
    url = f"{s3_env}/dcp"
    fresh = torch.nn.Linear(64, 33)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    state = {"model": fresh, "optim": fresh_opt, "step": 0}
    ckptio.load(url, state)
    assert state["step"] == 1
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    assert fresh_opt.param_groups[0]["betas"] == (0.8, 0.9)
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(opt.state[p]["exp_avg_sq"], fresh_opt.state[q]["exp_avg_sq"])
    assert ckptio.verify(url) > 0


def test_dcp_load_through_dcp_reader_from_s3(s3_env: str) -> None:
    """ckptio.DcpReader over an s3:// prefix: ckptio.save there, dcp.load back (ranged GETs
    through the S3 store's backend), bitwise."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 33)
    url = f"{s3_env}/ck"
    ckptio.save({"model": model.state_dict(), "step": 3}, url)
    assert ckptio.DcpReader.validate_checkpoint_id(url)
    state = {"model": torch.nn.Linear(64, 33).state_dict(), "step": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=ckptio.DcpReader(url))
    assert state["step"] == 3
    for key, value in model.state_dict().items():
        assert torch.equal(state["model"][key], value), key


def test_dcp_save_through_dcp_writer_to_s3(s3_env: str) -> None:
    """ckptio.DcpWriter over an s3:// prefix: dcp.save there (multipart uploads, conditional
    manifest PUT), then ckptio.load and ckptio.verify read it back bitwise; a second save to the
    same prefix replaces it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 33)
    opt = torch.optim.AdamW(model.parameters(), betas=(0.8, 0.9))
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    url = f"{s3_env}/dcpw"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict(), "step": 1}, storage_writer=ckptio.DcpWriter(url))
        dcp.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 2},
                 storage_writer=ckptio.DcpWriter(url))
    fresh = torch.nn.Linear(64, 33)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    state = {"model": fresh, "optim": fresh_opt, "step": 0}
    ckptio.load(url, state)
    assert state["step"] == 2 and fresh_opt.param_groups[0]["betas"] == (0.8, 0.9)
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(opt.state[p]["exp_avg"], fresh_opt.state[q]["exp_avg"])
    assert ckptio.verify(url) > 0
