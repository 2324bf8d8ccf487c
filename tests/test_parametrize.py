"""Multi-rank specification of ``fsdptag.parametrize`` (gloo, CPU).

Each launch runs many cases and returns a dict; the tests below assert on it.
"""

from __future__ import annotations

import collections
import functools
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from expecttest import assert_expected_inline
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import fsdptag
from fsdptag._prefetch import is_served
from fsdptag import FSDPTaggedTensor
from fsdptag._scopes import open_scopes
from fsdptag._state import module_state
from fsdptag.debug import CollectiveCounter, LiveStorageTracker

from . import models
from .harness import launch, parametrize_error, result, run_cases

STEPS = 5


# ---------------------------------------------------------------- cases


def _block_buckets(fqn, module):
    """Bucket roots: each block, and the root for the rest (one gather per block)."""
    return isinstance(module, models.Block) or fqn == ""


BUCKETS = {"param": "param", "module": "module", "block": _block_buckets}
c10d = torch.ops._c10d_functional


def _parity(mesh, mode, reshard, *, dp_rank, dp_size, tp_mesh=None, mp=None, bucket="param"):
    ref = models.make_net()
    model = models.clone(ref)
    if tp_mesh is not None:
        for block in model.layers:
            parallelize_module(block, tp_mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    fsdptag.parametrize(model, mesh, mode=mode, reshard_after_forward=reshard, mp_policy=mp,
                        bucket=BUCKETS[bucket])
    ref_losses = models.train_reference(ref, STEPS, dp_size, dp_rank)
    losses, optim = models.train_parallel(model, STEPS, dp_size, dp_rank)
    leaks = _tagged_leaks(model, optim)
    return {
        "loss": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
        "params": models.max_rel_diff(models.full_params(model), models.full_params(ref)),
        "leaks": leaks,
    }


def _tagged_leaks(model, optim) -> list[str]:
    """Names of places where an FSDPTaggedTensor is reachable after training."""
    found = []

    def check(where, t):
        if isinstance(t, torch.Tensor) and fsdptag.is_fsdp_tagged(t):
            found.append(where)

    for n, p in model.named_parameters():
        check(f"param {n}", p)
        check(f"grad {n}", p.grad)
        for k, v in optim.state[p].items():
            check(f"optim {n}.{k}", v)
    for k, v in model.state_dict().items():
        check(f"state_dict {k}", v)
    return found


def _collectives(mesh, mode, reshard, *, tp_mesh=None, dp_rank=0, dp_size=1, bucket="param"):
    model = models.make_net()
    if tp_mesh is not None:
        for block in model.layers:
            parallelize_module(block, tp_mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    fsdptag.parametrize(model, mesh, mode=mode, reshard_after_forward=reshard, bucket=BUCKETS[bucket])
    tokens, targets = models.batch(0, dp_size)
    with CollectiveCounter(mesh) as cc:
        models.loss_fn(model(tokens[dp_rank]), targets[dp_rank]).backward()
    regathered = sorted(e.fqn for e in cc.events if e.phase == "backward" and e.fqn)
    assert len(regathered) == len(set(regathered)), regathered  # never twice
    return cc.summary() + (f"\nre-gathered: {' '.join(regathered)}" if regathered else "")


def _kept_bytes(mesh, reshard):
    """Bytes forward keeps for backward, and the peak during forward."""
    model = models.make_net()
    fsdptag.parametrize(model, mesh, mode="fully_shard", reshard_after_forward=reshard)
    tokens, targets = models.batch(0, mesh.size())
    kept, peaks, backward_peaks = set(), set(), set()
    for _ in range(3):  # the same every time: the tracker settles gloo's late frees
        with LiveStorageTracker(track_peak=True, settle_collectives=True) as mem:
            loss = models.loss_fn(model(tokens[mesh.get_local_rank()]), targets[mesh.get_local_rank()])
        kept.add(mem.live_bytes())
        assert mem.settle_timeouts == 0
        peaks.add(mem.peak_bytes)
        with LiveStorageTracker(track_peak=True, settle_collectives=True) as mem:
            loss.backward()  # zero3: each re-gathered bucket dropped after its last use
        backward_peaks.add(mem.peak_bytes)
        assert mem.settle_timeouts == 0
        del loss
        for p in model.parameters():
            p.grad = None
    return sorted(kept), sorted(peaks), sorted(backward_peaks)


def _after_retained_backward(mesh):
    """Bytes that storages made in backward still hold after ``backward(retain_graph=True)``:
    the gradients, and for zero3 nothing of its re-gathers (each dropped after its last use
    even though the graph, and so its saved handles, stays alive)."""
    out = {}
    for reshard in (False, True):
        model = models.make_net()
        fsdptag.parametrize(model, mesh, mode="fully_shard", reshard_after_forward=reshard)
        tokens, targets = models.batch(0, mesh.size())
        loss = models.loss_fn(model(tokens[mesh.get_local_rank()]), targets[mesh.get_local_rank()])
        with LiveStorageTracker(settle_collectives=True) as mem:
            loss.backward(retain_graph=True)
        out[f"zero{3 if reshard else 2}"] = mem.live_bytes()
        assert mem.settle_timeouts == 0
        del loss
    return out


def _weights_backward_needs() -> int:
    """Bytes of the gathered params whose value backward uses: all but the embedding
    table and the linear biases (LayerNorm's backward saves its bias too)."""
    net = models.make_net()
    linear_biases = {f"{fqn}.bias" for fqn, m in net.named_modules() if isinstance(m, nn.Linear)}
    return sum(p.numel() * p.element_size() for n, p in net.named_parameters()
               if n not in linear_biases and not n.startswith("tok."))


def _bf16_vs_fsdp2(mesh):
    from torch.distributed.fsdp import MixedPrecisionPolicy as FSDP2MP, fully_shard

    dp_rank, dp_size = mesh.get_local_rank(), mesh.size()
    ours, theirs = models.make_net(), models.make_net()
    fsdptag.parametrize(ours, mesh, mode="fully_shard", reshard_after_forward=True,
                        mp_policy=fsdptag.MixedPrecisionPolicy(torch.bfloat16, torch.float32))
    mp2 = FSDP2MP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in theirs.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp2)
    fully_shard(theirs, mesh=mesh, mp_policy=mp2)
    losses, _ = models.train_parallel(ours, STEPS, dp_size, dp_rank)
    losses2, _ = models.train_parallel(theirs, STEPS, dp_size, dp_rank)
    return {
        "loss": max(abs(a - b) / abs(b) for a, b in zip(losses, losses2)),
        "params": models.max_rel_diff(models.full_params(ours), models.full_params(theirs)),
    }


def _no_sync(mesh, r):
    """Note [Accumulation without sync]: 3 microbatches, fp32; gradients of the synced
    step vs FSDP2 with ``set_requires_gradient_sync(False)`` (bitwise) and vs syncing
    every microbatch (reduce-then-sum: equal up to rounding)."""
    from torch.distributed.fsdp import fully_shard

    out = {}
    for zero in (2, 3):
        for ac in ("none", "full"):
            grads = {}
            for variant in ("no_sync", "sync", "fsdp2"):
                model = models.make_net()
                if variant == "fsdp2":
                    for block in model.layers:
                        fully_shard(block, mesh=mesh, reshard_after_forward=zero == 3)
                    fully_shard(model, mesh=mesh, reshard_after_forward=zero == 3)
                    if ac == "full":
                        for block in model.layers:
                            block.forward = functools.partial(
                                torch.utils.checkpoint.checkpoint, block.forward, use_reentrant=False)
                else:
                    fsdptag.parametrize(model, mesh, mode="fully_shard", reshard_after_forward=zero == 3)
                    fsdptag.apply_ac(model, ac)
                for step in range(3):
                    sync = variant == "sync" or step == 2
                    if variant == "fsdp2":
                        model.set_requires_gradient_sync(sync)
                    else:
                        fsdptag.set_requires_gradient_sync(model, sync)
                    tokens, targets = models.batch(step, 2)
                    models.loss_fn(model(tokens[r]), targets[r]).backward()
                grads[variant] = [p.grad.to_local() for p in model.parameters()]
            fsdp2 = all(torch.equal(a, b) for a, b in zip(grads["no_sync"], grads["fsdp2"]))
            rel = max(((a - b).abs().max() / b.abs().max()).item()
                      for a, b in zip(grads["no_sync"], grads["sync"]))
            each = ("bitwise" if all(torch.equal(a, b) for a, b in zip(grads["no_sync"], grads["sync"]))
                    else "rel < 1e-6" if rel < 1e-6 else f"rel {rel}")
            out[f"zero{zero} {ac}"] = f"bitwise FSDP2: {fsdp2}, vs syncing each: {each}"
    return out


def _no_sync_tp(mesh, dp_rank):
    """Note [Accumulation without sync] under FSDP x TP (dp 2 x tp 2): 3 microbatches,
    the last syncs; gradients vs FSDP2 with the same TP plan and setting, and vs
    syncing every microbatch."""
    from torch.distributed.fsdp import fully_shard

    plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    out = {}
    for zero in (2, 3):
        grads = {}
        for variant in ("no_sync", "sync", "fsdp2"):
            model = models.make_net()
            for block in model.layers:
                parallelize_module(block, mesh["tp"], plan)
            if variant == "fsdp2":
                for block in model.layers:
                    fully_shard(block, mesh=mesh["dp"], reshard_after_forward=zero == 3)
                fully_shard(model, mesh=mesh["dp"], reshard_after_forward=zero == 3)
            else:
                fsdptag.parametrize(model, mesh, reshard_after_forward=zero == 3)
            for step in range(3):
                sync = variant == "sync" or step == 2
                if variant == "fsdp2":
                    model.set_requires_gradient_sync(sync)
                else:
                    fsdptag.set_requires_gradient_sync(model, sync)
                tokens, targets = models.batch(step, 2)
                models.loss_fn(model(tokens[dp_rank]), targets[dp_rank]).backward()
            grads[variant] = [p.grad.to_local() for p in model.parameters()]
        rel = {v: max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
                      for a, b in zip(grads["no_sync"], grads[v])) for v in ("sync", "fsdp2")}
        out[f"zero{zero}"] = {v: "bitwise" if all(torch.equal(a, b) for a, b in zip(grads["no_sync"], grads[v]))
                              else "rel < 1e-6" if r < 1e-6 else f"rel {r}" for v, r in rel.items()}
    return out


