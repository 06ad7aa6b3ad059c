"""The demo's training job (ckptio.demo: a small GPT, AdamW, a warmup + cosine schedule, its
data loader and every RNG) checkpointing to S3 through CheckpointManager, SIGKILLed right
after an async save returned (mid-upload), then resumed by a fresh process from the prefix: the
losses after the resume equal an uninterrupted run's bit for bit (float.hex)."""

from __future__ import annotations

from pathlib import Path

from ckptio.demo.launch import run_training

STEPS, EVERY, KILL = 24, 6, 18
BASE = ["--preset", "tiny", "--steps", str(STEPS), "--save-every", str(EVERY), "--mode", "eager"]


def test_a_job_killed_mid_upload_resumes_bitwise_from_s3(s3_env, s3_proxy, monkeypatch,
                                                          tmp_path: Path):
    reference = run_training([*BASE, "--no-save", "--out", str(tmp_path / "ref.json")],
                             capture=True, timeout_s=300)[0]["losses"]
    prefix = f"{s3_env}/job"
    # every data object's upload takes at least 0.5 s, so the kill lands mid-upload rather than
    # after a tiny state's save had already committed (seen on loaded machines)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_proxy.endpoint)
    slowed = s3_proxy.delay(0.5, times=None, method="PUT", key=r"/data-[^/]*$")
    killed = run_training([*BASE, "--dir", prefix, "--kill-at", str(KILL), "--out",
                           str(tmp_path / "killed.json")], killed=True, capture=True,
                          timeout_s=300)[0]
    assert killed["kill"]["done"] is False, killed["kill"]  # the save call returned, not its upload
    assert slowed.fired > 0
    s3_proxy.clear()
    resumed = run_training([*BASE, "--dir", prefix, "--resume", "--out",
                            str(tmp_path / "resumed.json")], capture=True, timeout_s=300)[0]
    # killed mid-save: never committed. Its prefix holds objects unless the kill came before the
    # save's thread sent its first request (the lock); both happen, depending on scheduling
    # (tests/s3/test_faults_s3.py kills a saver whose upload is known to be under way)
    assert KILL not in resumed["found"] and resumed["incomplete"] in ([KILL], []), resumed
    assert resumed["start"] == KILL - EVERY
    after = {step: loss for step, loss in resumed["losses"].items()
             if int(step) > KILL - EVERY}
    assert len(after) == EVERY * 2
    assert after == {step: reference[step] for step in after}
