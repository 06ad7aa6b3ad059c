"""A lost host's ranks fetch only their own bytes from their peers (issue 66): a rank rebuilt
from parity receives its own pieces, each summed along the survivors of its stripe
(redundancy/stripes.py), never the other members' whole steps; a holder killed during the fetch
is named and the next job restores bitwise.

Real gloo ranks on this machine, one rank per simulated host (tests/fetch_cases.py); the bytes
each rank received are ``last_restore["received_bytes"]``."""

from __future__ import annotations

import os

import pytest
import torch

import ckptio
from ckptio.errors import CorruptCheckpointError
from ckptio.testing.rank_processes import run_ranks
from ckptio.redundancy import peers
from ckptio.redundancy.budget import CHUNK
from ckptio.redundancy.landing import StreamCheck
from ckptio.redundancy.copy_fetch import Fetch, Receiving
from tests.fetch_cases import (chains_in_order, restore, restore_a_holder_dies,
                               restore_a_rank_freezes,
                               restore_counted, restore_some_leave, restore_written_later,
                               save)
from tests.redundancy_cases import PEER_GONE_S, host_dir, wipe_host

TIMEOUT = 240
OVERHEAD = 64 * 1024  # a piece's rounding, per rank: far below any other member's step


@pytest.fixture
def base(hosts_base: str) -> str:
    return hosts_base



@pytest.mark.parametrize(("spec", "hosts", "lost"), [
    ("parity", 4, (1,)), ("partners", 4, (2,)), ("parity2", 5, (1, 3))])
def test_a_lost_rank_receives_only_its_own_step(base, tmp_path, spec, hosts, lost):
    """Before: a rank rebuilt from Parity(k=3) received the 3 other members' whole steps and
    their 3 blocks (4x its step). Now every lost rank receives its step's bytes, the others
    no more than one step each (single loss: the pieces they sum and pass on)."""
    disk = str(tmp_path / "disk")
    sizes = run_ranks(hosts, save, base, disk, spec, 6, timeout_s=TIMEOUT)
    for host in lost:
        wipe_host(base, host)
    restored = run_ranks(hosts, restore, base, disk, spec, 6, timeout_s=TIMEOUT)
    assert all(r["bitwise"] and r["step"] == 1 for r in restored), restored
    want = "partner" if spec == "partners" else "parity"
    assert [r["how"]["source"] for r in restored] == [
        want if h in lost else "own" for h in range(hosts)]
    got = [r["how"]["received_bytes"] for r in restored]
    for rank in lost:
        assert sizes[rank] <= got[rank] <= sizes[rank] + OVERHEAD, (rank, got, sizes)
    if len(lost) == 1:
        assert all(g <= s + OVERHEAD for g, s in zip(got, sizes)), (got, sizes)


def test_a_holder_killed_during_the_fetch_is_named_then_the_next_job_restores_bitwise(
        base, tmp_path):
    """Parity(k=3) on 4 hosts, host 1 lost; rank 2 dies (SIGKILL) as it passes on its first
    piece of rank 1's rebuild: the other ranks' restore raises RankFailedError (a restore
    from other hosts' memory failed, restart the job) within peer_timeout_s, nothing
    half-installed; the restarted job (rank 2's host and memory intact) rebuilds rank 1 bitwise."""
    disk = str(tmp_path / "disk")
    run_ranks(4, save, base, disk, "parity", 6, timeout_s=TIMEOUT)
    wipe_host(base, 1)
    failed = run_ranks(4, restore, base, disk, "parity", 6, 2, may_die=(2,), timeout_s=TIMEOUT)
    for rank in (0, 1, 3):
        error = failed[rank]["error"]
        assert error and error.startswith("RankFailedError"), (rank, failed[rank])
        assert "restoring from the memory of other hosts failed" in error, error
        assert failed[rank]["seconds"] < PEER_GONE_S, failed[rank]
    assert not os.path.exists(os.path.join(host_dir(base, 1), "run", "r00001", "step-1"))
    restored = run_ranks(4, restore, base, disk, "parity", 6, timeout_s=TIMEOUT)
    assert all(r["bitwise"] and r["step"] == 1 for r in restored), restored
    assert [r["how"]["source"] for r in restored] == ["own", "parity", "own", "own"]


