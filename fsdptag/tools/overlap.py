"""The step's collectives in the order the runtime issues and waits them, the time a
rank spends waiting for them (Note [Exposed communication]), and the planner's time
proxy built on it (Note [Time proxy] in ``plan.py``)."""

from __future__ import annotations

from typing import Callable, Sequence

from .._compat import resolve_group
from ..debug import CollectiveCounter
from .records import MemoryEstimate, Rates

__all__ = ["Rates", "TimelineCounter", "exposed_proxy", "exposed_s", "splice", "time_proxy", "transfer_s"]

# A timeline is a tuple of records, each with the FLOPs dispatched since the record before:
#   ("i", flops, kind, group, nbytes)  a collective issued
#   ("w", flops, j)                    the compute stream waits for the collective in flight issued
#                                      j issues before the newest one still in flight
#   ("e", flops)                       a phase ends (each forward, each backward)
Timeline = tuple


class TimelineCounter(CollectiveCounter):
    """A :class:`CollectiveCounter` that also records the step's :data:`Timeline`;
    ``flops()`` returns the FLOPs dispatched so far (``measure.py``'s FLOP counter)."""

    def __init__(self, meshes, flops: Callable[[], int]) -> None:
        super().__init__(meshes)
        self._flops = flops
        self._clock = 0
        self._open: list[int] = []  # event indices in flight, oldest first
        self._known = set(self.labels.values())
        self.records: list[tuple] = []

    def _since(self) -> int:
        now = self._flops()
        out, self._clock = now - self._clock, now
        return out

    def _label(self, group: str) -> str:
        """A group off the meshes (FSDP2's k-rank groups of partial reshard, named by a
        process-wide counter) as ``"?/k"``: a k-rank group, the same in every run."""
        return group if group in self._known else f"?/{resolve_group(group).size()}"

    def _issued(self, index: int) -> None:
        e = self.events[index]
        self.records.append(("i", self._since(), e.kind, self._label(e.group), e.nbytes))
        self._open.append(index)

    def _close(self, index: int, compute_at_issue: int) -> None:
        super()._close(index, compute_at_issue)
        self.records.append(("w", self._since(), len(self._open) - 1 - self._open.index(index)))
        self._open.remove(index)

    def end_phase(self) -> None:
        self.records.append(("e", self._since()))


def splice(at_a: Timeline, at_b: Timeline, a: int, b: int, depth: int) -> Timeline:
    """The timeline at ``depth`` from those at depths ``a`` and ``b`` (Note [Composed
    depth]), phase by phase: between the records both share at the start and at the
    end, depth ``b`` adds records (repeated once per ``b - a`` blocks) and may change
    the FLOPs of the records depth ``a`` has there (extended as every count is)."""
    steps = (depth - a) // (b - a)
    pa, pb = _phases(at_a), _phases(at_b)
    if len(pa) != len(pb):
        raise ValueError(f"cannot compose timelines: {len(pa)} vs {len(pb)} phases")
    out: list[tuple] = []
    for x, y in zip(pa, pb):
        n = 0
        while n < len(x) and x[n] == y[n]:
            n += 1
        m = 0
        while m < len(x) - n and x[len(x) - 1 - m] == y[len(y) - 1 - m]:
            m += 1
        mx, my = x[n:len(x) - m], y[n:len(y) - m]
        added = len(my) - len(mx)
        if added >= 0 and _same_but_flops(mx, my[added:]):
            middle = my[:added] * steps + _extend(mx, my[added:], steps)
        elif added >= 0 and _same_but_flops(mx, my[:len(mx)]):
            middle = _extend(mx, my[:len(mx)], steps) + my[len(mx):] * steps
        else:
            raise ValueError(f"cannot compose timelines: depth {b}'s phase is not depth {a}'s with records added")
        out += x[:n] + middle + x[len(x) - m:]
    return tuple(out)


def _same_but_flops(xs: list, ys: list) -> bool:
    return len(xs) == len(ys) and all(x[0] == y[0] and x[2:] == y[2:] for x, y in zip(xs, ys))


def _extend(xs: list, ys: list, steps: int) -> list:
    return [(x[0], x[1] + steps * (y[1] - x[1]), *x[2:]) for x, y in zip(xs, ys)]


def _phases(t: Timeline) -> list[list]:
    phases, cur = [], []
    for r in t:
        cur.append(r)
        if r[0] == "e":
            phases.append(cur)
            cur = []
    return phases + [cur] if cur else phases


