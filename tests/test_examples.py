"""Every script in examples/ runs as its docstring tells a reader to run it: each command
there, verbatim, in a fresh process with the user's environment (tests/typed_commands.py), and
ends with its own check passed: the "ok" line it prints only after its asserts (bitwise
resumes, restored steps, verified checkpoints). The commands take /tmp paths; each example
writes a new directory under them per run, so a command can be run again."""

from __future__ import annotations

from pathlib import Path

import pytest

from typed_commands import ROOT, Case, docstring_commands, run_case

EXAMPLES = ROOT / "examples"
LIGHTNING, HF, S3 = ("lightning",), ("transformers", "accelerate"), ("boto3", "weed")
TITAN = ("torchtitan",)
DEEPSPEED = ("deepspeed",)

# each docstring command (as written) -> what its output must show
EXPECT = {
    "python examples/plain_loop.py --dir /tmp/ckptio-plain --steps 40 --kill-at 27":
        # saves every 5 steps, asynchronous: the step-25 save may be in flight at the kill
        r"ok \(cpu\): killed at step 27, resumed at step (26|21); losses \d+-40 bitwise",
    "python examples/plain_loop.py --device cuda    # the same on a GPU (RNGState holds CUDA's)":
        r"ok \(cuda\): killed at step 27",
    "python examples/tiers_every_step.py --disk /tmp/ckptio-tiers --steps 30 --every 10":
        r"memory gone: restored step 30 [\s\S]*ok \(cpu\)",
    "python examples/tiers_every_step.py --device cuda    # a model on a GPU":
        r"memory gone: restored step 30 [\s\S]*ok \(cuda\)",
    "torchrun --standalone --nproc-per-node 2 examples/fsdp2_two_ranks.py --dir /tmp/f2":
        "saved step 3 on 2 ranks",
    "python examples/fsdp2_two_ranks.py --dir /tmp/f2 --load-on-one":
        "ok: the 2-rank FSDP2 checkpoint loaded into one process",
    "python examples/lightning_trainer.py --dir /tmp/ckptio-lightning --epochs 3":
        "ok: resumed at epoch 3",
    "python examples/hf_trainer.py --out /tmp/ckptio-hf --steps 6": "ok: resumed from",
    "python examples/torchtitan_manager.py --dir /tmp/ckptio-titan --steps 8 --kill-at 5":
        # saves every 2 steps, asynchronous: the step-4 save may be in flight at the kill
        r"ok: killed at step 5, resumed at step (4|2); losses (5|3)-8 bitwise",
    "torchrun --standalone --nproc-per-node 2 examples/deepspeed_zero.py --dir /tmp/ckptio-ds "
    "--stage 3": "saved global_step3 through ckptio, trained to step 6",
    "torchrun --standalone --nproc-per-node 2 examples/deepspeed_zero.py --dir /tmp/ckptio-ds "
    "--stage 3 --resume": r"ok: resumed global_step3 on ZeRO stage 3; losses of steps 4-6 bitwise",
    "python examples/s3_seaweedfs.py --url s3://ckpt/example-run --steps 6":
        "ok: saved to s3://ckpt/example-run, restored step 6 bitwise, verified",
}


def example_case(script: str, *, cuda: bool = False, needs: tuple[str, ...] = ()) -> Case:
    """The docstring commands of ``script`` (those for CUDA, or the others), in order."""
    commands = [c for c in docstring_commands(EXAMPLES / script) if ("cuda" in c) == cuda]
    assert commands, f"{script} documents no command{' for CUDA' if cuda else ''}"
    return Case(tuple((c, EXPECT[c]) for c in commands), needs=needs + (("cuda",) if cuda else ()))


DEVICES = [pytest.param(False, id="cpu"), pytest.param(True, id="cuda")]


@pytest.mark.parametrize("cuda", DEVICES)
def test_plain_loop(tmp_path: Path, cuda: bool) -> None:
    run_case(example_case("plain_loop.py", cuda=cuda), tmp_path)


@pytest.mark.parametrize("cuda", DEVICES)
def test_tiers_every_step(tmp_path: Path, cuda: bool) -> None:
    run_case(example_case("tiers_every_step.py", cuda=cuda), tmp_path)


def test_fsdp2_two_ranks(tmp_path: Path) -> None:
    run_case(example_case("fsdp2_two_ranks.py"), tmp_path)


def test_lightning_trainer(tmp_path: Path) -> None:
    run_case(example_case("lightning_trainer.py", needs=LIGHTNING), tmp_path)


def test_hf_trainer(tmp_path: Path) -> None:
    run_case(example_case("hf_trainer.py", needs=HF), tmp_path)


def test_torchtitan_manager(tmp_path: Path) -> None:
    run_case(example_case("torchtitan_manager.py", needs=TITAN), tmp_path)
def test_deepspeed_zero(tmp_path: Path) -> None:
    run_case(example_case("deepspeed_zero.py", needs=DEEPSPEED), tmp_path)


def test_s3_seaweedfs(tmp_path: Path) -> None:
    run_case(example_case("s3_seaweedfs.py", needs=S3), tmp_path)


def test_plain_loop_with_no_arguments(tmp_path: Path) -> None:
    """The script as it stands, its defaults (--steps 40 --kill-at 27) and a temporary
    directory: its uninterrupted run must not inherit --kill-at."""
    run_case(Case((("python examples/plain_loop.py", r"ok \(cpu\): killed at step 27"),)),
             tmp_path)


def test_every_example_is_tested() -> None:
    tested = {name.removeprefix("test_") for name in globals() if name.startswith("test_")}
    scripts = {p.stem for p in EXAMPLES.glob("*.py")}
    assert scripts <= tested, f"examples without a test: {sorted(scripts - tested)}"
    documented = {c for p in EXAMPLES.glob("*.py") for c in docstring_commands(p)}
    assert documented == set(EXPECT), (f"documented, not checked: {documented - set(EXPECT)}; "
                                       f"checked, no longer documented: "
                                       f"{set(EXPECT) - documented}")