def test_a_rank_that_fails_its_part_of_the_rebuild_and_waits_elsewhere_stalls_no_one(
        base, tmp_path):
    """Parity(k=3) on 4 hosts, host 1 lost; ranks 2 and 3 fail their part of rank 1's rebuild
    as they enter it (no receive posted) and then wait at the job's next collective. Before:
    rank 0's sends to them (gloo sends only into a posted receive) waited the group's timeout,
    step_timeout_s (30 minutes by default), while they waited for rank 0: the job hung. Now a
    restore's sends and receives go over a group of peer_timeout_s: every rank raises
    RankFailedError within it and the job goes on (its next collective completes)."""
    disk = str(tmp_path / "disk")
    run_ranks(4, save, base, disk, "parity", 6, timeout_s=TIMEOUT)
    wipe_host(base, 1)
    failed = run_ranks(4, restore_some_leave, base, disk, "parity", 6, (2, 3), 5.0,
                       timeout_s=120)
    for rank in range(4):
        error = failed[rank]["error"]
        assert error and error.startswith("RankFailedError"), (rank, failed[rank])
        assert "restoring from the memory of other hosts failed" in error, error
        assert failed[rank]["seconds"] < 40, failed[rank]


def test_a_rank_that_fails_its_part_of_a_copys_transfer_stalls_no_rank_outside_it(
        base, tmp_path):
    """Partners(1) on 4 hosts, host 1 lost: rank 2 sends rank 1 its copy, ranks 0 and 3 move
    nothing. Rank 1 fails its part as it enters it (no receive posted) and waits at the
    job's next collective. Before: ranks 1 and 2 raised RankFailedError (rank 2's sends after
    peer_timeout_s) and went on, while ranks 0 and 3 waited for them in the gather after the
    transfers, whose timeout is step_timeout_s (here 60 s; 30 minutes by default). Now a
    rank whose transfers fail says so in that gather: every rank raises within seconds."""
    disk = str(tmp_path / "disk")
    run_ranks(4, save, base, disk, "partners", 2, timeout_s=TIMEOUT)
    wipe_host(base, 1)
    failed = run_ranks(4, restore_some_leave, base, disk, "partners", 2, (1,), 3.0,
                       "copy_fetch.send", 60.0, timeout_s=150)
    for rank in range(4):
        error = failed[rank]["error"]
        assert error and error.startswith("RankFailedError"), (rank, failed[rank])
        assert "restoring from the memory of other hosts failed" in error, error
        assert failed[rank]["seconds"] < 30, failed[rank]
    assert "rank 1: RuntimeError: rank 1: a link of the rebuild failed" in failed[0]["error"]


def test_a_rank_whose_protection_error_fails_its_restore_stalls_no_one(base, tmp_path):
    """Partners(1) on 4 hosts, nothing lost; rank 1's restore raises its protection's error
    (Protector.wait, as a step's protection failed on its rank alone) and it waits at the
    job's next collective. Before: rank 1 raised that error as it entered the restore, while
    ranks 0, 2 and 3 waited for it in the inventory's gather until step_timeout_s (here
    60 s; 30 minutes by default). Now it says so at that gather: every rank raises
    RankFailedError naming rank 1's error within seconds."""
    disk = str(tmp_path / "disk")
    run_ranks(4, save, base, disk, "partners", 1, timeout_s=TIMEOUT)
    failed = run_ranks(4, restore_some_leave, base, disk, "partners", 1, (1,), 3.0,
                       "protect.Protector.wait", 60.0, timeout_s=150)
    for rank in range(4):
        error = failed[rank]["error"]
        assert failed[rank]["seconds"] < 30, failed[rank]
        assert error and error.startswith("RankFailedError"), (rank, failed[rank])
        assert "rank 1: CkptError: rank 1: a link of the rebuild failed" in error, error