def transfer_s(kind: str, group: str, nbytes: int, sizes: dict[str, int], bandwidths: dict[str, float]
               ) -> tuple[str, float]:
    """``(link, seconds)`` of one collective: ring algorithms (an all-gather or reduce-scatter
    of ``nbytes`` over ``n`` ranks sends ``nbytes (n-1)/n``, an all-reduce twice that);
    all-to-all and broadcast send ``nbytes``. ``sizes``: group label -> ranks; a "dp/k"
    label is a k-rank group of partial reshard; links: "dp", "tp", "partial"."""
    link = "tp" if group == "tp" else "partial" if "/" in group else "dp"
    n = int(group.rsplit("/", 1)[1]) if link == "partial" else sizes.get(group, 1)
    ring = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}.get(kind)
    sent = nbytes * ring * (n - 1) / n if ring is not None else nbytes
    return link, sent / bandwidths[link]


def exposed_s(timeline: Sequence[tuple], flops_per_s: float, sizes: dict[str, int],
              bandwidths: dict[str, float]) -> float:
    """Seconds the compute stream waits for collectives in one step.

    Note [Exposed communication]
    ----------------------------
    The timeline is replayed on two kinds of stream: compute runs the recorded FLOPs at
    ``flops_per_s``; each link ("dp": data-parallel collectives, "tp", "partial": the
    k-rank re-gathers of partial reshard) runs its collectives one at a time in issue
    order, each from its issue (or when the one before it on the link is done) for
    :func:`transfer_s`. A wait holds compute until its collective is done, as
    ``wait_tensor`` holds the compute stream on NCCL. What compute queued between an
    issue and its wait hides the collective: the runtime's prefetch (the next bucket's
    all-gather, forward and backward) and its reductions in flight (Note [Prefetch])
    appear as the gaps they leave; TP collectives, waited at their first use, hide
    nothing. Collectives still in flight at the end are waited there. Exposed = the
    replayed step's end minus its compute. Not modelled: kernels slowed by a
    concurrent collective (SM and memory contention), latency, collectives of one link
    sharing bandwidth instead of queueing. FSDP2's in-place c10d collectives are
    recorded as waited at their issue (its streams are not seen), so its estimates show
    no overlap.
    """
    t = 0.0
    compute = 0.0
    free: dict[str, float] = {}
    flight: list[float] = []  # done times, oldest issue first (a wait counts from the newest)
    for r in timeline:
        t += r[1] / flops_per_s
        compute += r[1] / flops_per_s
        if r[0] == "i":
            link, secs = transfer_s(r[2], r[3], r[4], sizes, bandwidths)
            done = max(t, free.get(link, 0.0)) + secs
            free[link] = done
            flight.append(done)
        elif r[0] == "w":
            t = max(t, flight.pop(len(flight) - 1 - r[2]))
    t = max([t, *flight])
    return t - compute


def _ring(n: int) -> float:
    return (n - 1) / n


def time_proxy(e: MemoryEstimate, rates: Rates = Rates()) -> tuple[float, float]:
    """``(comm_s, compute_s)`` of one estimated step (Note [Time proxy])."""
    shard = e.world_size // e.tp // e.hsdp_replicas
    dp_bytes = ((e.fsdp_all_gather_bytes + e.fsdp_reduce_scatter_bytes) * _ring(shard)
                + 2 * e.fsdp_all_reduce_bytes * _ring(e.hsdp_replicas) + e.other_collective_bytes)
    tp_bytes = (e.tp_all_gather_bytes + e.tp_reduce_scatter_bytes + 2 * e.tp_all_reduce_bytes) * _ring(e.tp)
    ks = [v for v in (e.reshard_after_forward.values() if isinstance(e.reshard_after_forward, dict)
                      else [e.reshard_after_forward]) if not isinstance(v, bool) and v > 1]
    partial_bytes = e.fsdp_partial_all_gather_bytes * _ring(max(ks, default=1))
    comm = dp_bytes / rates.bandwidth + tp_bytes / rates.tp_bandwidth + partial_bytes / rates.partial_bandwidth
    return comm, (e.forward_flops + e.backward_flops + e.recompute_flops) / rates.device_flops


def exposed_proxy(e: MemoryEstimate, rates: Rates = Rates()) -> float:
    """Seconds of the step's communication compute does not hide (Note [Exposed communication])."""
    if not e.timeline:
        raise ValueError("this estimate has no timeline (made without measure_step?); use Rates(overlap=False)")
    dp = e.world_size // e.tp
    sizes = {"dp": dp, "shard": dp // e.hsdp_replicas, "replicate": e.hsdp_replicas, "tp": e.tp}
    return exposed_s(e.timeline, rates.device_flops, sizes,
                     {"dp": rates.bandwidth, "tp": rates.tp_bandwidth, "partial": rates.partial_bandwidth})
