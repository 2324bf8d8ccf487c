"""Prefetch: a bucket's gather issues the next bucket's all-gather, in forward and in
backward (on by default: ``parametrize(..., prefetch=False)`` turns it off).

Note [Prefetch]
---------------
On NCCL a functional collective runs on the communicator's stream from its issue
until the compute stream waits for it (``wait_tensor``), and only compute queued in
between hides it: a gather waited right after its issue hides behind nothing. So when
a bucket gathers, fsdptag issues, without waiting, the all-gather of the bucket that
gathers next, and that bucket's gather later only waits and copies out. One bucket is
in flight at a time per direction (``OverlapPolicy.all_gathers``: k issues the k
buckets that gather next); each costs one more gathered bucket alive, as FSDP2's
prefetch does. On gloo the wait blocks the CPU either way: there the effect shows in
the dispatch-order timeline of ``CollectiveCounter`` (Note [Compute in flight] in
``fsdptag/debug/counter.py``), not in step times.

* Forward: the next bucket is the one that gathered after this one in the previous
  forward (the first forward takes the buckets in module order). A prefetched
  all-gather nobody claims (the order changed) is waited out when another is issued
  and at the end of the root's forward: the order can change between steps.
* Backward (zero3): a bucket re-gathered in backward (by fsdptag's hooks, or by a
  checkpoint's recompute) issues the re-gather of the bucket re-gathered after it in
  the previous backward (before any backward: the buckets the forward left to
  re-gather, in reverse forward order), so block i-1's parameters move while block i
  recomputes and back-propagates. A bucket is re-gathered once per backward, and
  unclaimed prefetches are waited out at its end.

Checkpoint regions replay their ops. A SAC region's recompute must see the ops its
forward saw, index by index, so an all-gather issued inside region i for bucket i+1
must be invisible to region i's replay, and region i+1's gather must still show the
ops of a gather. Both hold:

* the prefetch is issued with every SAC mode popped (``sac_hidden``): no region
  records it (a debug mode below the outermost region still sees it);
* the prefetched bucket's gather runs its usual ops on a :class:`ServedInput`, which
  answers the cast with the prefetch's cast and the all-gather with the prefetch's
  all-gather, so the region records (and its policy decides) a cast, an all-gather and
  a wait as always; the wait waits for the real collective. zero2's policy saves that
  all-gather's output as always; zero3's recompute gathers for real.

A non-selective checkpoint (plain, Hugging Face's) compares only saved tensors, and a
prefetch saves none (it runs without grad). Only tagged buckets that all-gather are
prefetched, bound to their flat storage or not (Note [Bound storage] in
``_bucket.py``): the choice fixes the order of collectives, so it depends on nothing
that may differ between ranks (a compile on some ranks only unbinds theirs).
"""

from __future__ import annotations

import torch

from ._compat import OncePerBackward, sac_hidden
from ._context import GatherContext, gather_context, running_backward
from ._tag import FSDPTaggedTensor

__all__ = ["Prefetcher", "ServedInput", "is_served"]

c10d = torch.ops._c10d_functional
_CAST = torch.ops.aten._to_copy.default
_ALL_GATHER = c10d.all_gather_into_tensor.default


_RECOMPUTED = (GatherContext.CHECKPOINT, GatherContext.SAC, GatherContext.REENTRANT)


class Prefetched:
    """An all-gather issued ahead: its (tagged) input as cast and its output. ``by``:
    who issued it, ``"learned"`` (the order of the last step), ``"scheduled"`` (a
    ``set_modules_to_*_prefetch`` list) or ``"unshard"`` (``fsdptag.unshard``: kept
    until its bucket gathers or ``fsdptag.reshard``; Note [Explicit schedule] in
    ``_schedule.py``)."""

    __slots__ = ("tagged", "cast", "output", "by", "scales")

    def __init__(self, tagged: bool, cast: torch.Tensor, output: torch.Tensor, by: str = "learned",
                 scales: torch.Tensor | None = None) -> None:
        self.tagged, self.cast, self.output, self.by = tagged, cast, output, by
        self.scales = scales  # a float8 bucket's (Note [Float8 all-gather] in _float8.py)

    def wait(self) -> None:
        c10d.wait_tensor(self.output)