@pytest.mark.parametrize(("spec", "lost"), [("partners", 2), ("parity", 1)])
def test_a_lost_ranks_step_is_loaded_from_memory_and_written_after(base, tmp_path, spec, lost):
    """Before: the lost rank wrote its received step into its memory tier, then loaded it from
    there. Now it loads the checked bytes from memory while a thread writes the step (joined
    by the next restore, save, wait or close): its write, held here until its restore has
    returned, does not hold the restore up; the step is in its memory tier after close(), and
    the next job finds it there (its own)."""
    disk = str(tmp_path / "disk")
    run_ranks(4, save, base, disk, spec, 6, timeout_s=TIMEOUT)
    wipe_host(base, lost)
    restored = run_ranks(4, restore_written_later, base, disk, spec, 6, timeout_s=TIMEOUT)
    assert all(r["bitwise"] and r["step"] == 1 and r["in_tier"] for r in restored), restored
    assert restored[lost]["written_later"] is True, restored[lost]
    assert [r["written_later"] for i, r in enumerate(restored) if i != lost] == [None] * 3
    again = run_ranks(4, restore, base, disk, spec, 6, timeout_s=TIMEOUT)
    assert [r["how"]["source"] for r in again] == ["own"] * 4, again


@pytest.mark.parametrize(("spec", "lost"), [("partners", 2), ("parity", 1)])
def test_a_lost_rank_hashes_its_step_once_and_the_restore_gathers_only_what_it_needs(
        base, tmp_path, spec, lost):
    """Before: the lost rank hashed its received step as it landed, then its load from memory
    hashed every byte again (its verify: 2x its step), and it began writing the step into its
    memory tier before that load (the two shared the cores); every restore gathered 7 times
    over gloo (the elastic survey, its parity blocks and the steps of another rank count, each
    a gather of its own, and a transfer round where every rank held its own step). Now: the
    received step is hashed once (the load takes the checked bytes as they are), the survivors
    their own step once (their load's verify); the step is written once the load has ended
    (in the tier after close()); a lost host's restore gathers 4 times (the inventory with the
    survey, the items, the failures, the outcomes), a restore with nothing lost twice."""
    disk = str(tmp_path / "disk")
    sizes = run_ranks(4, save, base, disk, spec, 6, timeout_s=TIMEOUT)
    whole = run_ranks(4, restore_counted, base, disk, spec, 6, timeout_s=TIMEOUT)
    assert [r["how"]["source"] for r in whole] == ["own"] * 4, whole
    assert [r["gathers"] for r in whole] == [2] * 4, whole
    wipe_host(base, lost)
    restored = run_ranks(4, restore_counted, base, disk, spec, 6, timeout_s=TIMEOUT)
    assert all(r["bitwise"] and r["step"] == 1 for r in restored), restored
    assert restored[lost]["how"]["source"] != "own", restored[lost]
    for rank, got in enumerate(restored):
        assert sizes[rank] <= got["hashed"] <= sizes[rank] + OVERHEAD, (rank, got, sizes)
    assert [r["gathers"] for r in restored] == [4] * 4, restored
    assert [r["written_early"] for r in restored] == [0] * 4, restored
    assert all(r["in_tier"] for r in restored), restored


@pytest.mark.parametrize(("spec", "lost"), [("parity", 1), ("partners", 2)])
def test_a_lost_ranks_step_lands_in_its_memory_tier_and_is_never_copied(base, tmp_path, spec,
                                                                        lost):
    """Before: the lost rank received its step into fresh memory, loaded it, then a thread
    copied it into its memory tier's files (its step's bytes copied once more, and held twice
    until close()). Now its chunks land in the data file of its scratch directory in the tier
    (tmpfs): the install is the manifest and a rename, no byte copied into the tier by any
    rank during the restore and close(); bitwise, the received bytes and the checks as before;
    no scratch directory left; the next job restores the step as its own, bitwise."""
    disk = str(tmp_path / "disk")
    sizes = run_ranks(4, save, base, disk, spec, 6, timeout_s=TIMEOUT)
    wipe_host(base, lost)
    restored = run_ranks(4, restore_counted, base, disk, spec, 6, timeout_s=TIMEOUT)
    assert all(r["bitwise"] and r["step"] == 1 and r["in_tier"] for r in restored), restored
    assert restored[lost]["how"]["source"] != "own", restored[lost]
    assert [r["copied"] for r in restored] == [0] * 4, ([r["copied"] for r in restored], sizes)
    got = restored[lost]["how"]["received_bytes"]
    assert sizes[lost] <= got <= sizes[lost] + OVERHEAD, (got, sizes)
    assert sizes[lost] <= restored[lost]["hashed"] <= sizes[lost] + OVERHEAD, restored[lost]
    assert [r["scratch_left"] for r in restored] == [[]] * 4, restored
    again = run_ranks(4, restore, base, disk, spec, 6, timeout_s=TIMEOUT)
    assert all(r["bitwise"] and r["step"] == 1 for r in again), again
    assert [r["how"]["source"] for r in again] == ["own"] * 4, again