def _schedule(mesh, r):
    """Note [Explicit schedule]: ``prefetch=False`` with forward / backward prefetch lists
    and an ``unshard`` before each forward trains bitwise like the default."""
    out = {}
    for zero in (2, 3):
        for ac in ("none", "selective"):
            runs = {}
            for variant in ("default", "explicit"):
                model = models.make_net()
                fsdptag.parametrize(model, mesh, reshard_after_forward=zero == 3,
                                    prefetch=variant == "default")
                fsdptag.apply_ac(model, ac)
                if variant == "explicit":
                    l0, l1 = model.layers
                    fsdptag.set_modules_to_forward_prefetch(model, [l0])
                    fsdptag.set_modules_to_forward_prefetch(l0, [l1])
                    fsdptag.set_modules_to_backward_prefetch(model, [l1])
                    fsdptag.set_modules_to_backward_prefetch(l1, [l0])
                optim = models.make_optim(model)
                losses = []
                for step in range(2):
                    if variant == "explicit":
                        fsdptag.unshard(model, async_op=True)
                    tokens, targets = models.batch(step, 2)
                    loss = models.loss_fn(model(tokens[r]), targets[r])
                    loss.backward()
                    optim.step()
                    optim.zero_grad()
                    losses.append(loss.detach())
                runs[variant] = losses + [p.to_local() for p in model.parameters()]
            out[f"zero{zero} {ac}"] = all(torch.equal(a, b) for a, b in zip(runs["default"], runs["explicit"]))
    return out


def _reduce_bytes(mesh):
    """Bytes the backward's gradient reductions move, per path and mixed precision."""
    out = {}
    policies = {"fp32": None, "bf16/fp32": fsdptag.MixedPrecisionPolicy(torch.bfloat16, torch.float32),
                "bf16/bf16": fsdptag.MixedPrecisionPolicy(torch.bfloat16)}
    for mode, bucket in (("fully_shard", "param"), ("fully_shard", "block"), ("replicate", "param"),
                         ("replicate", "block")):
        for name, mp in policies.items():
            model = models.make_net()
            fsdptag.parametrize(model, mesh, mode=mode, mp_policy=mp, bucket=BUCKETS[bucket])
            tokens, targets = models.batch(0, 2)
            with CollectiveCounter(mesh) as cc:
                models.loss_fn(model(tokens[0]).float(), targets[0]).backward()
            out[f"{mode} bucket={bucket} {name}"] = sum(
                e.nbytes for e in cc.events if e.phase == "backward" and e.kind in ("reduce_scatter", "all_reduce"))
    return out


def _fsdp2_collectives(mesh):
    """The counter also sees FSDP2's in-place c10d collectives, labelled by mesh dim."""
    from torch.distributed.fsdp import fully_shard

    model = models.make_net()
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    tokens, targets = models.batch(0, 2)
    with CollectiveCounter(mesh) as cc:
        models.loss_fn(model(tokens[0]), targets[0]).backward()
    gathered = sum(e.nbytes for e in cc.events if e.phase == "forward" and e.kind == "all_gather")
    reduced = sum(e.nbytes for e in cc.events if e.kind == "reduce_scatter")
    return cc.summary(), gathered, reduced


class _Reuse(nn.Module):
    """Reads the same weights twice in one forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


def _gather_once(mesh):
    """Inside a bucket root's forward a parameter read twice is gathered (and kept) once."""
    out = {}
    x = torch.randn(3, 6)
    buckets = {"param": "param", "module": "module", "root": lambda fqn, m: fqn == ""}
    for name, bucket in buckets.items():
        torch.manual_seed(0)
        ref = _Reuse()
        model = fsdptag.parametrize(models.clone(ref), mesh, mode="fully_shard",
                                    reshard_after_forward=False, bucket=bucket)
        with CollectiveCounter(mesh) as cc:
            model(x).sum().backward()
        ref(x).sum().backward()
        same = torch.allclose(model.lin._parameters["weight"].grad.full_tensor(), ref.lin.weight.grad)
        out[name] = (cc.count("forward", "all_gather"), cc.count("backward", "reduce_scatter"), same)
    return out


class _ScaleInForward(nn.Module):
    """Modifies its gathered weight in place inside forward (a user error)."""

    def __init__(self, how: str | None) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.how = how  # "grad on" | "grad off" | "grad off, kept" | None: leave it alone
        self.kept = None

    def forward(self, x):
        if self.how is not None:
            w = self.lin.weight
            with torch.set_grad_enabled(self.how == "grad on"):
                w.mul_(2)
            if self.how.endswith("kept"):
                self.kept = w
        return self.lin(x)


def _in_place(mesh, mesh_tp):
    """An in-place op on a gathered parameter raises (autograd's error first when grad is
    on: the parameter is a view returned by a custom Function) and leaves the stored
    parameter alone; the model keeps working. A parameter gathered alone is checked
    at the end of forward if still alive (a modified copy nobody keeps is just lost).
    DDP without a cast hands out the stored parameter itself, as plain DDP does."""
    out = {}
    rows = [(bucket, how, "") for bucket in ("param", "block")
            for how in ("grad on", "grad off", "grad off, kept")]
    rows += [("block", "grad off", "no_grad forward"), ("param", "grad off, kept", "no_grad forward"),
             ("param", "grad on", "TP"), ("block", "grad on", "TP"),
             ("block", "grad off", "replicate"), ("param", "grad off", "replicate"),
             ("block", "grad on", "replicate"), ("param", "grad on", "replicate")]
    for bucket, how, extra in rows:
        torch.manual_seed(0)
        model = nn.Sequential(_ScaleInForward(how))
        if extra == "TP":
            parallelize_module(model[0], mesh_tp["tp"], {"lin": ColwiseParallel()})
        fsdptag.parametrize(model, mesh_tp if extra == "TP" else mesh,
                            mode="replicate" if extra == "replicate" else "fully_shard",
                            bucket=BUCKETS[bucket])
        before = model[0].lin._parameters["weight"].full_tensor().clone()
        try:
            if extra == "no_grad forward":
                with torch.no_grad():
                    model(torch.randn(2, 6))
            else:
                model(torch.randn(2, 6)).sum().backward()
            error = "no error"
        except RuntimeError as e:
            # torch 2.11 names the Function's node (``_HandoutBackward``), 2.13+ the Function
            error = re.sub(r"Output 0 of (\w+)Backward ", r"Output 0 of \1 ", str(e).split(". ")[0])
        model[0].how = model[0].kept = None
        model(torch.randn(2, 6)).sum().backward()
        same = torch.equal(before, model[0].lin._parameters["weight"].full_tensor())
        out[f"{bucket}, {how}{', ' + extra if extra else ''}"] = f"{error} | stored unchanged: {same}"
    return out


