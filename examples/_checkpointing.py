"""Checkpoints for ``train_llama.py`` that a crash cannot spoil: DCP save (sync or async),
a completion marker written last, resume from the newest complete checkpoint, the
last K kept.

``--checkpoint-dir`` holds::

    step-6/           complete: DCP's files (one per rank), .metadata, and complete.json
    step-8.tmp/       a save in progress, or one that never finished (removed on the next start)
    step-4.corrupt/   was complete, but a file no longer matches complete.json (kept for inspection)

Note [Complete checkpoints]: a checkpoint is written to ``step-N.tmp``. When DCP's
save returns on rank 0 (for an async save: when its future completes), every rank has
written and fsynced its file and rank 0 has written ``.metadata``: DCP gathers every
rank's write result before it writes the metadata. Only then does rank 0 write
``complete.json`` (each file's size and sha256, the step, and the settings the
checkpoint depends on) and rename the directory to ``step-N``. So a ``step-N`` exists
only for a save that finished, and on start the newest is checked against its
``complete.json`` before anything is loaded: a truncated or corrupted file is found
before DCP reads it, and the next newest is tried. Old checkpoints are removed only
after a newer one is complete; a failed save removes nothing but its own ``.tmp``.

Note [Async save]: ``dcp.async_save`` copies the state dict to CPU memory (the only
part the training loop waits for) and writes it from a background thread, over a gloo
process group of its own so that its collectives never interleave with the training's.
One save is in flight at a time: the next save, and the end of the run, first wait
for it, and that is where its failure is raised, on every rank (DCP reports one rank's
write error to all ranks). The copy is ours (``_CPUCopy``): torch's stagers deep-copy
a DTensor through its storage, which fails ("invalid python storage") for a DTensor
whose local tensor starts inside a larger buffer, as fsdptag's bucketed shards do
(``storage_offset() > 0``), and would copy the whole buffer per parameter if it worked.

Note [State dicts without gathers]: torch's ``get_state_dict`` / ``set_state_dict``
find each parameter's name by ``getattr`` along its path, and on a parametrized model
that access all-gathers the parameter, only to discard it: 63 FSDP all-gathers for
the 21 parameters of the default model, 0.14 s per save on 2 CPU ranks (0.2-0.4 s at
dim 256 with 4 blocks). Under ``fsdptag.disable_active_parametrization()`` the same
walk sees the stored sharded parameters: the same state dict, no collective. Each
"saved" log line counts the FSDP all-gathers taking the state dict issued.
"""

from __future__ import annotations

import enum
import hashlib
import io
import json
import os
import random
import re
import shutil
import stat
import tempfile
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import fsdptag
from fsdptag.debug import CollectiveCounter

from _faults import Fault, storage_writer

__all__ = ["CheckpointError", "CheckpointPolicy", "Checkpointer", "MARKER", "SaveMode", "find_problem",
           "prepare_dir"]

MARKER = "complete.json"
_STEP = re.compile(r"step-(\d+)")
_TMP = re.compile(r"step-(\d+)\.tmp")


class SaveMode(enum.Enum):
    SYNC = "sync"
    ASYNC = "async"


class CheckpointError(Exception):
    """A checkpoint problem; the message names the fix. Complete checkpoints are left as they were."""


@dataclass(frozen=True)
class CheckpointPolicy:
    """Where, how often and how (sync or async) to save, and how many complete checkpoints to keep."""

    root: str
    every: int
    keep_last: int
    mode: SaveMode

    def __post_init__(self) -> None:
        if self.every < 1:
            raise CheckpointError(f"--checkpoint-every {self.every} must be at least 1")
        if self.keep_last < 1:
            raise CheckpointError(f"--keep-last {self.keep_last} must be at least 1 (the newest checkpoint)")


def prepare_dir(root: str) -> str:
    """The absolute checkpoint directory, created if only its last component is missing.

    Fails with the fix when its parent is missing (a mistyped path would otherwise
    start a fresh run silently) or when it cannot be written.
    """
    root = os.path.abspath(root)
    parent = os.path.dirname(root)
    if not os.path.isdir(parent):
        raise CheckpointError(f"--checkpoint-dir {root}: its parent {parent} does not exist; "
                              f"create it (mkdir -p {parent}) or fix the path")
    if os.path.exists(root) and not os.path.isdir(root):
        raise CheckpointError(f"--checkpoint-dir {root} is a file; pass a directory")
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"--checkpoint-dir {root} cannot be created ({e}); "
                              f"make {parent} writable or pass another --checkpoint-dir") from e
    mode = stat.S_IMODE(os.stat(root).st_mode)
    # No write bit counts as read-only even for root, whom the kernel would let write.
    if mode & 0o222 == 0 or not _can_write(root):
        raise CheckpointError(f"--checkpoint-dir {root} is read-only (mode {mode:o}); make it writable "
                              f"(chmod u+w {root}) or pass another --checkpoint-dir")
    return root


