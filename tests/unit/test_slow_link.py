"""``fsdptag.testing.slow_link.SlowLink``: a collective completes no earlier than its
bytes over the bandwidth after its issue; the link carries one at a time; compute
between issue and wait hides it; c10d calls (FSDP2's) are delayed alike."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from fsdptag.testing.slow_link import SlowLink

c10d = torch.ops._c10d_functional
UNIT = 0.1  # seconds one all-gather of 8000 bytes takes on the link below


def _link() -> SlowLink:
    return SlowLink(bandwidth=8000 / UNIT)


def _all_gather():
    return c10d.all_gather_into_tensor(torch.ones(1000), 2, dist.group.WORLD.group_name)  # 8000 B out


def test_wait_returns_at_the_deadline_not_the_issue(fake_pg):
    with _link() as link:
        t0 = time.perf_counter()
        out = _all_gather()
        issued = time.perf_counter() - t0
        c10d.wait_tensor(out)
        waited = time.perf_counter() - t0
    assert issued < UNIT / 2 and waited >= UNIT, (issued, waited)
    assert link.sent_bytes == 8000 and link.stalled_s >= UNIT * 0.9


def test_compute_in_flight_hides_it_and_the_link_serializes(fake_pg):
    with _link() as link:
        out = _all_gather()
        time.sleep(UNIT * 1.2)  # "compute" longer than the transfer
        c10d.wait_tensor(out)
    assert link.stalled_s < UNIT * 0.1, link.stalled_s
    with _link() as link:
        t0 = time.perf_counter()
        a, b = _all_gather(), _all_gather()  # the second starts when the first is done
        c10d.wait_tensor(a)
        first = time.perf_counter() - t0
        c10d.wait_tensor(b)
        second = time.perf_counter() - t0
    assert UNIT <= first < 1.8 * UNIT and second >= 2 * UNIT, (first, second)


def test_c10d_calls_are_delayed(fake_pg):
    out, inp = torch.empty(2000), torch.ones(1000)
    original = dist.all_gather_into_tensor
    with _link():
        assert dist.all_gather_into_tensor is not original
        t0 = time.perf_counter()
        dist.all_gather_into_tensor(out, inp)  # synchronous: returns at the deadline
        sync = time.perf_counter() - t0
        work = dist.all_gather_into_tensor(out, inp, async_op=True)
        issued = time.perf_counter() - t0
        work.wait()
        waited = time.perf_counter() - t0
    assert dist.all_gather_into_tensor is original  # unpatched on exit
    assert sync >= UNIT and issued - sync < UNIT / 2 and waited >= 2 * UNIT, (sync, issued, waited)


def test_bandwidth_must_be_positive():
    with pytest.raises(ValueError, match="must be positive"):
        SlowLink(bandwidth=0)