def _inference(mesh, r):
    """Forward under inference_mode gives what no_grad gives (nothing is tagged there:
    there is nothing to checkpoint), with and without a cast, per parameter and per block."""
    tokens, _ = models.batch(0, 2)
    out = {}
    for bucket in ("param", "block"):
        for mp in (None, fsdptag.MixedPrecisionPolicy(torch.bfloat16)):
            for zero in (2, 3):
                model = fsdptag.parametrize(models.make_net(), mesh, mode="fully_shard",
                                            reshard_after_forward=zero == 3, mp_policy=mp,
                                            bucket=BUCKETS[bucket])
                with torch.no_grad():
                    expected = model(tokens[r])
                with torch.inference_mode():
                    got = model(tokens[r])
                out[f"{bucket} {'bf16' if mp else 'fp32'} zero{zero}"] = torch.equal(expected, got)
    return out


def _state_dict_collectives(mesh):
    model = models.make_net()
    fsdptag.parametrize(model, mesh, mode="fully_shard")
    with CollectiveCounter(mesh) as cc:
        sd = model.state_dict()
    return {"collectives": len(cc.events), "types": sorted({type(v).__name__ for v in sd.values()})}


def _per_module_tags(mesh):
    model = models.make_net()
    fsdptag.parametrize(model, mesh, mode="fully_shard",
                        reshard_after_forward={"": True, "layers.0": False, "head": False})
    tags = {}
    for name in ("tok.weight", "layers.0.fc1.weight", "layers.1.fc1.weight", "head.weight"):
        module_name, _, attr = name.rpartition(".")
        tags[name] = fsdptag.get_fsdp_tag(getattr(model.get_submodule(module_name), attr))
    return {k: (t.fqn, t.reshard_after_forward) for k, t in tags.items()}


def _meta_init(mesh):
    with torch.device("meta"):
        model = models.Net()
    fsdptag.parametrize(model, mesh, mode="fully_shard")
    model.to_empty(device="cpu")
    with fsdptag.disable_active_parametrization():
        torch.manual_seed(0)
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
        stored_type = type(model.head.weight).__name__
    tokens, targets = models.batch(0, 1)
    loss = models.loss_fn(model(tokens[0]), targets[0])
    loss.backward()
    return {"stored": stored_type, "finite": bool(torch.isfinite(loss)),
            "grad": type(model.head._parameters["weight"].grad).__name__}


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _tagged_dispatches(mesh, r):
    """Ops that dispatch through FSDPTaggedTensor in one training step (Note [Marked
    handout]): only the gather path; compute on gathered weights runs on plain tensors."""
    counts = collections.Counter()
    original = FSDPTaggedTensor.__dict__["__torch_dispatch__"]

    def counting(cls, func, types, args=(), kwargs=None):
        counts[str(func)] += 1
        return original.__func__(cls, func, types, args, kwargs)

    out = {}
    tokens, targets = models.batch(0, 2)
    for zero, ac in ((2, "none"), (2, "selective"), (3, "none"), (3, "selective")):
        model = fsdptag.parametrize(models.make_net(), mesh, mode="fully_shard",
                                    reshard_after_forward=zero == 3,
                                    mp_policy=fsdptag.MixedPrecisionPolicy(torch.bfloat16))
        fsdptag.apply_ac(model, ac)
        counts.clear()
        FSDPTaggedTensor.__torch_dispatch__ = classmethod(counting)
        try:
            models.loss_fn(model(tokens[r]), targets[r]).backward()
        finally:
            FSDPTaggedTensor.__torch_dispatch__ = original
        out[f"zero{zero} {ac}"] = ", ".join(f"{op.split('.')[1]} {n}" for op, n in sorted(counts.items()))
    return out


class _SkippableNet(models.Net):
    """Net whose forward can skip its last block (a forward order that changes), and
    checkpoint its blocks with torch's plain (non-selective) checkpoint."""

    skip_last = False
    plain_checkpoint = False

    def forward(self, tokens):
        h = self.tok(tokens)
        for layer in self.layers[: len(self.layers) - self.skip_last]:
            h = checkpoint(layer, h, use_reentrant=False) if self.plain_checkpoint else layer(h)
        return self.head(self.norm(h))


class _GatherTrace(TorchDispatchMode):
    """Bucket all-gathers and waits, by bucket, and block entries, in order."""

    def __init__(self, model):
        super().__init__()
        self.events = []
        self.layers = model.layers

    def __enter__(self):
        self.hooks = [m.register_forward_pre_hook(lambda m, a, n=n: self.events.append(f"enter {n}"))
                      for n, m in self.layers.named_children()]
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tag = None
        if func in (c10d.all_gather_into_tensor.default, c10d.wait_tensor.default):
            tag = fsdptag.get_fsdp_tag(args[0])  # None: a gradient reduction's wait
        if tag is not None:
            kind = "AG" if func is c10d.all_gather_into_tensor.default else "wait"
            if kind == "AG" and is_served(args[0]):
                kind = "served"  # the prefetched all-gather answering its bucket's gather
            phase = "bwd " if torch._C._current_graph_task_id() != -1 else ""
            self.events.append(f"{phase}{kind} {tag.fqn or 'root'}")
        return func(*args, **(kwargs or {}))


def _prefetch(mesh, r):
    """Note [Prefetch]: the next bucket's all-gather is issued when a bucket gathers;
    same numbers as without (over optimizer steps); nothing under selective AC or in a
    plain checkpoint's recompute; an unclaimed prefetch is waited out."""
    out = {}
    tokens, targets = models.batch(0, 2)
    bf16 = fsdptag.MixedPrecisionPolicy(torch.bfloat16)
    for zero in (2, 3):
        for ac in ("none", "selective", "plain checkpoint"):
            grads, traces = {}, {}
            for prefetch in (False, True, 2):
                torch.manual_seed(0)
                model = _SkippableNet()
                fsdptag.parametrize(model, mesh, mode="fully_shard", reshard_after_forward=zero == 3,
                                    mp_policy=bf16, prefetch=prefetch)
                model.plain_checkpoint = ac == "plain checkpoint"
                fsdptag.apply_ac(model, "none" if model.plain_checkpoint else ac)
                optim = torch.optim.SGD(model.parameters(), lr=0.1)
                # The first forward records the order; the third skips the last block.
                for step, skip_last in enumerate((False, False, True, False)):
                    model.skip_last = skip_last
                    with _GatherTrace(model) as trace:
                        models.loss_fn(model(tokens[r]), targets[r]).backward()
                    traces[prefetch, step] = trace.events
                    grads[prefetch, step] = [None if p.grad is None else p.grad.to_local().clone()
                                             for p in model.parameters()]
                    optim.step()
                    optim.zero_grad()
            equal = all(a is b is None or torch.equal(a, b) for depth in (True, 2) for step in range(4)
                        for a, b in zip(grads[False, step], grads[depth, step]))
            out[f"zero{zero} {ac}"] = (f"grads equal: {equal}\n  " + ", ".join(traces[True, 1])
                                       + "\n  skip: " + ", ".join(traces[True, 2]))
    return out


def _bucket_roots(model):
    return [m for m in model.modules() if module_state(m) is not None and module_state(m).buckets]


def _buckets(module):
    return module_state(module).buckets


def _registered(b):
    """(module, name) of each parameter of bucket ``b``, in slot order."""
    return [(p.module_info.module, p.module_info.name) for p in b.params]


def _is_bound(model) -> bool:
    """Every bucketed parameter's shard is a view into its bucket's flat buffer."""
    return all(
        b.flat is not None and all(
            m._parameters[n]._local_tensor.untyped_storage().data_ptr()
            == b.flat.untyped_storage().data_ptr() for m, n in _registered(b))
        for root in _bucket_roots(model) for b in _buckets(root))


def _bucketed_equals_per_param(model) -> bool:
    """A bucket's gather gives every parameter exactly its per-parameter gather."""
    same = True
    for root in _bucket_roots(model):
        with open_scopes(_buckets(root)):
            bucketed = [(m, n, getattr(m, n)) for b in _buckets(root) for m, n in _registered(b)]
        for m, n, t in bucketed:
            same &= torch.equal(t.detach(), getattr(m, n).detach())
    return same