class ServedInput(FSDPTaggedTensor):
    """A bucket's tagged flat buffer whose cast and all-gather are answered by an
    all-gather issued ahead (Note [Prefetch]): the ops dispatch as usual (a mode or a
    checkpoint policy sees them), but neither casts nor communicates."""

    __slots__ = ("served",)

    @staticmethod
    def __new__(cls, elem: torch.Tensor, tag, served: Prefetched):
        out = FSDPTaggedTensor.__new__(cls, elem, tag)
        out.served = served
        return out

    def __tensor_flatten__(self):
        return ["_elem"], (self.tag, self.served)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        return ServedInput(inner_tensors["_elem"], *ctx)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        served = args[0].served if args and type(args[0]) is ServedInput else None
        if served is not None and func is _CAST:
            cast = served.cast
            return ServedInput(cast._elem if type(cast) is FSDPTaggedTensor else cast, args[0].tag, served)
        if served is not None and func is _ALL_GATHER:
            return served.output
        plain = tuple(FSDPTaggedTensor(a._elem, a.tag) if type(a) is ServedInput else a for a in args)
        return FSDPTaggedTensor.__torch_dispatch__(func, types, plain, kwargs)


def is_served(t) -> bool:
    """Whether ``t`` is a :class:`ServedInput` (its all-gather was counted at its issue)."""
    return type(t) is ServedInput


