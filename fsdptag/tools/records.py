"""The tools' records: an estimate, a configuration to estimate, the planner's rows and
plan, and the rates its time proxy divides by (Note [Time proxy] in ``plan.py``). The
modules that make them (``estimate.py``, ``plan.py``) and those that read them
(``report.py``, ``overlap.py``) all import them from here."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .._api import ReshardPolicy

__all__ = ["Candidate", "MemoryEstimate", "Plan", "Rates", "Row", "StepConfig", "speed_key"]


@dataclass
class MemoryEstimate:
    policy: str
    model: str
    world_size: int
    tp: int
    hsdp_replicas: int
    reshard_after_forward: bool | int | dict[str, bool | int]  # True = zero3, k: partial; a dict: per prefix
    ac: str
    mp: str
    seq_len: int
    batch: int
    microbatches: int  # forward+backward per optimizer step, all but the last without gradient sync
    peak_bytes: int
    param_bytes: int  # this rank's shards of the stored parameters
    gathered_param_bytes: int  # FSDP-gathered parameters kept for backward
    grad_bytes: int
    optimizer_bytes: int
    unsynced_grad_bytes: int  # microbatches > 1: gradients accumulated without sync, at the syncing backward
    activation_bytes: int  # everything forward keeps for backward (gathered params included)
    kept_collective_bytes: int  # of which: outputs of TP (non-FSDP) collectives
    kept_cast_bytes: int  # of which: activation casts (_to_copy)
    # The step's collectives: on the data-parallel mesh dims (fsdp_, all_reduce: HSDP's
    # replicate dim) and on the TP dim (tp_); an all-gather's output, anything else's input.
    fsdp_all_gather_bytes: int
    fsdp_partial_all_gather_bytes: int  # backward re-gathers over k-rank groups (reshard_after_forward=k)
    fsdp_reduce_scatter_bytes: int
    fsdp_all_reduce_bytes: int
    tp_all_gather_bytes: int
    tp_reduce_scatter_bytes: int
    tp_all_reduce_bytes: int
    other_collective_bytes: int  # all-to-all, broadcast
    forward_flops: int
    backward_flops: int  # the gradients (recompute excluded)
    recompute_flops: int  # forward ops the backward re-runs (activation checkpointing)
    # the collectives' issues and waits in dispatch order with the FLOPs between
    # (Note [Exposed communication]); left out of JSON output (see ``report``)
    timeline: tuple = field(default=(), repr=False)

    def report(self) -> dict:
        """The fields as a dict for JSON, without the timeline."""
        out = asdict(self)
        del out["timeline"]
        return out


@dataclass(frozen=True)
class StepConfig:
    """One configuration to estimate (see :func:`estimate` for the fields;
    ``reshard_after_forward`` may also be ``"keep-last"``: the planner's zero3-keep-last)."""

    tp: int = 1
    hsdp_replicas: int = 1
    reshard_after_forward: ReshardPolicy = True
    ac: str = "none"
    mp: str = "bf16"
    batch: int = 1
    policy: str = "tagged"
    microbatches: int = 1


@dataclass(frozen=True)
class Rates:
    """What the time proxy divides by (Note [Time proxy]), per GPU."""

    bandwidth: float = 50e9  # bytes/s, data-parallel collectives
    tp_bandwidth: float = 450e9  # bytes/s, TP collectives
    partial_bandwidth: float = 450e9  # bytes/s, partial reshard's k-group re-gathers (within a node)
    device_flops: float = 400e12  # FLOP/s
    overlap: bool = True  # False: comm_s + compute_s (--no-overlap)


@dataclass(frozen=True)
class Candidate:
    zero: str  # one of plan.ZERO_MODES
    ac: str  # one of AC_MODES
    tp: int
    batch: int  # sequences per data-parallel rank and microbatch
    hsdp: int = 1  # HSDP replicas (1: fully sharded over every data-parallel rank)
    microbatches: int = 1  # forward+backward per optimizer step, all but the last without gradient sync


@dataclass
class Row:
    candidate: Candidate
    estimate: MemoryEstimate
    comm_s: float  # every collective's time, summed
    compute_s: float
    fits: bool
    pareto: bool = False
    exposed_s: float | None = None  # what compute does not hide; None: --no-overlap

    @property
    def step_s(self) -> float:
        return self.compute_s + (self.comm_s if self.exposed_s is None else self.exposed_s)

    @property
    def us_per_token(self) -> float:
        """GPU microseconds per token: the comparison key (Note [Time proxy])."""
        e = self.estimate
        return 1e6 * self.step_s * e.tp / (e.batch * e.microbatches * e.seq_len)


@dataclass
class Plan:
    model: str
    world_size: int
    memory_bytes: int
    rates: Rates
    rows: list[Row]  # every configuration estimated, in the order run
    skipped: list[str] = field(default_factory=list)  # TP degrees that could not run, and why
    keep_last: dict[str, bool] | None = None  # zero3-keep-last's reshard_after_forward
    tp_plan: str | None = None  # the TP plan's qualified name

    @property
    def pareto(self) -> list[Row]:
        """The configurations that fit and that nothing beats in both memory and time, fastest first."""
        return sorted((r for r in self.rows if r.pareto), key=speed_key)

    @property
    def recommended(self) -> Row | None:
        front = self.pareto
        return front[0] if front else None


def speed_key(r: Row) -> tuple[float, int]:
    """Fastest first, then the smallest peak."""
    return (r.us_per_token, r.estimate.peak_bytes)
