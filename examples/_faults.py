"""Injected faults for ``train_llama.py``: the failures a fault-tolerant run must survive.

``--fault KIND@STEP`` strikes rank ``--fault-rank`` (default 1); steps count from 1,
as printed. Repeat ``--fault`` to fail again after a restart: the first is armed in
torchrun's first attempt, the second in the first restart, and so on (run torchrun
with as many ``--max-restarts``).

=================  ==================================================================
``exit@K``         the rank exits (``os._exit(1)``, like a crash) at the start of step K
``kill-in-save@K`` the rank writes its part of checkpoint ``step-K``, truncates the
                   file to half and exits: a save killed midway
``disk-full@K``    the rank's checkpoint writer raises ``ENOSPC`` while saving ``step-K``
=================  ==================================================================
"""

from __future__ import annotations

import enum
import errno
import os
from dataclasses import dataclass
from typing import Sequence

from torch.distributed.checkpoint import FileSystemWriter

__all__ = ["Fault", "FaultKind", "exit_if_struck", "storage_writer"]


class FaultKind(enum.Enum):
    EXIT = "exit"
    KILL_IN_SAVE = "kill-in-save"
    DISK_FULL = "disk-full"


@dataclass(frozen=True)
class Fault:
    """One injected fault: what, at which step, on which rank, in which torchrun attempt."""

    kind: FaultKind
    step: int
    rank: int = 1
    attempt: int = 0

    @classmethod
    def parse(cls, text: str, rank: int, attempt: int) -> "Fault":
        """``"exit@5"`` -> ``Fault(FaultKind.EXIT, 5, rank, attempt)``."""
        kind, _, step = text.partition("@")
        kinds = ", ".join(f"{k.value}@STEP" for k in FaultKind)
        if kind not in {k.value for k in FaultKind} or not step.isdigit() or int(step) < 1:
            raise ValueError(f"--fault {text!r}: use one of {kinds} with STEP >= 1, e.g. --fault exit@5")
        return cls(FaultKind(kind), int(step), rank, attempt)

    def strikes(self, kind: FaultKind, step: int, rank: int) -> bool:
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        return (self.kind, self.step, self.rank, self.attempt) == (kind, step, rank, attempt)


def exit_if_struck(faults: Sequence[Fault], step: int, rank: int) -> None:
    """Step ``step`` is about to run on ``rank``: die here if a fault says so."""
    if any(f.strikes(FaultKind.EXIT, step, rank) for f in faults):
        print(f"fault: rank {rank} exits at the start of step {step} (injected)", flush=True)
        os._exit(1)


def storage_writer(faults: Sequence[Fault], path: str, step: int, rank: int) -> FileSystemWriter:
    """The DCP storage writer for checkpoint ``step-{step}``: DCP's own, unless a fault hits this save."""
    for kind in (FaultKind.KILL_IN_SAVE, FaultKind.DISK_FULL):
        if any(f.strikes(kind, step, rank) for f in faults):
            return _FaultyWriter(path, kind, rank)
    return FileSystemWriter(path)


class _FaultyWriter(FileSystemWriter):
    """DCP's file writer, failing the way ``kind`` says once its rank's data is (being) written."""

    def __init__(self, path: str, kind: FaultKind, rank: int) -> None:
        super().__init__(path)
        self.kind, self.fault_rank = kind, rank

    def write_data(self, plan, planner):
        if self.kind is FaultKind.DISK_FULL:
            raise OSError(errno.ENOSPC, "No space left on device (injected by --fault disk-full)", str(self.path))
        written = super().write_data(plan, planner).wait()
        name = written[0].storage_data.relative_path
        full = os.path.join(self.path, name)
        with open(full, "r+b") as f:
            f.truncate(os.path.getsize(full) // 2)
        print(f"fault: rank {self.fault_rank} killed while saving {self.path} ({name} truncated; injected)",
              flush=True)
        os._exit(1)