def test_the_check_fused_with_the_receive_takes_chunks_in_any_order_and_names_a_flipped_byte(
        tmp_path):
    """landing.StreamCheck (the lost rank's check as its chunks land): chunks landing in any
    order check every entry once they are all there; a flipped byte names its entry; an
    entry not wholly received is not taken for checked."""
    ckptio.save({"a": torch.randn(600_000), "b": torch.randn(1000)}, str(tmp_path / "c"))
    manifest = (tmp_path / "c" / "manifest.json").read_bytes()
    files = peers.files_of(manifest, "c")
    data = torch.cat([torch.frombuffer(bytearray((tmp_path / "c" / n).read_bytes()),
                                       dtype=torch.uint8) for n, _ in files])
    spans = [(lo, min(lo + 65536, data.numel())) for lo in range(0, data.numel(), 65536)]

    def check(order, bytes_):
        fused = StreamCheck(manifest, files, bytes_, "c")
        for lo, hi in order:
            fused.landed(lo, hi)
        return fused.checked()

    assert check(spans[::-1], data) and check(spans[1::2] + spans[::2], data)
    flipped = data.clone()
    flipped[100] ^= 0xFF
    with pytest.raises(CorruptCheckpointError, match="entry 'a'"):
        check(spans, flipped)
    with pytest.raises(CorruptCheckpointError, match="not all of it received"):
        check(spans[1:], data)


def _copy_file(base: str, holder: int, of: int) -> str:
    """The data file of ``holder``'s partner copy of rank ``of``'s step 1."""
    where = os.path.join(host_dir(base, holder), "run", ".redundancy", "step-1",
                         f"copy-r{of:05d}")
    return next(e.path for e in os.scandir(where) if e.name.startswith("data-"))


def test_a_partner_copy_is_fetched_from_every_holder_at_once(base, tmp_path):
    """Partners(2) on 4 hosts, host 2 lost: before, its copy came whole from its first partner
    (rank 3); now ranks 3 and 0 each send half of its chunks, received at once, and the step
    is restored bitwise, its bytes received once."""
    disk = str(tmp_path / "disk")
    sizes = run_ranks(4, save, base, disk, "partners2", 9, timeout_s=TIMEOUT)
    wipe_host(base, 2)
    restored = run_ranks(4, restore, base, disk, "partners2", 9, timeout_s=TIMEOUT)
    assert all(r["bitwise"] and r["step"] == 1 for r in restored), restored
    assert [r["how"]["source"] for r in restored] == ["own", "own", "partner", "own"]
    got = restored[2]["how"]["received_from"]
    assert sorted(got) == [0, 3], got
    assert sum(got.values()) == sizes[2] == restored[2]["how"]["received_bytes"], (got, sizes)
    assert abs(got[0] - got[3]) <= CHUNK, got