class Prefetcher:
    """Issues the next bucket's all-gather when a bucket gathers; see Note [Prefetch]."""

    def __init__(self, depth: int = 1) -> None:
        self.depth = depth  # buckets in flight ahead, per direction (OverlapPolicy.all_gathers)
        self.active = False  # inside the root's forward
        self.order: list = []  # buckets in gather order, this forward
        self.backward_order: list = []  # zero3 buckets in re-gather order, this backward
        self.next: dict = {}  # bucket -> the next to gather in forward, from the last forward
        self.previous: dict = {}  # zero3 bucket -> the next to re-gather in backward, from the last backward
        self.default_order = lambda: []  # the first forward's guess: buckets in module order
        self.pending: dict = {}  # bucket -> Prefetched
        self.will_regather: dict = {}  # zero3 buckets this forward left to re-gather in backward
        self._at_end = OncePerBackward()  # the end-of-backward callback
        # Note [Explicit schedule] in _schedule.py: per direction, bucket root module ->
        # the modules whose buckets its gather issues instead of the learned ones;
        # resolved to buckets on first use (buckets can split: Note [Checkpointed bucket roots])
        self.schedule: dict[str, dict] = {"forward": {}, "backward": {}}
        self.buckets_of = None  # module -> its buckets (RootState.connect)
        self._resolved: dict[str, dict] | None = None

    def __getstate__(self) -> dict:
        return dict(self.__dict__, order=[], backward_order=[], pending={}, will_regather={},
                    _at_end=OncePerBackward(), default_order=None, _resolved=None)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.default_order = lambda: []

    def forget_order(self) -> None:
        """The buckets changed (Note [Checkpointed bucket roots] in ``_bucket.py``)."""
        self.next, self.previous, self._resolved = {}, {}, None

    def set_schedule(self, direction: str, module, modules: list) -> None:
        """``module``'s gather issues ``modules``' all-gathers (Note [Explicit schedule])."""
        self.schedule[direction][module] = list(modules)
        self._resolved = None

    def _scheduled(self, direction: str, bucket) -> list | None:
        if self.buckets_of is None:
            return None
        if self._resolved is None:
            self._resolved = {
                d: {b: [t for m in targets for t in self.buckets_of(m)]
                    for module, targets in schedule.items() for b in self.buckets_of(module)}
                for d, schedule in self.schedule.items()}
        return self._resolved[direction].get(bucket)

    def take(self, bucket, tagged: bool) -> Prefetched | None:
        entry = self.pending.pop(bucket, None)
        if entry is None:
            return None
        if (self.active or running_backward() or entry.by == "unshard") and entry.tagged == tagged:
            return entry
        entry.wait()  # not usable here: finish it, the caller gathers afresh
        return None

    def gathered(self, bucket, tagged: bool) -> None:
        """``bucket`` just gathered (in backward: re-gathered): issue the ``depth`` after it."""
        if running_backward():
            if not bucket.tag.reshard_after_forward:
                return  # zero2: served from what forward kept, no collective
            self.backward_order.append(bucket)
            self._at_end.queue(self._end_backward)
            # each re-gathered once per backward, and only if forward left it to re-gather
            wanted = lambda b: b not in self.backward_order and b in self.will_regather  # noqa: E731
            scheduled = self._scheduled("backward", bucket)
            ahead = self._ahead(bucket, self.previous, wanted) if scheduled is None else [
                b for b in scheduled if wanted(b) and b.can_prefetch()]
        elif self.active:
            self.order.append(bucket)
            if bucket.tag.reshard_after_forward and gather_context() in _RECOMPUTED:
                self.will_regather[bucket] = True  # its region's recompute gathers it again
            scheduled = self._scheduled("forward", bucket)
            ahead = self._ahead(bucket, self.next, lambda b: True) if scheduled is None else [
                b for b in scheduled if b not in self.order and b.can_prefetch()]
        else:
            return
        if not tagged or not ahead:
            return
        if scheduled is None:
            for stale in [b for b, e in self.pending.items() if e.by == "learned" and b not in ahead]:
                self.pending.pop(stale).wait()  # the order changed
        with sac_hidden(), torch.no_grad():
            for following in ahead:
                if following not in self.pending:
                    self.pending[following] = following.issue_all_gather(
                        tagged, by="learned" if scheduled is None else "scheduled")

    def unshard(self, bucket) -> Prefetched | None:
        """Issue ``bucket``'s all-gather now, for its next gather (``fsdptag.unshard``)."""
        if bucket in self.pending or not bucket.can_prefetch():
            return self.pending.get(bucket)
        with sac_hidden(), torch.no_grad():
            entry = self.pending[bucket] = bucket.issue_all_gather(True, by="unshard")
        return entry

    def reshard(self, bucket) -> None:
        """Release ``bucket``'s all-gather issued ahead and not claimed, if any."""
        entry = self.pending.pop(bucket, None)
        if entry is not None:
            entry.wait()

    def _ahead(self, bucket, successor: dict, wanted) -> list:
        """The buckets among the ``depth`` that follow ``bucket`` in ``successor`` to
        prefetch now."""
        ahead = []
        for _ in range(self.depth):
            bucket = successor.get(bucket)
            if bucket is None:
                break
            if wanted(bucket) and bucket.can_prefetch():
                ahead.append(bucket)
        return ahead

    def regather_packed(self, bucket) -> None:
        """fsdptag's zero3 hooks saved a re-gather handle of ``bucket`` (Note [zero3 by
        saved-tensor hooks] in ``_reshard.py``): backward will re-gather it."""
        self.will_regather[bucket] = True

    def pre_forward(self) -> None:
        self._drain()
        if not self.next:
            order = self.default_order()
            self.next = dict(zip(order, order[1:]))
        self.active, self.order, self.will_regather = True, [], {}

    def post_forward(self) -> None:  # also when forward raised
        self.active = False
        if self.order:
            self.next = _successors(self.order)
            if not self.previous:  # no backward yet: guess its order, this forward's reversed
                self.previous = _successors([b for b in reversed(self.order) if b in self.will_regather])
        self._drain()

    def _end_backward(self) -> None:
        if self.backward_order:
            self.previous = _successors(self.backward_order)
            self.backward_order = []
        self._drain()

    def _drain(self) -> None:
        """Wait out and release the unclaimed prefetches; ``fsdptag.unshard``'s stay."""
        for bucket in [b for b, e in self.pending.items() if e.by != "unshard"]:
            self.pending.pop(bucket).wait()


def _successors(order: list) -> dict:
    """Each bucket's successor in ``order``, by its first appearance (a bucket gathered
    twice, by a user's own region inside it, keeps its first place)."""
    first = list(dict.fromkeys(order))
    return dict(zip(first, first[1:]))