def _bucket_storage(mesh):
    """Note [Bound storage]: binding, rebinding and the unbound fallback."""
    out = {}
    bf16 = fsdptag.MixedPrecisionPolicy(torch.bfloat16)
    model = fsdptag.parametrize(models.make_net(), mesh, mode="fully_shard", mp_policy=bf16,
                                bucket=_block_buckets)
    out["bound"] = _is_bound(model)
    default = fsdptag.parametrize(models.make_net(), mesh, mode="fully_shard")
    out["default roots"] = [fqn for fqn, m in default.named_modules() if m in _bucket_roots(default)]
    out["equal"] = _bucketed_equals_per_param(model)
    log = _OpLog()
    with open_scopes(_buckets(model.layers[0])), log:
        model.layers[0].fc1.weight
    out["ops"] = log.ops

    with torch.device("meta"):
        meta = models.Net()
    fsdptag.parametrize(meta, mesh, mode="fully_shard", bucket=_block_buckets)
    meta.to_empty(device="cpu")
    with fsdptag.disable_active_parametrization():
        for m in meta.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
    out["to_empty"] = (_is_bound(meta), _bucketed_equals_per_param(meta))

    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.load_state_dict(sd, assign=True)
    out["load assign"] = (_is_bound(model), _bucketed_equals_per_param(model))

    # A parameter replaced behind fsdptag's back: the bucket packs with cat instead.
    fc1 = model.layers[0].fc1
    fc1._parameters["weight"] = nn.Parameter(fc1._parameters["weight"].detach() * 2)
    tokens, targets = models.batch(0, 2)
    ref = models.make_net()
    with torch.no_grad():
        ref.layers[0].fc1.weight.mul_(2)
    fsdptag.parametrize(ref, mesh, mode="fully_shard", mp_policy=bf16)
    for m in (model, ref):
        models.loss_fn(m(tokens[mesh.get_local_rank()]), targets[mesh.get_local_rank()]).backward()
    out["replaced"] = (_is_bound(model), _bucketed_equals_per_param(model),
                       torch.equal(fc1._parameters["weight"].grad.full_tensor(),
                                   ref.layers[0].fc1._parameters["weight"].grad.full_tensor()))
    return out


def _mixed_dtype_bucket(mesh, dp_rank):
    """A bucket root with fp32 and bf16 parameters: one bucket (one gather) per dtype."""
    net = models.make_net()
    net.layers[0].norm.to(torch.bfloat16)
    per_param, bucketed = models.clone(net), models.clone(net)
    mp = fsdptag.MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    fsdptag.parametrize(per_param, mesh, mode="fully_shard", mp_policy=mp)
    fsdptag.parametrize(bucketed, mesh, mode="fully_shard", mp_policy=mp, bucket=_block_buckets)
    with CollectiveCounter(mesh) as cc:
        tokens, targets = models.batch(0, 2)
        models.loss_fn(bucketed(tokens[dp_rank]), targets[dp_rank]).backward()
    bucketed.zero_grad()
    models.train_parallel(per_param, STEPS, 2, dp_rank)
    models.train_parallel(bucketed, STEPS, 2, dp_rank)
    a, b = models.full_params(bucketed), models.full_params(per_param)
    return {
        "buckets": [b.name for b in _buckets(bucketed.layers[0])],
        "dtypes": sorted({str(p.dtype) for p in a.values()}),
        "gathers": cc.count("forward", "all_gather"),
        "max diff": max((a[k].float() - b[k].float()).abs().max().item() for k in a),
    }


def _shard_dim_1(mesh, dp_rank):
    """shard_dim=1 (odd column counts: uneven) trains like the reference; such
    parameters are not bucketed (buckets pack rows) and gather per parameter."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(7, 9, bias=False), nn.Tanh(), nn.Linear(9, 5, bias=False))
    model = fsdptag.parametrize(models.clone(ref), mesh, mode="fully_shard", shard_dim=1)
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(1))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
    for _ in range(3):
        model(x.chunk(2)[dp_rank]).pow(2).mean().backward()
        torch.stack([ref(c).pow(2).mean() for c in x.chunk(2)]).mean().backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return {"buckets": len(_bucket_roots(model)),
            "diff": models.max_rel_diff(models.full_params(model), models.full_params(ref))}


def _make_tied() -> nn.Module:
    net = models.make_net()
    net.head.weight = net.tok.weight  # the output projection shares the embedding table
    return net


def _tied(mesh, dp_rank):
    """Tied weights: one stored parameter; a bucket covering both uses gathers it once."""
    out = {}
    for bucket in ("param", "block"):
        for reshard in (False, True):
            ref = _make_tied()
            model = fsdptag.parametrize(models.clone(ref), mesh, mode="fully_shard",
                                        reshard_after_forward=reshard, bucket=BUCKETS[bucket])
            tokens, targets = models.batch(0, 2)
            with CollectiveCounter(mesh) as cc:
                models.loss_fn(model(tokens[dp_rank]), targets[dp_rank]).backward()
            model.zero_grad()
            ref_losses = models.train_reference(ref, STEPS, 2, dp_rank)
            losses, _ = models.train_parallel(model, STEPS, 2, dp_rank)
            out[f"{bucket} zero{3 if reshard else 2}"] = {
                "shared": model.head._parameters["weight"] is model.tok._parameters["weight"],
                "params": len(list(model.parameters())),
                "gathers": (cc.count("forward", "all_gather"), cc.count("backward", "all_gather")),
                "loss": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
                "diff": models.max_rel_diff(models.full_params(model), models.full_params(ref)),
            }
    return out


def _bad_input(mesh, mesh2d):
    """Each bad call must raise a clear error and leave the model as it was."""
    out = {}

    def attempt(name, make_model, **kwargs):
        out[name] = parametrize_error(make_model, **kwargs)

    attempt("unknown mode", models.make_net, mesh=mesh, mode="zero3")
    attempt("2d mesh for fully_shard", models.make_net, mesh=mesh2d, mode="fully_shard")
    attempt("1d mesh for hybrid_shard", models.make_net, mesh=mesh, mode="hybrid_shard")

    def twice():
        m = models.make_net()
        fsdptag.parametrize(m, mesh, mode="fully_shard")
        return m

    attempt("parametrize twice", twice, mesh=mesh, mode="fully_shard")

    class Scalar(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.scale = nn.Parameter(torch.tensor(2.0))

    attempt("0-dim parameter", Scalar, mesh=mesh, mode="fully_shard")
    attempt("reshard of wrong type", models.make_net, mesh=mesh, mode="fully_shard",
            reshard_after_forward="yes")
    attempt("reshard names missing module", models.make_net, mesh=mesh, mode="fully_shard",
            reshard_after_forward={"layers.7": False})
    attempt("prefetch of wrong type", models.make_net, mesh=mesh, mode="fully_shard", prefetch="1")
    return out


def _default_mode(mesh, hsdp_2x1, mesh_tp1):
    """``parametrize(model, mesh)`` picks the mode from the data-parallel mesh dims."""
    out = {}

    def placements(mesh_, **kwargs):
        model = models.make_net()
        fsdptag.parametrize(model, mesh_, **kwargs)
        return str(tuple(model._parameters["head"].placements if "head" in model._parameters
                         else model.head._parameters["weight"].placements))

    out["1 dim"] = placements(mesh)
    out["2 dims"] = placements(hsdp_2x1)
    out["explicit mode wins"] = placements(mesh, mode="replicate")
    out["TP dim unused"] = parametrize_error(models.make_net, mesh=mesh_tp1)
    mesh3d = init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=("x", "y", "z"))
    out["3 dims"] = parametrize_error(models.make_net, mesh=mesh3d)
    return out


class _DictInput(nn.Module):
    """Takes its input nested in a dict and a list, as Hugging Face models take kwargs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, batch):
        x, (y,) = batch["x"], batch["rest"]
        return {"dtypes": (x.dtype, y.dtype, batch["ids"].dtype), "out": self.lin(x) + y}


def _nested_input_cast(mesh):
    model = _DictInput()
    fsdptag.parametrize(model, mesh, mp_policy=fsdptag.MixedPrecisionPolicy(torch.bfloat16))
    batch = {"x": torch.randn(2, 4), "rest": [torch.randn(2, 4)], "ids": torch.arange(2)}
    out = model(batch)
    return str(out["dtypes"] + (out["out"].dtype, batch["x"].dtype))