def test_a_flipped_byte_in_a_split_copy_is_fetched_again_one_holder_at_a_time(base, tmp_path):
    """Partners(2), host 2 lost, one byte flipped in its first partner's (rank 3's) copy; the
    step is one entry, so its check cannot tell which holder's chunks were wrong: the split
    fetch is named and passed over, rank 3's copy alone then fails its check and is named,
    and rank 0's copy alone restores the step bitwise (rank 0's copy is never named)."""
    disk = str(tmp_path / "disk")
    run_ranks(4, save, base, disk, "partners2", 9, timeout_s=TIMEOUT)
    wipe_host(base, 2)
    with open(_copy_file(base, 3, 2), "r+b") as f:  # chunk 2: one of rank 3's share
        f.seek(2 * CHUNK + 12345)
        byte = f.read(1)
        f.seek(2 * CHUNK + 12345)
        f.write(bytes([byte[0] ^ 0xFF]))
    restored = run_ranks(4, restore, base, disk, "partners2", 9, timeout_s=TIMEOUT)
    assert all(r["bitwise"] and r["step"] == 1 for r in restored), restored
    how = restored[2]["how"]
    assert how["source"] == "partner", how
    first, second = how["skipped"]
    assert "fetched from several holders at once" in first, first
    assert "partner copy of rank 2, step 1, held by rank 3" in second, second
    assert "does not match its checksum" in first and "does not match its checksum" in second
    assert "held by rank 0" not in " ".join(how["skipped"]), how["skipped"]


@pytest.mark.parametrize("victim", [0, 3])
def test_a_holder_killed_while_sending_its_share_is_named_then_the_next_job_restores(
        base, tmp_path, victim):
    """Partners(2), host 2 lost; rank ``victim`` (0, which also holds the job's store, or 3)
    dies (SIGKILL) as it is about to send its share of rank 2's copy (the other holder sends
    its own): the other ranks' restore raises RankFailedError (a restore from other hosts'
    memory failed, restart the job) within peer_timeout_s (most runs: under a second; one CI
    run: 60.03 s for rank 3, one transfer's deadline), nothing installed; the restarted job
    (the victim's host intact) restores rank 2 bitwise from both holders. Rank 1 takes no
    part in the transfers: with victim 3 (the job's store held outside the ranks) it learns of
    the loss where the ranks meet next, from the record in the store of a rank that left
    (peers.Meeting.leave) or from rank 3's death marked there by a rank on its machine, not
    after rank_timeout_s (60 s). One CI run, with rank 0 holding
    the store: rank 1 learned it from the store's loss first (rank 0 had left and exited)."""
    disk = str(tmp_path / "disk")
    run_ranks(4, save, base, disk, "partners2", 9, timeout_s=TIMEOUT)
    wipe_host(base, 2)
    failed = run_ranks(4, restore_a_holder_dies, base, disk, "partners2", 9, victim,
                       may_die=(victim,), timeout_s=TIMEOUT, agent_store=victim != 0)
    for rank in {0, 1, 2, 3} - {victim}:
        error = failed[rank]["error"]
        assert error and error.startswith("RankFailedError"), (rank, failed[rank])
        assert "from the memory of other hosts" in error, error  # failed, or stopped where
        # the ranks meet: rank 0 held the job's store too (its loss is named there)
        assert failed[rank]["seconds"] < (PEER_GONE_S if victim == 0 else 30), failed[rank]
    if victim == 3:
        said = failed[1]["error"]  # from the record of rank 2 (or 0), or from the store's
        # mark of rank 3's death by a rank on its machine (liveness): the store outlives them
        # (held by the test, as by torchrun's agent); silence alone takes rank_timeout_s (60 s)
        assert "found gone by rank " in said or "its process died" in said, failed[1]
    assert not os.path.exists(os.path.join(host_dir(base, 2), "run", "r00002", "step-1"))
    restored = run_ranks(4, restore, base, disk, "partners2", 9, timeout_s=TIMEOUT)
    assert all(r["bitwise"] and r["step"] == 1 for r in restored), restored
    assert sorted(restored[2]["how"]["received_from"]) == [0, 3], restored[2]["how"]


