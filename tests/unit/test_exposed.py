"""Note [Exposed communication]: the time proxy's replay of a step's timeline, and the
splice that composes a timeline by depth (Note [Composed depth])."""

import pytest

from fsdptag.tools.overlap import exposed_s, splice, transfer_s

SIZES = {"dp": 4, "tp": 2}
LINKS = {"dp": 30.0, "tp": 10.0, "partial": 100.0}  # bytes/s


def test_transfer_time_is_ring_bytes_over_the_link():
    assert transfer_s("all_gather", "dp", 40, SIZES, LINKS) == ("dp", 40 * 3 / 4 / 30)
    assert transfer_s("all_reduce", "tp", 40, SIZES, LINKS) == ("tp", 2 * 40 / 2 / 10)
    assert transfer_s("reduce_scatter", "dp/2", 40, SIZES, LINKS) == ("partial", 40 / 2 / 100)
    assert transfer_s("all_to_all", "dp", 40, SIZES, LINKS) == ("dp", 40 / 30)


def test_compute_between_issue_and_wait_hides_the_collective():
    # 120 B all-gather over 4 ranks: 90 B sent over 30 B/s = 3 s; FLOPs at 1/s.
    gather = ("i", 0, "all_gather", "dp", 120)
    assert exposed_s([gather, ("w", 0, 0), ("e", 5)], 1.0, SIZES, LINKS) == 3  # waited at once
    assert exposed_s([gather, ("w", 2, 0), ("e", 5)], 1.0, SIZES, LINKS) == 1  # 2 s of compute hide 2 of 3
    assert exposed_s([gather, ("w", 4, 0), ("e", 5)], 1.0, SIZES, LINKS) == 0
    assert exposed_s([gather, ("e", 5)], 1.0, SIZES, LINKS) == 0  # waited at the end: hidden by all 5 s
    assert exposed_s([("e", 1), gather], 1.0, SIZES, LINKS) == 3  # issued after the last compute


def test_one_link_runs_its_collectives_in_issue_order():
    gather = ("i", 0, "all_gather", "dp", 120)  # 3 s each
    tp = ("i", 0, "all_reduce", "tp", 30)  # 3 s, on its own link
    # two gathers back to back: the second is done at 6 s; waiting the second (j=0: the newest) first
    assert exposed_s([gather, gather, ("w", 4, 0), ("w", 0, 0), ("e", 0)], 1.0, SIZES, LINKS) == 2
    # the TP all-reduce does not queue behind the gather
    assert exposed_s([gather, tp, ("w", 0, 0), ("w", 0, 0), ("e", 0)], 1.0, SIZES, LINKS) == 3


def test_splice_repeats_what_the_deeper_copy_adds():
    block = [("i", 0, "all_gather", "dp", 8), ("w", 5, 0)]
    def timeline(depth):  # a forward of `depth` blocks and a backward with a reduction each
        fwd = [("i", 0, "all_gather", "dp", 4), ("w", 0, 0)] + block * depth + [("e", 1)]
        bwd = [("i", 2, "reduce_scatter", "dp", 8), ("w", 0, 0)] * depth + [("e", 0)]
        return tuple(fwd + bwd)
    assert splice(timeline(2), timeline(3), 2, 3, 9) == timeline(9)
    assert splice(timeline(2), timeline(4), 2, 4, 8) == timeline(8)
    def flops_only(depth):  # a backward without collectives: one phase end, its FLOPs grow
        return (("i", 0, "all_gather", "dp", 4), ("w", 0, 0), ("e", 3 + 5 * depth))
    assert splice(flops_only(2), flops_only(3), 2, 3, 9) == flops_only(9)
    with pytest.raises(ValueError, match="not depth 2's with records added"):
        splice(timeline(2), timeline(3)[1:], 2, 3, 9)