def worker_2ranks():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    mesh2d = init_device_mesh("cpu", (1, 2), mesh_dim_names=("a", "b"))
    mesh_tp1 = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))  # TP of size 1
    hsdp_2x1 = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    r = dist.get_rank()
    cases = {}
    for mode in ("replicate", "fully_shard"):
        for reshard in (False, True):
            cases[f"parity {mode} zero{3 if reshard else 2}"] = functools.partial(
                _parity, mesh, mode, reshard, dp_rank=r, dp_size=2)
            cases[f"collectives {mode} zero{3 if reshard else 2}"] = functools.partial(
                _collectives, mesh, mode, reshard, dp_rank=r, dp_size=2)
    for bucket in ("module", "block"):
        for reshard in (False, True):
            z = f"zero{3 if reshard else 2}"
            cases[f"parity fully_shard bucket={bucket} {z}"] = functools.partial(
                _parity, mesh, "fully_shard", reshard, dp_rank=r, dp_size=2, bucket=bucket)
            cases[f"collectives fully_shard bucket={bucket} {z}"] = functools.partial(
                _collectives, mesh, "fully_shard", reshard, dp_rank=r, dp_size=2, bucket=bucket)
    for bucket in ("param", "block"):  # a shard dim of size 1: no collective, no copy
        for reshard in (False, True):
            cases[f"parity hybrid_shard 2x1{' bucket=block' if bucket == 'block' else ''} "
                  f"zero{3 if reshard else 2}"] = functools.partial(
                _parity, hsdp_2x1, "hybrid_shard", reshard, dp_rank=r, dp_size=2, bucket=bucket)
    for reshard in (False, True):  # DDP buckets: one all-reduce each; with and without a cast
        z = f"zero{3 if reshard else 2}"
        cases[f"parity replicate bucket=block {z}"] = functools.partial(
            _parity, mesh, "replicate", reshard, dp_rank=r, dp_size=2, bucket="block",
            mp=fsdptag.MixedPrecisionPolicy(torch.float64) if reshard else None)
        cases[f"collectives replicate bucket=block {z}"] = functools.partial(
            _collectives, mesh, "replicate", reshard, dp_rank=r, dp_size=2, bucket="block")
    cases["kept zero2"] = functools.partial(_kept_bytes, mesh, False)
    cases["kept zero3"] = functools.partial(_kept_bytes, mesh, True)
    cases["after retained backward"] = functools.partial(_after_retained_backward, mesh)
    cases["bf16 vs fsdp2"] = functools.partial(_bf16_vs_fsdp2, mesh)
    cases["reduce bytes"] = functools.partial(_reduce_bytes, mesh)
    cases["state_dict"] = functools.partial(_state_dict_collectives, mesh)
    cases["fsdp2 collectives"] = functools.partial(_fsdp2_collectives, mesh)
    cases["gather once"] = functools.partial(_gather_once, mesh)
    cases["in place"] = functools.partial(_in_place, mesh, mesh_tp1)
    cases["inference"] = functools.partial(_inference, mesh, r)
    cases["tagged dispatches"] = functools.partial(_tagged_dispatches, mesh, r)
    cases["prefetch"] = functools.partial(_prefetch, mesh, r)
    cases["no_sync"] = functools.partial(_no_sync, mesh, r)
    cases["schedule"] = functools.partial(_schedule, mesh, r)
    cases["per-module tags"] = functools.partial(_per_module_tags, mesh)
    cases["meta init"] = functools.partial(_meta_init, mesh)
    cases["bucket storage"] = functools.partial(_bucket_storage, mesh)
    cases["tied"] = functools.partial(_tied, mesh, r)
    cases["shard_dim 1"] = functools.partial(_shard_dim_1, mesh, r)
    cases["mixed dtype bucket"] = functools.partial(_mixed_dtype_bucket, mesh, r)
    cases["bad input"] = functools.partial(_bad_input, mesh, mesh2d)
    cases["default mode"] = functools.partial(_default_mode, mesh, hsdp_2x1, mesh_tp1)
    cases["nested input cast"] = functools.partial(_nested_input_cast, mesh)
    return run_cases(cases)


@pytest.fixture(scope="module")
def two_ranks():
    return launch(2, worker_2ranks)


# ---------------------------------------------------------------- tests


def _assert_parity(results, name, rel: float = 0.0):
    """Losses and parameters after training vs the single-device reference, within ``rel``."""
    r = result(results, name)
    assert r["loss"] <= rel and r["params"] <= rel, r
    assert r["leaks"] == []


def _collectives_text(results) -> str:
    got = {k: result(results, k) for k in results if k.startswith("collectives")}
    return "\n".join(f"== {k}\n{v}" for k, v in got.items())


@pytest.mark.parametrize("mode", ["replicate", "fully_shard", "fully_shard bucket=module",
                                  "fully_shard bucket=block", "replicate bucket=block",
                                  "hybrid_shard 2x1", "hybrid_shard 2x1 bucket=block"])
@pytest.mark.parametrize("zero", [2, 3])
def test_parity_2ranks(two_ranks, mode, zero):
    # Bitwise: two ranks' gradients reduce by one addition, which is what the reference's
    # batch of two does too. The DDP-bucket zero3 case computes in float64 (its cast): not.
    float64 = mode == "replicate bucket=block" and zero == 3
    _assert_parity(two_ranks, f"parity {mode} zero{zero}", rel=1e-6 if float64 else 0.0)


def test_collectives_2ranks(two_ranks):
    # 16 parameters. zero2: no backward all-gather. zero3 re-gathers the 11 that
    # autograd saves: 8 weights (not the embedding table) + the 3 LayerNorm biases,
    # which aten's layer_norm saves for backward (it only checks they are defined).
    assert_expected_inline(_collectives_text(two_ranks), """\
== collectives replicate zero2
backward all_reduce dp x16
== collectives replicate zero3
backward all_reduce dp x16
== collectives fully_shard zero2
forward  all_gather dp [fsdp] x16
backward reduce_scatter dp x16
== collectives fully_shard zero3
forward  all_gather dp [fsdp] x16
backward all_gather dp [fsdp] x11
backward reduce_scatter dp x16
re-gathered: head.weight layers.0.fc1.weight layers.0.fc2.weight layers.0.norm.bias layers.0.norm.weight layers.1.fc1.weight layers.1.fc2.weight layers.1.norm.bias layers.1.norm.weight norm.bias norm.weight
== collectives fully_shard bucket=module zero2
forward  all_gather dp [fsdp] x9
backward reduce_scatter dp x9
== collectives fully_shard bucket=module zero3
forward  all_gather dp [fsdp] x9
backward all_gather dp [fsdp] x8
backward reduce_scatter dp x9
re-gathered: head layers.0.fc1 layers.0.fc2 layers.0.norm layers.1.fc1 layers.1.fc2 layers.1.norm norm
== collectives fully_shard bucket=block zero2
forward  all_gather dp [fsdp] x3
backward reduce_scatter dp x3
== collectives fully_shard bucket=block zero3
forward  all_gather dp [fsdp] x3
backward all_gather dp [fsdp] x3
backward reduce_scatter dp x3
re-gathered: <root> layers.0 layers.1
== collectives replicate bucket=block zero2
backward all_reduce dp x3
== collectives replicate bucket=block zero3
backward all_reduce dp x3""")


def test_zero3_frees_gathered_params(two_ranks):
    (kept2, peak2, bwd2), (kept3, peak3, bwd3) = result(two_ranks, "kept zero2"), result(two_ranks, "kept zero3")
    assert len(kept2) == len(kept3) == len(peak2) == len(peak3) == len(bwd2) == len(bwd3) == 1, \
        (kept2, kept3, peak2, peak3, bwd2, bwd3)
    (kept2,), (kept3,), (peak2,), (peak3,), (bwd2,), (bwd3,) = kept2, kept3, peak2, peak3, bwd2, bwd3
    assert kept2 - kept3 == _weights_backward_needs(), (kept2, kept3)
    # ... and during forward: block 0's gathered parameters are gone before block 1 ends.
    block = sum(p.numel() * p.element_size() for p in models.make_net().layers[0].parameters())
    assert peak2 - peak3 >= block, (peak2, peak3, block)
    assert_expected_inline(f"kept {kept2} / {kept3} B, forward peak {peak2} / {peak3} B, "
                           f"backward peak {bwd2} / {bwd3} B", """kept 24328 / 13064 B, forward peak 26496 / 20488 B, backward peak 17116 / 19456 B""")