@pytest.mark.parametrize("where", ["inventory", "transfer"])
def test_a_rank_frozen_in_a_restore_is_named_within_rank_timeout_s(base, tmp_path, where):
    """Partners(1) on 3 hosts, host 0 lost; rank 2 freezes (SIGSTOP) at the restore's first
    gather, or at the gather of the transfers' metadata: the others raise RankFailedError
    naming rank 2 and its host within rank_timeout_s=5 s (+ slack), their state untouched.
    Before, a gloo gather of step_timeout_s (120 s here, 30 minutes by default) waited it
    out: 61.5 s with 60 s."""
    disk = str(tmp_path / "disk")
    run_ranks(3, save, base, disk, "partners", 2, timeout_s=TIMEOUT)
    wipe_host(base, 0)
    got = run_ranks(3, restore_a_rank_freezes, base, disk, "partners", 2, 2, where,
                    may_die=(2,), timeout_s=TIMEOUT)
    for rank in (0, 1):
        error = got[rank]["error"]
        assert error and error.startswith("RankFailedError"), (rank, got[rank])
        assert f"rank {rank}: a restore from the memory of other hosts stopped where the ranks " \
               "meet, waiting for rank 2 on host 2 (host2, rank 2)" in error, error
        assert "no sign of life for 5 s (Options.rank_timeout_s)" in error, error
        assert "restart the job" in error, error
        assert got[rank]["ranks"] == [2] and got[rank]["untouched"], got[rank]
        assert got[rank]["seconds"] < 5 + 15, got[rank]


def test_a_damaged_entry_names_the_one_holder_whose_chunks_it_spans():
    """An entry inside one holder's chunks names that holder's copy; one across two holders'
    chunks (or a failure no entry explains) names the split, fetched again one at a time."""
    fetch = Fetch(2, (3, 0), ("copy:r3:of2:s1", "copy:r0:of2:s1"), 3 * CHUNK)

    class Check:
        bad: tuple[int, int] | None = None

    check = Check()
    got = Receiving(fetch, torch.empty(0, dtype=torch.uint8), [])
    check.bad = (CHUNK + 10, CHUNK + 20)  # chunk 1: rank 0's
    assert got.blame(check, 1) == ["copy:r0:of2:s1"]  # type: ignore[arg-type]
    check.bad = (2 * CHUNK, 2 * CHUNK + 1)  # chunk 2: rank 3's
    assert got.blame(check, 1) == ["copy:r3:of2:s1"]  # type: ignore[arg-type]
    check.bad = (CHUNK - 5, CHUNK + 5)  # across chunks 0 and 1
    assert got.blame(check, 1) == ["split:r2:s1"]  # type: ignore[arg-type]
    assert got.blame(None, 1) == ["split:r2:s1"]
    alone = Receiving(Fetch(2, (3,), ("copy:r3:of2:s1",), 3 * CHUNK), got.out, [])
    assert alone.blame(None, 1) == ["copy:r3:of2:s1"]
    assert fetch.spans(3) == [(0, CHUNK), (2 * CHUNK, 3 * CHUNK)]
    assert fetch.spans(0) == [(CHUNK, 2 * CHUNK)]


def test_the_chains_a_rank_starts_are_sent_before_it_waits_for_any_chunk():
    """stripes.run alone, 4 ranks (one parity group, m = 1), rank 1 rebuilt, each piece in 3
    or more chunks. Before: a rank sent the chunks of the chains it starts one at a time as its
    loop reached them, after waiting for the chunks of other chains it passes on (the chains
    advanced one chunk at a time, in step). Now every such chunk is sent before its first
    wait; each survivor still XORs in two pieces' bytes (the two chains it adds to) and
    receives them, the lost rank its shard's length, bitwise."""
    chunk = 4096
    ranks = run_ranks(4, chains_in_order, 1, chunk, timeout_s=TIMEOUT)
    for rank, got in enumerate(ranks):
        assert got["error"] is None, got
        events = got["events"]
        waits = [n for n, (what, _tag) in enumerate(events) if what == "wait"]
        before = sum(1 for what, _tag in events[:waits[0] if waits else len(events)]
                     if what == "send")
        if rank == 1:
            assert got["bitwise"] and got["starts"] == 0 and before == 0, got
            assert got["received"] == 10 * chunk + 3 * 8, got
            continue
        assert got["starts"] >= 3 and before == got["starts"], (rank, got["starts"], events)
        assert got["xored"] <= got["received"] <= 2 * (10 * chunk + 3 * 8 * 3) // 3 + 64, got
