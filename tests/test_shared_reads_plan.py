"""Who reads each replicated entry of a load with peers, and how its bytes are cut into
messages (planning/shared_reads.py): pure decisions, no ranks."""

from __future__ import annotations

from ckptio.planning.shared_reads import Want, assign, messages


def test_each_shared_unit_has_one_owner_and_the_bytes_are_spread():
    units = [Want("a", 800), Want("b", 500), Want("c", 400), Want("d", 100)]
    shares = assign([units, units, units], [0, 0, 0])
    owners = {u.name: next(r for r, s in enumerate(shares) if s.owner[i] == -1)
              for i, u in enumerate(units)}
    for i, unit in enumerate(units):  # every other rank receives it from its owner
        for rank, share in enumerate(shares):
            expected = -1 if rank == owners[unit.name] else owners[unit.name]
            assert share.owner[i] == expected
        assert shares[owners[unit.name]].to[i] == tuple(r for r in range(3)
                                                        if r != owners[unit.name])
    loads = [sum(u.nbytes for u in units if owners[u.name] == r) for r in range(3)]
    assert sorted(loads) == [500, 500, 800]  # largest first, to the least loaded


def test_units_one_rank_wants_stay_its_own_and_count_for_balance():
    shares = assign([[Want("x", 1000), Want("s", 10)], [Want("s", 10)]], [0, 0])
    assert shares[0].owner == (-1, 1) and shares[0].to == {}  # rank 0 already reads x
    assert shares[1].owner == (-1,) and shares[1].to == {0: (0,)}


def test_nothing_shared_means_no_exchange():
    shares = assign([[Want("x", 5)], [Want("y", 5)]], [0, 0])
    assert not any(s.sends_or_receives for s in shares)


def test_messages_pack_small_units_and_cut_large_ones():
    out = messages([10, 0, 20, 250, 30], limit=100, small=50)
    assert out == [[(3, 0, 100)], [(3, 100, 200)], [(3, 200, 250)],  # a large one alone
                   [(0, 0, 10), (2, 0, 20), (4, 0, 30)]]  # small ones together
    assert all(sum(hi - lo for _i, lo, hi in m) <= 100 for m in out)


def test_a_small_unit_goes_to_the_rank_reading_its_file():
    """A bias in rank 1's file goes to rank 1, which reads the weights around it, even where
    rank 0 has fewer bytes to read; a large unit still goes to the rank with the fewest."""
    units = [Want("bias", 4096, "data-r1"), Want("big", 8 << 20, "data-r0")]
    shares = assign([units, units], [0, 1 << 20], [{"data-r0": 0}, {"data-r1": 1 << 20}])
    assert shares[1].owner[0] == -1 and shares[1].to[0] == (0,)  # rank 1 reads the bias
    assert shares[0].owner[1] == -1 and shares[0].to[1] == (1,)  # rank 0 reads the big one


def test_small_units_follow_the_large_ones_of_their_file():
    """Everything replicated (no rank reads alone): small units go where their file's large
    units went."""
    units = [Want("w0", 4 << 20, "f0"), Want("w1", 4 << 20, "f1"),
             *(Want(f"b{i}", 100, f"f{i % 2}") for i in range(6))]
    shares = assign([units, units], [0, 0])
    owner = {u.name: next(r for r in (0, 1) if shares[r].owner[i] == -1)
             for i, u in enumerate(units)}
    for i in range(6):
        assert owner[f"b{i}"] == owner[f"w{i % 2}"], owner