def test_zero3_regathers_are_dropped_after_their_last_use(two_ranks):
    r = result(two_ranks, "after retained backward")
    assert r["zero3"] == r["zero2"], r  # only gradients: nothing re-gathered is left
    assert_expected_inline(str(r), """{'zero2': 6920, 'zero3': 6920}""")


def test_bf16_matches_fsdp2(two_ranks):
    r = result(two_ranks, "bf16 vs fsdp2")
    assert r == {"loss": 0.0, "params": 0.0}, r  # the same casts, gathers and reductions


def test_gradients_reduce_in_reduce_dtype(two_ranks):
    r = result(two_ranks, "reduce bytes")
    for path in ("fully_shard bucket=param", "fully_shard bucket=block", "replicate bucket=param",
                 "replicate bucket=block"):
        fp32, mixed, bf16 = (r[f"{path} {mp}"] for mp in ("fp32", "bf16/fp32", "bf16/bf16"))
        assert mixed == fp32 == 2 * bf16, (path, fp32, mixed, bf16)
    assert_expected_inline("\n".join(f"{k}: {v}" for k, v in r.items()), """\
fully_shard bucket=param fp32: 13840
fully_shard bucket=param bf16/fp32: 13840
fully_shard bucket=param bf16/bf16: 6920
fully_shard bucket=block fp32: 13840
fully_shard bucket=block bf16/fp32: 13840
fully_shard bucket=block bf16/bf16: 6920
replicate bucket=param fp32: 13840
replicate bucket=param bf16/fp32: 13840
replicate bucket=param bf16/bf16: 6920
replicate bucket=block fp32: 13840
replicate bucket=block bf16/fp32: 13840
replicate bucket=block bf16/bf16: 6920""")


def test_counter_sees_fsdp2(two_ranks):
    # FSDP2 groups: one per block + root; zero3 re-gathers the blocks (not the root) in backward.
    summary, gathered, reduced = result(two_ranks, "fsdp2 collectives")
    assert_expected_inline(summary, """\
forward  all_gather dp x3
backward all_gather dp x2
backward reduce_scatter dp x3""")
    # c10d's reduce-scatter takes (output, input): its bytes are the input's, the whole
    # (padded) gradients, as many as the forward all-gathers' outputs (all fp32)
    assert reduced == gathered > 0


def test_bucket_gathers_a_reused_weight_once(two_ranks):
    # per parameter: weight and bias gathered at each of the 2 reads (4 gathers, 4
    # reductions). bucket="module": `lin` is the bucket root and is called twice, so
    # one gather per call. A bucket rooted above both calls: one gather, one reduction.
    assert result(two_ranks, "gather once") == {
        "param": (4, 4, True), "module": (2, 2, True), "root": (1, 1, True)}


def test_tagged_dispatches_are_the_gather_path(two_ranks):
    # Net: 2 blocks + root, 3 buckets. Per bucket gather: cast, all-gather, wait, copy-out
    # (+ SAC's detach of a saved all-gather output, and a recompute's gather ops).
    text = "\n".join(f"{k}: {v}" for k, v in result(two_ranks, "tagged dispatches").items())
    assert_expected_inline(text, """\
zero2 none: all_gather_into_tensor 3, wait_tensor 3, _to_copy 3, split_with_sizes_copy 3, view 3
zero2 selective: all_gather_into_tensor 3, wait_tensor 5, _to_copy 5, detach 2, split_with_sizes_copy 5, view 5
zero3 none: all_gather_into_tensor 6, wait_tensor 6, _to_copy 6, split_with_sizes_copy 6, view 6
zero3 selective: all_gather_into_tensor 6, wait_tensor 6, _to_copy 6, split_with_sizes_copy 6, view 6""")


def test_no_sync(two_ranks):
    text = "\n".join(f"{k}: {v}" for k, v in result(two_ranks, "no_sync").items())
    assert_expected_inline(text, """\
zero2 none: bitwise FSDP2: True, vs syncing each: rel < 1e-6
zero2 full: bitwise FSDP2: True, vs syncing each: rel < 1e-6
zero3 none: bitwise FSDP2: True, vs syncing each: rel < 1e-6
zero3 full: bitwise FSDP2: True, vs syncing each: rel < 1e-6""")


def test_explicit_schedule(two_ranks):
    text = "\n".join(f"{k}: bitwise {v}" for k, v in result(two_ranks, "schedule").items())
    assert_expected_inline(text, """\
zero2 none: bitwise True
zero2 selective: bitwise True
zero3 none: bitwise True
zero3 selective: bitwise True""")


def test_prefetch(two_ranks):
    text = "\n".join(f"{k}: {v}" for k, v in result(two_ranks, "prefetch").items())
    assert_expected_inline(text, """\
zero2 none: grads equal: True
  AG <root>, wait <root>, AG layers.0, enter 0, served layers.0, wait layers.0, AG layers.1, enter 1, served layers.1, wait layers.1
  skip: AG <root>, wait <root>, AG layers.0, enter 0, served layers.0, wait layers.0, AG layers.1, wait layers.1
zero2 selective: grads equal: True
  AG <root>, wait <root>, AG layers.0, enter 0, served layers.0, wait layers.0, AG layers.1, enter 1, served layers.1, wait layers.1, bwd wait layers.1, bwd wait layers.0
  skip: AG <root>, wait <root>, AG layers.0, enter 0, served layers.0, wait layers.0, AG layers.1, wait layers.1, bwd wait layers.0
zero2 plain checkpoint: grads equal: True
  AG <root>, wait <root>, AG layers.0, enter 0, served layers.0, wait layers.0, AG layers.1, enter 1, served layers.1, wait layers.1, enter 1, enter 0
  skip: AG <root>, wait <root>, AG layers.0, enter 0, served layers.0, wait layers.0, AG layers.1, wait layers.1, enter 0
zero3 none: grads equal: True
  AG <root>, wait <root>, AG layers.0, enter 0, served layers.0, wait layers.0, AG layers.1, enter 1, served layers.1, wait layers.1, bwd AG <root>, bwd wait <root>, bwd AG layers.1, bwd served layers.1, bwd wait layers.1, bwd AG layers.0, bwd served layers.0, bwd wait layers.0
  skip: AG <root>, wait <root>, AG layers.0, enter 0, served layers.0, wait layers.0, AG layers.1, wait layers.1, bwd AG <root>, bwd wait <root>, bwd AG layers.0, bwd wait layers.0
zero3 selective: grads equal: True
  AG <root>, wait <root>, AG layers.0, enter 0, served layers.0, wait layers.0, AG layers.1, enter 1, served layers.1, wait layers.1, bwd AG <root>, bwd wait <root>, bwd AG layers.1, bwd served layers.1, bwd wait layers.1, bwd AG layers.0, bwd served layers.0, bwd wait layers.0
  skip: AG <root>, wait <root>, AG layers.0, enter 0, served layers.0, wait layers.0, AG layers.1, wait layers.1, bwd AG <root>, bwd wait <root>, bwd AG layers.0, bwd wait layers.0
zero3 plain checkpoint: grads equal: True
  AG <root>, wait <root>, AG layers.0, enter 0, served layers.0, wait layers.0, AG layers.1, enter 1, served layers.1, wait layers.1, bwd AG <root>, bwd wait <root>, bwd AG layers.1, enter 1, bwd served layers.1, bwd wait layers.1, bwd AG layers.0, enter 0, bwd served layers.0, bwd wait layers.0
  skip: AG <root>, wait <root>, AG layers.0, enter 0, served layers.0, wait layers.0, AG layers.1, wait layers.1, bwd AG <root>, bwd wait <root>, enter 0, bwd AG layers.0, bwd wait layers.0""")


def test_inference_mode(two_ranks):
    assert all(result(two_ranks, "inference").values()), result(two_ranks, "inference")


