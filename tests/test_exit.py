"""How ranks exit after ckptio saved and loaded over their process group (issue 63 item 11): a
rank aborted at interpreter exit (std::terminate) after its load had succeeded. Each rank here
is a fresh interpreter (run_ranks(spawn=True)) that finalizes as a torchrun job's does, or a
forked one where only the state before exit is asserted; run_ranks fails a run whose rank exits
with a status other than 0, with that rank's standard error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import exit_cases as cases
from ckptio.testing.rank_processes import run_ranks


def test_destroy_process_group_frees_the_group_ckptio_used(tmp_path):
    """ckptio.save/load of DTensors (resharded) and a CheckpointManager (kept referenced, as a
    script's global is) over the default group, and a one-rank group marked for the memory
    tier's pieces: destroy_process_group frees them, as it does without ckptio. ckptio held
    them (the default Checkpointer's groups, its caches of device meshes, the marked pieces)
    until interpreter exit, their gloo threads still running there."""
    assert run_ranks(2, cases.world_freed_by_destroy, str(tmp_path), destroy=False) == [[True, True, True]] * 2


def test_destroy_process_group_frees_world_without_a_garbage_collection(tmp_path):
    """After a manager save and a load of DTensors, WORLD goes with destroy_process_group, not
    at a later collection (which may run while the interpreter finalizes, the gloo threads
    still there)."""
    assert run_ranks(2, cases.world_freed_before_collection, str(tmp_path / "run"),
                     destroy=False) == [True, True]


def test_gloo_work_finishing_at_exit_after_a_ckptio_save_does_not_abort(tmp_path):
    """A collective still running when its rank returns: destroy_process_group waits for it,
    so its Python callback runs before exit. ckptio's cache of the default group kept the
    group alive past destroy_process_group: the work finished while the interpreter
    finalized, and the rank died with 'terminate called without an active exception'."""
    flags = tmp_path / "flags"
    flags.mkdir()
    assert run_ranks(2, cases.late_gloo_work, str(tmp_path), str(flags), spawn=True) == [0, 1]


def test_a_background_worker_inside_a_torch_call_at_exit_does_not_abort():
    """The drain's and the protection's thread (io/worker.py) was a daemon: inside a
    torch call (a gloo collective, a store call; the GIL released) when the interpreter
    finalized, it woke, could not take the GIL back and the process died with 'terminate
    called'. Now the running job finishes before finalization (here: its wait times out)."""
    done = subprocess.run([sys.executable, "-c", "import exit_cases; exit_cases.worker_busy_at_exit()"],
                          cwd=Path(__file__).parent, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])})
    assert done.returncode == 0 and "terminate called" not in done.stderr, done.stderr