def _can_write(root: str) -> bool:
    try:
        fd, probe = tempfile.mkstemp(dir=root, prefix=".write-probe-")
    except OSError:
        return False
    os.close(fd)
    os.remove(probe)
    return True


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def find_problem(path: str) -> str | None:
    """Why checkpoint ``path`` must not be loaded, or None when every file matches its
    ``complete.json`` (Note [Complete checkpoints])."""
    try:
        with open(os.path.join(path, MARKER)) as f:
            files = json.load(f)["files"]
    except FileNotFoundError:
        return f"no {MARKER}: its save did not finish"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MARKER} is unreadable ({type(e).__name__}: {e})"
    for name, (size, digest) in sorted(files.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{name} is missing"
        if os.path.getsize(file) != size:
            return f"{name} has {os.path.getsize(file)} bytes, {MARKER} says {size} (truncated)"
        if _sha256(file) != digest:
            return f"{name} does not match its sha256 in {MARKER} (corrupted)"
    return None


def _complete_steps(root: str) -> list[int]:
    return sorted(int(m.group(1)) for name in os.listdir(root) if (m := _STEP.fullmatch(name))
                  and os.path.exists(os.path.join(root, name, MARKER)))


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def _cause(e: CheckpointException) -> str:
    return "; ".join(f"rank {r}: {type(err[0]).__name__}: {err[0]}" for r, err in sorted(e.failures.items()))


@dataclass
class _Save:
    """One save: its directories, and (rank 0) whether its commit failed."""

    step: int
    tmp: str
    final: str
    gathers: int  # FSDP all-gathers while taking the state dict (Note [State dicts without gathers])
    done: threading.Event = field(default_factory=threading.Event)
    future: Future | None = None
    commit_error: str | None = None


class Checkpointer:
    """Saves and resumes one run's checkpoints (Notes [Complete checkpoints], [Async save]).

    Every method runs on every rank at the same point of the program. ``fingerprint``
    holds the settings a checkpoint is only valid for (model shape, data order), keyed
    by the flags that set them; ``hints`` turns a checkpoint's value of one into the
    flags that would match it; ``log`` prints on rank 0.

    Example::

        ckpt = Checkpointer(CheckpointPolicy("/tmp/run", 10, 3, SaveMode.ASYNC), {"--dim": 64}, log=print)
        state = ckpt.resume(model, optim)          # None, or the train_state dict of the newest one
        ckpt.save(step, model, optim, {"step": step})
        ckpt.close()                               # waits for the save in flight
    """

    def __init__(self, policy: CheckpointPolicy, fingerprint: dict, *, log: Callable[[str], None],
                 hints: dict[str, Callable[[object], str]] | None = None, faults: Sequence[Fault] = ()) -> None:
        self.policy, self.fingerprint, self.faults = policy, fingerprint, tuple(faults)
        self.hints = hints or {}
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.log = log if self.rank == 0 else (lambda msg: None)
        self.group = dist.new_group(backend="gloo")  # Note [Async save]
        self.last_complete: str | None = None
        self._in_flight: _Save | None = None

    def is_due(self, step: int, last_step: int) -> bool:
        return step % self.policy.every == 0 or step == last_step

    # ------------------------------------------------------------ resume

    def resume(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict | None:
        """Load the newest complete checkpoint into ``model`` and ``optim`` (restoring each
        rank's RNG state) and return its train state, or None when there is none."""
        choice = [self._choose() if self.rank == 0 else None]
        dist.broadcast_object_list(choice, src=0)
        kind, path = choice[0]
        if kind == "error":
            raise CheckpointError(path)
        if kind == "none":
            return None
        with fsdptag.disable_active_parametrization():  # Note [State dicts without gathers]
            msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd, "train_state": io.BytesIO(), "rng": io.BytesIO()}
        try:
            dcp.load(state, checkpoint_id=path)
        except CheckpointException as e:
            raise CheckpointError(
                f"loading {path} failed ({_cause(e)}); it does not fit this run's model: rerun with the "
                f"settings it was written with, or pass another --checkpoint-dir (nothing was changed)") from e
        with fsdptag.disable_active_parametrization():
            set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self._restore_rng(state["rng"], path)
        self.last_complete = path
        train_state = json.loads(state["train_state"].getvalue())
        self.log(f"checkpoint: resumed from {path} (step {train_state['step']})")
        return train_state

    def _choose(self) -> tuple[str, str | None]:
        """Rank 0: ("load", path) for the newest complete checkpoint, ("none", None), or
        ("error", message). Removes never-finished saves, moves corrupted ones aside."""
        root = self.policy.root
        try:
            for name in sorted(os.listdir(root)):
                if _TMP.fullmatch(name):
                    self.log(f"checkpoint: skipping {os.path.join(root, name)}: no {MARKER}, its save did "
                             f"not finish (killed mid-save?); removing it")
                    shutil.rmtree(os.path.join(root, name))
            steps = sorted((int(m.group(1)) for n in os.listdir(root) if (m := _STEP.fullmatch(n))), reverse=True)
            for step in steps:
                path = os.path.join(root, f"step-{step}")
                problem = find_problem(path)
                if problem is None:
                    return self._check_fingerprint(path)
                aside = _free_name(path + ".corrupt")
                self.log(f"checkpoint: skipping {path}: {problem}; moved to {aside}, never loaded")
                os.rename(path, aside)
        except OSError as e:
            return "error", (f"reading checkpoints in {root} failed ({e}); fix the directory or pass another "
                             f"--checkpoint-dir")
        self.log(f"checkpoint: no complete checkpoint in {root}; starting at step 0")
        return "none", None

    def _check_fingerprint(self, path: str) -> tuple[str, str]:
        with open(os.path.join(path, MARKER)) as f:
            saved = json.load(f).get("config", {})
        differ = [k for k, v in self.fingerprint.items() if saved.get(k) != v]
        if not differ:
            return "load", path
        diffs = "; ".join(f"{k} {saved.get(k)!r} there, {self.fingerprint[k]!r} here" for k in differ)
        fixes = " ".join(self.hints[k](saved.get(k)) if k in self.hints else f"{k} {saved.get(k)}" for k in differ)
        return "error", (f"{path} was written with other settings: {diffs}. To continue it, rerun with "
                         f"{fixes}; to start over, pass another --checkpoint-dir (nothing was loaded or deleted)")

    def _restore_rng(self, blob: io.BytesIO, path: str) -> None:
        states = torch.load(io.BytesIO(blob.getvalue()), weights_only=True)
        if len(states) != self.world:
            self.log(f"checkpoint: {path} holds the RNG states of {len(states)} ranks and this run has "
                     f"{self.world}; RNG states are per rank and cannot be resharded, so every rank keeps "
                     f"its seeded state (this program draws no random numbers after initialization)")
            return
        mine = states[self.rank]
        torch.set_rng_state(mine["torch"])
        random.setstate(_as_python_state(mine["python"]))
        if mine["cuda"]:
            torch.cuda.set_rng_state_all(mine["cuda"])

    # ------------------------------------------------------------ save

    def save(self, step: int, model: torch.nn.Module, optim: torch.optim.Optimizer, train_state: dict) -> float:
        """Save checkpoint ``step-{step}``; return the seconds the caller was blocked
        (for an async save: waiting for the previous one and copying to CPU memory)."""
        t0 = time.perf_counter()
        self.wait()
        final = os.path.join(self.policy.root, f"step-{step}")
        if os.path.exists(final):
            raise CheckpointError(f"{final} exists already and is not overwritten; move it away or pass "
                                  f"another --checkpoint-dir")
        with CollectiveCounter() as cc:
            state = self._state_dict(model, optim, train_state)
        job = _Save(step, final + ".tmp", final, cc.count(kind="all_gather", fsdp_tagged=True))
        writer = storage_writer(self.faults, job.tmp, step, self.rank)
        if self.policy.mode is SaveMode.ASYNC:
            job.future = dcp.async_save(state, storage_writer=writer, process_group=self.group,
                                        async_stager=_CPUCopy())
            job.future.add_done_callback(lambda f: self._on_done(job, f))
            self._in_flight = job
        else:
            job.future = Future()
            try:
                dcp.save(state, storage_writer=writer, process_group=self.group)
                job.future.set_result(None)
            except CheckpointException as e:
                job.future.set_exception(e)
            self._on_done(job, job.future)
            self._in_flight = job
            self.wait()
        return time.perf_counter() - t0

    def _state_dict(self, model: torch.nn.Module, optim: torch.optim.Optimizer, train_state: dict) -> dict:
        """What a checkpoint holds: sharded model and optimizer states, every rank's RNG
        state (gathered: DCP would keep one copy of a plain tensor), the train state."""
        rng: list = [None] * self.world
        dist.all_gather_object(rng, _rng_state())
        rng_blob = io.BytesIO()
        torch.save(rng, rng_blob)
        with fsdptag.disable_active_parametrization():  # Note [State dicts without gathers]
            msd, osd = get_state_dict(model, optim)
        return {"model": msd, "optim": osd, "rng": rng_blob,
                "train_state": io.BytesIO(json.dumps(train_state).encode())}

    def _on_done(self, job: _Save, future: Future) -> None:
        try:
            if self.rank == 0 and future.exception() is None:
                self._commit(job)
        except Exception as e:  # runs in DCP's thread: wait() raises it on every rank
            job.commit_error = (f"completing {job.final} failed ({type(e).__name__}: {e}); "
                                f"{self._last_good()} is untouched; fix the checkpoint volume or pass "
                                f"another --checkpoint-dir")
        finally:
            job.done.set()

    def wait(self) -> None:
        """Wait for the save in flight; raise its error (on every rank) if it failed."""
        job, self._in_flight = self._in_flight, None
        if job is None:
            return
        try:
            job.future.result()
        except CheckpointException as e:
            job.done.wait()
            raise self._failed(job, e) from e
        job.done.wait()
        outcome = [job.commit_error]
        dist.broadcast_object_list(outcome, src=0)
        if outcome[0] is not None:
            raise CheckpointError(outcome[0])

    def close(self) -> None:
        self.wait()

    def _failed(self, job: _Save, e: CheckpointException) -> CheckpointError:
        if self.rank == 0:
            shutil.rmtree(job.tmp, ignore_errors=True)
        return CheckpointError(
            f"saving {job.final} failed ({_cause(e)}). {_sentence(self._last_good())} is untouched and the partial "
            f"{job.tmp} was removed. Free space on the checkpoint volume (or pass another "
            f"--checkpoint-dir) and rerun: the run resumes from its newest complete checkpoint")

    def _last_good(self) -> str:
        return f"the last good checkpoint {self.last_complete}" if self.last_complete else "no earlier checkpoint"

    def _commit(self, job: _Save) -> None:
        """Rank 0, once every rank's files and .metadata are written: the marker, then the rename."""
        files = {}
        for name in sorted(os.listdir(job.tmp)):
            path = os.path.join(job.tmp, name)
            files[name] = [os.path.getsize(path), _sha256(path)]
        info = {"step": job.step, "files": files, "config": self.fingerprint, "world_size": self.world,
                "mode": self.policy.mode.value, "saved_at": time.strftime("%Y-%m-%d %H:%M:%S")}
        marker = os.path.join(job.tmp, MARKER)
        with open(marker + ".tmp", "w") as f:
            json.dump(info, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.rename(marker + ".tmp", marker)
        os.rename(job.tmp, job.final)
        _fsync_dir(self.policy.root)
        self.last_complete = job.final
        size = sum(s for s, _ in files.values())
        self.log(f"checkpoint: saved {job.final} ({self.policy.mode.value}, {size / 2**10:.0f} KiB, "
                 f"{job.gathers} FSDP all-gathers)")
        for step in _complete_steps(self.policy.root)[: -self.policy.keep_last]:
            old = os.path.join(self.policy.root, f"step-{step}")
            shutil.rmtree(old)
            self.log(f"checkpoint: removed {old} (--keep-last {self.policy.keep_last})")


class _CPUCopy(AsyncStager):
    """Stages a state dict for an async save: a CPU copy of each tensor's own elements
    (Note [Async save])."""

    _synchronize_after_execute = False

    def stage(self, state_dict):
        return _cpu_copy(state_dict)


def _cpu_copy(obj):
    if isinstance(obj, torch.Tensor):  # a DTensor copies its local tensor, no collective
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_copy(v) for v in obj)
    if isinstance(obj, io.BytesIO):
        return io.BytesIO(obj.getvalue())
    return obj


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def _free_name(path: str) -> str:
    candidate, n = path, 1
    while os.path.exists(candidate):
        candidate, n = f"{path}-{n}", n + 1
    return candidate


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _as_python_state(state):
    """``random.setstate`` wants tuples; a saved state may come back with lists."""
    version, internal, gauss = state
    return version, tuple(internal), gauss