def test_in_place_on_gathered_param_raises(two_ranks):
    text = "\n".join(f"{k}: {v}" for k, v in result(two_ranks, "in place").items())
    assert_expected_inline(text, """\
param, grad on: Output 0 of _Handout is a view and is being modified inplace | stored unchanged: True
param, grad off: no error | stored unchanged: True
param, grad off, kept: fsdptag: an in-place op during forward on the gathered parameter '0.lin.weight' | stored unchanged: True
block, grad on: Output 0 of _GatherBucket is a view and is being modified inplace | stored unchanged: True
block, grad off: Output 0 of _GatherBucket is a view and its base or another view of its base has been modified inplace | stored unchanged: True
block, grad off, kept: Output 0 of _GatherBucket is a view and its base or another view of its base has been modified inplace | stored unchanged: True
block, grad off, no_grad forward: fsdptag: an in-place op during forward on the gathered parameter '0.lin.weight' | stored unchanged: True
param, grad off, kept, no_grad forward: fsdptag: an in-place op during forward on the gathered parameter '0.lin.weight' | stored unchanged: True
param, grad on, TP: Output 0 of _Handout is a view and is being modified inplace | stored unchanged: True
block, grad on, TP: fsdptag: an in-place op during forward on the gathered parameter '0.lin.weight' | stored unchanged: True
block, grad off, replicate: no error | stored unchanged: False
param, grad off, replicate: no error | stored unchanged: False
block, grad on, replicate: no error | stored unchanged: False
param, grad on, replicate: no error | stored unchanged: False""")


def test_state_dict_has_no_collective(two_ranks):
    r = result(two_ranks, "state_dict")
    assert r == {"collectives": 0, "types": ["DTensor"]}


def test_per_module_reshard_recorded_in_tags(two_ranks):
    assert result(two_ranks, "per-module tags") == {
        "tok.weight": ("tok.weight", True),
        "layers.0.fc1.weight": ("layers.0.fc1.weight", False),
        "layers.1.fc1.weight": ("layers.1.fc1.weight", True),
        "head.weight": ("head.weight", False),
    }


def test_meta_init(two_ranks):
    r = result(two_ranks, "meta init")
    assert r == {"stored": "DTensor", "finite": True, "grad": "DTensor"}


def test_bucket_storage(two_ranks):
    r = result(two_ranks, "bucket storage")
    assert r["bound"] and r["equal"]
    assert r["default roots"] == ["", "layers.0", "layers.1"]  # bucket="blocks": ModuleList children + root
    # One bucket gather (6 parameters, bf16): cast, all-gather, wait, one copy-out, a view each.
    assert_expected_inline("\n".join(r["ops"]), """\
aten._to_copy.default
_c10d_functional.all_gather_into_tensor.default
_c10d_functional.wait_tensor.default
aten.view.default
aten.split_with_sizes_copy.default
aten.view.default
aten.view.default
aten.view.default
aten.view.default
aten.view.default
aten.view.default""")
    assert r["to_empty"] == (True, True)  # _apply rebinds
    assert r["load assign"] == (True, True)  # load_state_dict's post-hook rebinds
    assert r["replaced"] == (False, True, True)  # unbound: cat-packed, same values and grads


def test_mixed_dtype_bucket(two_ranks):
    r = result(two_ranks, "mixed dtype bucket")
    assert r["buckets"] == ["layers.0[bfloat16]", "layers.0[float32]"]
    assert r["dtypes"] == ["torch.bfloat16", "torch.float32"]
    assert r["gathers"] == 4  # root, layers.0 x2, layers.1
    assert r["max diff"] == 0.0, r


def test_shard_dim_1(two_ranks):
    r = result(two_ranks, "shard_dim 1")
    assert r["buckets"] == 0 and r["diff"] == 0.0, r


def test_tied_weights(two_ranks):
    r = result(two_ranks, "tied")
    for name, v in r.items():
        assert v["shared"] and v["params"] == 15, (name, v)
        # The table's two gradients (embedding, head) add up in another order than in
        # the reference: seen 1.6e-7 relative in the parameters, and 1.3e-7 in the loss
        # on an AVX2 CPU (0 on others), not bitwise.
        assert v["loss"] < 1e-6 and v["diff"] < 1e-6, (name, v)
    # Per parameter, each read gathers (the table twice: embedding and head); a bucket
    # covering both reads (here the root's) gathers it once. zero3 re-gathers the
    # table once for the head's backward.
    assert {k: v["gathers"] for k, v in r.items()} == {
        "param zero2": (16, 0), "param zero3": (16, 11),
        "block zero2": (3, 0), "block zero3": (3, 3)}


def test_bad_input(two_ranks):
    text = "\n".join(f"{k}: {v}" for k, v in result(two_ranks, "bad input").items())
    assert_expected_inline(text, """\
unknown mode: ValueError: unknown mode='zero3'; use one of 'replicate', 'fully_shard', 'hybrid_shard'
2d mesh for fully_shard: ValueError: data-parallel mesh has 2 dim(s) ('a', 'b') but mode='fully_shard' needs 1; use mode='hybrid_shard' or pass one dim, e.g. mesh['b']
1d mesh for hybrid_shard: ValueError: data-parallel mesh has 1 dim(s) ('dp',) but mode='hybrid_shard' needs 2; pass a 2D mesh (replicate, shard) or use mode='fully_shard'
parametrize twice: ValueError: Net is already parametrized by fsdptag; call fsdptag.parametrize once, on the root module
0-dim parameter: ValueError: parameter 'scale' has shape (), which has no dim 0 to shard; reshape it to at least 1 dims or use mode='replicate'
reshard of wrong type: TypeError: reshard_after_forward='yes' must be a bool, an int k > 1, a callable (module_fqn, module) -> one of them, or a dict of module-FQN prefixes to them
reshard names missing module: ValueError: reshard_after_forward names module 'layers.7', which is not in the model; use module FQNs from model.named_modules() ("" sets the default)
prefetch of wrong type: TypeError: prefetch='1' must be True (issue the next bucket's all-gather early), False, an int >= 0 (buckets gathered ahead) or a fsdptag.OverlapPolicy""")


def test_default_mode(two_ranks):
    text = "\n".join(f"{k}: {v}" for k, v in result(two_ranks, "default mode").items())
    assert_expected_inline(text, """\
1 dim: (Shard(dim=0),)
2 dims: (Replicate(), Shard(dim=0))
explicit mode wins: (Replicate(),)
TP dim unused: ValueError: mesh dim 'tp' looks like a TP dim but no parameter is on it; call parallelize_module on the TP sub-mesh first, or pass mode='fully_shard' / 'hybrid_shard' / 'replicate' to data-parallelize over it
3 dims: ValueError: data-parallel mesh has 3 dims ('x', 'y', 'z'); pass a 1D mesh (mode='fully_shard' or 'replicate') or a 2D (replicate, shard) mesh (mode='hybrid_shard'), e.g. mesh[('y', 'z')]""")


def test_nested_inputs_are_cast(two_ranks):
    assert_expected_inline(result(two_ranks, "nested input cast"), """(torch.bfloat16, torch.bfloat16, torch.int64, torch.bfloat16, torch.float32)""")


# ---------------------------------------------------------------- 4 ranks: HSDP, TP, uneven


def _tp_collectives_consistent(mesh):
    """zero3, 34 rows over 4 ranks: ranks that pad and ranks that do not must agree."""
    summary = _collectives(mesh, "fully_shard", True, dp_rank=mesh.get_local_rank(), dp_size=4)
    mine = torch.zeros(1024, dtype=torch.uint8)
    mine[: len(summary)] = torch.tensor(list(summary.encode()), dtype=torch.uint8)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)  # all_gather_object would need numpy
    return len({bytes(t.tolist()) for t in everyone})


def _partial_reshard(mesh, r):
    """Note [Partial reshard]: ``reshard_after_forward=2`` on 4 ranks trains bitwise like
    zero3, re-gathers in backward over 2-rank groups, and keeps for backward more than
    zero3 and less than zero2."""
    from fsdptag.tools import estimate as est

    out = {}
    for ac in ("none", "selective", "full"):
        runs, kept = {}, {}
        for reshard in (True, 2, False):
            model = models.make_net()
            fsdptag.parametrize(model, mesh, reshard_after_forward=reshard)
            fsdptag.apply_ac(model, ac)
            optim = models.make_optim(model)
            losses = []
            for step in range(2):
                tokens, targets = models.batch(step, 4)
                with CollectiveCounter(mesh) as cc:
                    loss = models.loss_fn(model(tokens[r]), targets[r])
                    loss.backward()
                optim.step()
                optim.zero_grad()
                losses.append(loss.detach())
            if reshard == 2:
                out[f"{ac} collectives"] = cc.summary()
            runs[reshard] = losses + [p.to_local() for p in model.parameters()]
            kept[reshard] = est.measure_step(model, torch.randint(0, models.VOCAB, (2, models.SEQ + 1)))[
                "activation_bytes"]
        out[f"{ac} bitwise zero3"] = all(torch.equal(a, b) for a, b in zip(runs[True], runs[2]))
        out[f"{ac} kept zero3 < k=2 < zero2"] = (kept[True] < kept[2] < kept[False], kept[True], kept[2], kept[False])
    return out


def worker_4ranks():
    r = dist.get_rank()
    flat = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    dp_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    hsdp_tp = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
    dp_rank = dp_tp["dp"].get_local_rank()
    cases = {}
    for reshard in (False, True):
        z = f"zero{3 if reshard else 2}"
        cases[f"parity fully_shard 4 {z}"] = functools.partial(
            _parity, flat, "fully_shard", reshard, dp_rank=r, dp_size=4)
        cases[f"parity hybrid_shard 2x2 {z}"] = functools.partial(
            _parity, hsdp, "hybrid_shard", reshard, dp_rank=r, dp_size=4)
        cases[f"parity fsdp+tp 2x2 {z}"] = functools.partial(
            _parity, dp_tp, "fully_shard", reshard, dp_rank=dp_rank, dp_size=2, tp_mesh=dp_tp["tp"])
        cases[f"parity hsdp+tp 1x2x2 {z}"] = functools.partial(
            _parity, hsdp_tp, "hybrid_shard", reshard, dp_rank=dp_rank, dp_size=2,
            tp_mesh=hsdp_tp["tp"])
        cases[f"collectives hybrid_shard 2x2 {z}"] = functools.partial(
            _collectives, hsdp, "hybrid_shard", reshard, dp_rank=r, dp_size=4)
        cases[f"collectives fsdp+tp 2x2 {z}"] = functools.partial(
            _collectives, dp_tp, "fully_shard", reshard, tp_mesh=dp_tp["tp"],
            dp_rank=dp_rank, dp_size=2)
        cases[f"parity fully_shard 4 bucket=block {z}"] = functools.partial(
            _parity, flat, "fully_shard", reshard, dp_rank=r, dp_size=4, bucket="block")
        cases[f"parity hybrid_shard 2x2 bucket=block {z}"] = functools.partial(
            _parity, hsdp, "hybrid_shard", reshard, dp_rank=r, dp_size=4, bucket="block")
        cases[f"parity fsdp+tp 2x2 bucket=block {z}"] = functools.partial(
            _parity, dp_tp, "fully_shard", reshard, dp_rank=dp_rank, dp_size=2, tp_mesh=dp_tp["tp"],
            bucket="block")
        cases[f"parity hsdp+tp 1x2x2 bucket=block {z}"] = functools.partial(
            _parity, hsdp_tp, "hybrid_shard", reshard, dp_rank=dp_rank, dp_size=2,
            tp_mesh=hsdp_tp["tp"], bucket="block")
        cases[f"collectives hybrid_shard 2x2 bucket=block {z}"] = functools.partial(
            _collectives, hsdp, "hybrid_shard", reshard, dp_rank=r, dp_size=4, bucket="block")
        cases[f"collectives fsdp+tp 2x2 bucket=block {z}"] = functools.partial(
            _collectives, dp_tp, "fully_shard", reshard, tp_mesh=dp_tp["tp"],
            dp_rank=dp_rank, dp_size=2, bucket="block")
    cases["uneven zero3 ranks agree"] = functools.partial(_tp_collectives_consistent, flat)
    cases["partial reshard"] = functools.partial(_partial_reshard, flat, r)
    cases["no_sync fsdp+tp 2x2"] = functools.partial(_no_sync_tp, dp_tp, dp_rank)
    return run_cases(cases)


@pytest.fixture(scope="module")
def four_ranks():
    return launch(4, worker_4ranks)


@pytest.mark.parametrize("config", ["fully_shard 4", "hybrid_shard 2x2", "fsdp+tp 2x2", "hsdp+tp 1x2x2"])
@pytest.mark.parametrize("bucket", ["", " bucket=block"])
@pytest.mark.parametrize("zero", [2, 3])
def test_parity_4ranks(four_ranks, config, bucket, zero):
    # Four ranks' gradients are summed in gloo's order, not the reference's: seen up to
    # 1.1e-6 relative after training.
    _assert_parity(four_ranks, f"parity {config}{bucket} zero{zero}", rel=3e-6)


def test_partial_reshard_4ranks(four_ranks):
    text = "\n".join(f"{k}: {v}" for k, v in result(four_ranks, "partial reshard").items())
    assert_expected_inline(text, """\
none collectives: forward  all_gather dp [fsdp] x3
backward all_gather dp/2 [fsdp] x3
backward reduce_scatter dp x3
none bitwise zero3: True
none kept zero3 < k=2 < zero2: (True, 13160, 20344, 24808)
selective collectives: forward  all_gather dp [fsdp] x3
backward all_gather dp/2 [fsdp] x3
backward reduce_scatter dp x3
selective bitwise zero3: True
selective kept zero3 < k=2 < zero2: (True, 4904, 12088, 16968)
full collectives: forward  all_gather dp [fsdp] x3
backward all_gather dp/2 [fsdp] x3
backward reduce_scatter dp x3
full bitwise zero3: True
full kept zero3 < k=2 < zero2: (True, 4904, 12088, 16968)""")


def test_no_sync_with_tp_4ranks(four_ranks):
    """FSDP x TP accumulation without sync: the synced step's gradients against FSDP2's
    with the same TP plan and setting, and against syncing every microbatch."""
    assert_expected_inline(str(result(four_ranks, "no_sync fsdp+tp 2x2")), """{'zero2': {'sync': 'rel < 1e-6', 'fsdp2': 'bitwise'}, 'zero3': {'sync': 'rel < 1e-6', 'fsdp2': 'bitwise'}}""")


def test_collectives_4ranks(four_ranks):
    assert_expected_inline(_collectives_text(four_ranks), """\
== collectives hybrid_shard 2x2 zero2
forward  all_gather shard [fsdp] x16
backward all_reduce replicate x16
backward reduce_scatter shard x16
== collectives fsdp+tp 2x2 zero2
forward  all_gather dp [fsdp] x16
forward  all_reduce tp x2
backward all_reduce tp x2
backward reduce_scatter dp x16
== collectives hybrid_shard 2x2 bucket=block zero2
forward  all_gather shard [fsdp] x3
backward all_reduce replicate x3
backward reduce_scatter shard x3
== collectives fsdp+tp 2x2 bucket=block zero2
forward  all_gather dp [fsdp] x3
forward  all_reduce tp x2
backward all_reduce tp x2
backward reduce_scatter dp x3
== collectives hybrid_shard 2x2 zero3
forward  all_gather shard [fsdp] x16
backward all_gather shard [fsdp] x11
backward all_reduce replicate x16
backward reduce_scatter shard x16
re-gathered: head.weight layers.0.fc1.weight layers.0.fc2.weight layers.0.norm.bias layers.0.norm.weight layers.1.fc1.weight layers.1.fc2.weight layers.1.norm.bias layers.1.norm.weight norm.bias norm.weight
== collectives fsdp+tp 2x2 zero3
forward  all_gather dp [fsdp] x16
forward  all_reduce tp x2
backward all_gather dp [fsdp] x11
backward all_reduce tp x2
backward reduce_scatter dp x16
re-gathered: head.weight layers.0.fc1.weight layers.0.fc2.weight layers.0.norm.bias layers.0.norm.weight layers.1.fc1.weight layers.1.fc2.weight layers.1.norm.bias layers.1.norm.weight norm.bias norm.weight
== collectives hybrid_shard 2x2 bucket=block zero3
forward  all_gather shard [fsdp] x3
backward all_gather shard [fsdp] x3
backward all_reduce replicate x3
backward reduce_scatter shard x3
re-gathered: <root> layers.0 layers.1
== collectives fsdp+tp 2x2 bucket=block zero3
forward  all_gather dp [fsdp] x3
forward  all_reduce tp x2
backward all_gather dp [fsdp] x3
backward all_reduce tp x2
backward reduce_scatter dp x3
re-gathered: <root> layers.0 layers.1""")


def test_uneven_shards_all_ranks_agree(four_ranks):
    assert result(four_ranks, "uneven zero3 ranks agree") == 1
