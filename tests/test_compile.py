"""torch.compile on parametrized models (Note [Compiled gathers] in fsdptag/_param.py).

One 2-rank launch. FSDP all-gathers are counted from the compiled graphs themselves
(a backend whose forward and backward compilers count ``all_gather_into_tensor``
nodes), next to the eager counts; numerics are compared with eager over AdamW steps.
Compiling is slow on CPU: the matrix here is small, inductor runs once.
"""

from __future__ import annotations

import collections
import functools

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from expecttest import assert_expected_inline
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

import fsdptag
from fsdptag.debug import CollectiveCounter
from fsdptag.tools.llama import Llama, apply_tp

from .harness import launch, result, run_cases
from .test_checkpoint import CFG, _tokens


def _counting_backend(counts: collections.Counter, fsdp_group: str):
    """aot_eager with inductor's partitioner that counts each graph's FSDP and other
    all-gathers."""

    def compiler(which):
        def compile_graph(gm, example_inputs):
            counts[f"{which} graphs"] += 1
            for node in gm.graph.nodes:
                if node.op == "call_function" and "all_gather_into_tensor" in str(node.target):
                    counts[f"{which} {'fsdp' if node.args[2] == fsdp_group else 'other'} all-gathers"] += 1
            return gm.forward

        return compile_graph

    # inductor's partitioner: it honours recompute tags for the views after them too
    return aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
                        partition_fn=min_cut_rematerialization_partition)


def _llama(mesh, reshard, ac, bucket="blocks", mp=None):
    """``ac``: fsdptag's ``apply_ac`` mode (applied after ``parametrize``, or before with
    " before parametrize"), or "plain checkpoint": each block's forward under a plain
    non-reentrant checkpoint (Hugging Face's way), inside the compiled block."""
    torch.manual_seed(0)
    model = Llama(CFG)
    model.init_weights()
    before = ac.endswith(" before parametrize")
    if before:
        fsdptag.apply_ac(model, ac.removesuffix(" before parametrize"))
    fsdptag.parametrize(model, mesh, reshard_after_forward=reshard, bucket=bucket, mp_policy=mp)
    if ac == "plain checkpoint":
        for block in model.layers:
            block.forward = functools.partial(_plainly_checkpointed, block.forward)
    elif not before:
        fsdptag.apply_ac(model, ac)
    return model


def _plainly_checkpointed(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _compile(model, backend, how):
    if how == "whole":
        return torch.compile(model, backend=backend)
    for block in model.layers:
        block.compile(backend=backend)
    return model


def _train(model, dp_rank, after_first_step=lambda: None):
    """Losses of 3 AdamW steps, the first step's gradients and the final local shards."""
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], None
    for step in range(3):
        tokens = _tokens(dp_rank + 2 * step)
        loss = F.cross_entropy(model(tokens).float().flatten(0, 1), tokens.flatten())
        loss.backward()
        grads = grads or [p.grad.to_local().clone() for p in model.parameters()]
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
        if step == 0:
            after_first_step()
    return losses, grads, [p.to_local().clone() for p in model.parameters()]


def _graph_counts(mesh, dp_rank):
    """Per-block compile: the all-gathers in the compiled block graphs (one graph
    serves both blocks), next to an eager run's per step (all buckets)."""
    fsdp_group = mesh.get_group().group_name
    rows = {}
    for reshard in (False, True):
        for ac in (("none", "selective", "plain checkpoint") if not reshard
                   else ("none", "full", "full before parametrize")):
            tokens = _tokens(dp_rank)
            with CollectiveCounter(mesh) as cc:  # (a dispatch mode: dynamo would not compile under it)
                F.cross_entropy(_llama(mesh, reshard, ac)(tokens).float().flatten(0, 1), tokens.flatten()).backward()
            torch._dynamo.reset()
            counts = collections.Counter()
            model = _compile(_llama(mesh, reshard, ac), _counting_backend(counts, fsdp_group), "blocks")
            F.cross_entropy(model(tokens).float().flatten(0, 1), tokens.flatten()).backward()
            rows[f"zero{3 if reshard else 2} ac={ac}"] = (
                f"eager {cc.count('forward', 'all_gather')}/{cc.count('backward', 'all_gather')} | compiled block: "
                + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return rows


MP_BF16 = fsdptag.MixedPrecisionPolicy(torch.bfloat16, torch.float32)

# name -> (backend, compile "whole" model or each block, zero3, AC, bucket, mixed precision)
NUMERICS = {
    "aot_eager blocks zero2 selective bf16": ("aot_eager", "blocks", False, "selective", "blocks", MP_BF16),
    "aot_eager blocks zero2 plain checkpoint": ("aot_eager", "blocks", False, "plain checkpoint", "blocks", None),
    "aot_eager whole zero3 full": ("aot_eager", "whole", True, "full", "blocks", None),
    "eager whole zero3 selective param": ("eager", "whole", True, "selective", "param", None),
    "inductor blocks zero3": ("inductor", "blocks", True, "none", "blocks", None),
}


def _numerics(mesh, dp_rank):
    """Compiled vs eager over 3 AdamW steps: losses and parameters; recompiles after
    the first step and graph breaks."""
    out = {}
    for name, (backend, how, reshard, ac, bucket, mp) in NUMERICS.items():
        eager_losses, eager_grads, eager_params = _train(_llama(mesh, reshard, ac, bucket, mp), dp_rank)
        torch._dynamo.reset()
        counters.clear()
        model = _compile(_llama(mesh, reshard, ac, bucket, mp), backend, how)
        first = []
        losses, grads, params = _train(model, dp_rank, lambda: first.append(counters["stats"]["unique_graphs"]))
        if backend == "inductor":  # (AdamW's normalization magnifies 1e-7 gradient differences)
            rel = max(abs(a - b) / abs(b) for a, b in zip(losses, eager_losses))
            grel = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(grads, eager_grads))
            same = ("losses and first gradients within 1e-5" if rel <= 1e-5 and grel <= 1e-5
                    else f"DIFFER by {rel:.1e} / {grel:.1e}")
        else:
            bitwise = losses == eager_losses and all(
                torch.equal(a, b) for a, b in zip(grads + params, eager_grads + eager_params))
            same = "losses, gradients and parameters bitwise" if bitwise else f"DIFFER {losses} vs {eager_losses}"
        out[name] = (f"{same}, graphs {first[0]}, recompiles after step 1: "
                     f"{counters['stats']['unique_graphs'] - first[0]}, "
                     f"graph breaks: {sum(counters['graph_break'].values())}")
    return out


def _fsdp2_parity(mesh, dp_rank):
    """fsdptag vs FSDP2, both compiled per block (aot_eager), bf16 params / fp32
    reduction, selective AC, zero2 and zero3: losses and parameters over 3 AdamW steps."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as FSDP2MP, fully_shard

    out = {}
    for reshard in (False, True):
        torch._dynamo.reset()
        ours = _compile(_llama(mesh, reshard, "selective", mp=MP_BF16), "aot_eager", "blocks")
        torch.manual_seed(0)
        theirs = Llama(CFG)
        theirs.init_weights()
        fsdptag.apply_ac(theirs, "selective")  # on a plain model: torch's SAC with the base policy
        # FSDP2 casts the inputs of every fully_shard module, so each block's RoPE table
        # too; fsdptag casts the root's inputs only (Note [Root forward]).
        mp2 = FSDP2MP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
        for block in theirs.layers:
            fully_shard(block, mesh=mesh, mp_policy=mp2, reshard_after_forward=reshard)
        fully_shard(theirs, mesh=mesh, mp_policy=mp2, reshard_after_forward=reshard)
        theirs = _compile(theirs, "aot_eager", "blocks")
        (l1, _, p1), (l2, _, p2) = _train(ours, dp_rank), _train(theirs, dp_rank)
        out[f"zero{3 if reshard else 2}"] = l1 == l2 and all(torch.equal(a, b) for a, b in zip(p1, p2))
    return out


def _frozen(mesh, dp_rank):
    """Frozen weights beside trainable ones (wq, wk, w1 of every block, as LoRA leaves a
    block's base weights): the compiled backward reduce-scatters the trainable slots
    alone, the bytes eager sends, and trains bitwise equal to eager (aot_eager, whole)."""
    def build(reshard, freeze=True):
        torch.manual_seed(0)
        model = Llama(CFG)
        model.init_weights()
        if freeze:
            for block in model.layers:
                for linear in (block.attention.wq, block.attention.wk, block.feed_forward.w1):
                    linear.weight.requires_grad_(False)
        fsdptag.parametrize(model, mesh, reshard_after_forward=reshard)
        return model

    def train(model):
        trainable = [p for p in model.parameters() if p.requires_grad]
        optim = torch.optim.AdamW(trainable, lr=1e-2)
        losses = []
        for step in range(3):
            tokens = _tokens(dp_rank + 2 * step)
            loss = F.cross_entropy(model(tokens).float().flatten(0, 1), tokens.flatten())
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
        return losses, [p.to_local().clone() for p in model.parameters()]

    def graph_bytes(counts):
        def compile_graph(gm, example_inputs):
            for node in gm.graph.nodes:
                if node.op == "call_function" and "reduce_scatter_tensor" in str(node.target):
                    val = node.args[0].meta["val"]
                    counts["reduce-scatter bytes"] += val.numel() * val.element_size()
            return gm.forward

        return aot_autograd(fw_compiler=lambda gm, _: gm.forward, bw_compiler=compile_graph,
                            partition_fn=min_cut_rematerialization_partition)

    out = {}
    tokens = _tokens(dp_rank)
    for reshard in (False, True):
        eager_bytes = {}
        for freeze in (False, True):
            with CollectiveCounter(mesh) as cc:
                F.cross_entropy(build(reshard, freeze)(tokens).float().flatten(0, 1), tokens.flatten()).backward()
            eager_bytes[freeze] = sum(e.nbytes for e in cc.events if e.kind == "reduce_scatter")
        eager_losses, eager_params = train(build(reshard))
        torch._dynamo.reset()
        counts = collections.Counter()
        model = torch.compile(build(reshard), backend=graph_bytes(counts))
        losses, params = train(model)
        bitwise = losses == eager_losses and all(torch.equal(a, b) for a, b in zip(params, eager_params))
        out[f"zero{3 if reshard else 2}"] = (
            f"{'bitwise' if bitwise else 'DIFFER'}, reduce-scatter bytes per step: eager {eager_bytes[True]} "
            f"(all trainable {eager_bytes[False]}), compiled {counts['reduce-scatter bytes']}")
    return out


def _hf_checkpointing(mesh, dp_rank):
    """transformers' LlamaForCausalLM with its own ``activation_checkpointing_enable()``
    and ``layer.compile()`` per decoder layer, as a Hugging Face user would: losses
    and parameters vs eager with the same checkpointing over 3 AdamW steps, and the
    FSDP all-gathers in the compiled layer graphs."""
    from .test_integrations import _hf_llama, _hf_train

    fsdp_group = mesh.get_group().group_name
    out = {}
    for reshard in (False, True):
        def build():
            model = _hf_llama()
            fsdptag.parametrize(model, mesh, reshard_after_forward=reshard)
            model.train()
            model.activation_checkpointing_enable()
            return model

        eager_losses, eager_params = _hf_train(build(), dp_rank)
        torch._dynamo.reset()
        counters.clear()
        counts = collections.Counter()
        model = build()
        for layer in model.model.layers:
            layer.compile(backend=_counting_backend(counts, fsdp_group))
        losses, params = _hf_train(model, dp_rank)
        same = losses == eager_losses and all(torch.equal(params[k], eager_params[k]) for k in params)
        out[f"zero{3 if reshard else 2}"] = (
            f"{'bitwise' if same else 'DIFFER'}, graph breaks {sum(counters['graph_break'].values())}, "
            + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return out


def _tp(dp_rank):
    """TP (dp 1 x tp 2, bf16: the gather is the cast) compiled as a whole model, vs
    eager over 3 AdamW steps; a block compiled alone is refused clearly."""
    world = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))

    def build():
        torch.manual_seed(0)
        model = Llama(CFG)
        model.init_weights()
        apply_tp(model, world["tp"])
        fsdptag.parametrize(model, world, reshard_after_forward=False, mp_policy=MP_BF16)
        fsdptag.apply_ac(model, "selective")
        return model

    out = {}
    tokens = _tokens(0)
    with CollectiveCounter(world) as cc:
        F.cross_entropy(build()(tokens).float().flatten(0, 1), tokens.flatten()).backward()
    out["eager TP all-gathers"] = f"{cc.count('forward', 'all_gather')}/{cc.count('backward', 'all_gather')}"
    eager_losses, eager_grads, eager_params = _train(build(), 0)
    torch._dynamo.reset()
    counters.clear()
    counts = collections.Counter()  # dp is 1: every all-gather in the graphs is TP's
    losses, grads, params = _train(torch.compile(build(), backend=_counting_backend(counts, "")), 0)
    bitwise = losses == eager_losses and all(
        torch.equal(a, b) for a, b in zip(grads + params, eager_grads + eager_params))
    out["whole"] = (f"{'bitwise' if bitwise else 'DIFFER'}, "
                    f"graph breaks: {sum(counters['graph_break'].values())}")
    out["compiled TP all-gathers"] = f"{counts['forward other all-gathers']}/{counts['backward other all-gathers']}"
    torch._dynamo.reset()
    try:
        _compile(build(), "eager", "blocks")(_tokens(0))
        out["blocks"] = "no error"
    except NotImplementedError as e:
        out["blocks"] = str(e)
    return out


def worker():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    dp_rank = mesh.get_local_rank()
    return run_cases({
        "graph counts": functools.partial(_graph_counts, mesh, dp_rank),
        "numerics": functools.partial(_numerics, mesh, dp_rank),
        "TP": functools.partial(_tp, dp_rank),
        "hf checkpointing": functools.partial(_hf_checkpointing, mesh, dp_rank),
        "fsdp2 parity": functools.partial(_fsdp2_parity, mesh, dp_rank),
        "frozen": functools.partial(_frozen, mesh, dp_rank),
    })


@pytest.fixture(scope="module")
def results():
    return launch(2, worker, timeout_s=120)


def test_compiled_graphs_gather_as_eager_does(results):
    """zero2 + AC: no FSDP all-gather in the compiled backward; zero3: each parameter
    re-gathered there (one compiled graph serves both blocks)."""
    rows = result(results, "graph counts")
    assert_expected_inline("\n".join(f"{k}: {v}" for k, v in rows.items()), """\
zero2 ac=none: eager 3/0 | compiled block: backward graphs 1, forward fsdp all-gathers 1, forward graphs 1
zero2 ac=selective: eager 3/0 | compiled block: backward graphs 1, forward fsdp all-gathers 1, forward graphs 1
zero2 ac=plain checkpoint: eager 3/0 | compiled block: backward graphs 1, forward fsdp all-gathers 1, forward graphs 1
zero3 ac=none: eager 3/3 | compiled block: backward fsdp all-gathers 1, backward graphs 1, forward fsdp all-gathers 1, forward graphs 1
zero3 ac=full: eager 3/3 | compiled block: backward fsdp all-gathers 1, backward graphs 1, forward fsdp all-gathers 1, forward graphs 1
zero3 ac=full before parametrize: eager 3/3 | compiled block: backward fsdp all-gathers 1, backward graphs 1, forward fsdp all-gathers 1, forward graphs 1""")


def test_compiled_numerics_match_eager(results):
    rows = result(results, "numerics")
    assert_expected_inline("\n".join(f"{k}: {v}" for k, v in rows.items()), """\
aot_eager blocks zero2 selective bf16: losses, gradients and parameters bitwise, graphs 1, recompiles after step 1: 0, graph breaks: 0
aot_eager blocks zero2 plain checkpoint: losses, gradients and parameters bitwise, graphs 1, recompiles after step 1: 0, graph breaks: 0
aot_eager whole zero3 full: losses, gradients and parameters bitwise, graphs 1, recompiles after step 1: 0, graph breaks: 0
eager whole zero3 selective param: losses, gradients and parameters bitwise, graphs 1, recompiles after step 1: 0, graph breaks: 0
inductor blocks zero3: losses and first gradients within 1e-5, graphs 1, recompiles after step 1: 0, graph breaks: 0""")


def test_compiled_equals_fsdp2_compiled(results):
    assert result(results, "fsdp2 parity") == {"zero2": True, "zero3": True}


def test_hugging_face_checkpointing_compiles(results):
    """Note [Compiled checkpoint, DeviceMesh saved] in _compat/compiled.py: this failed in the
    first forward; zero2 keeps its gathers (saved inside the checkpoint region)."""
    rows = result(results, "hf checkpointing")
    assert_expected_inline("\n".join(f"{k}: {v}" for k, v in rows.items()), """\
zero2: bitwise, graph breaks 0, backward graphs 2, forward fsdp all-gathers 2, forward graphs 2
zero3: bitwise, graph breaks 0, backward fsdp all-gathers 2, backward graphs 2, forward fsdp all-gathers 2, forward graphs 2""")


def test_tp_compiles_with_the_whole_model(results):
    r = result(results, "TP")
    assert r["whole"] == "bitwise, graph breaks: 0", r
    # (c): TP all-gathers follow the user's selective policy in the compiled graphs as in
    # eager: 6 in forward, 9 in backward (5 for the gradients, 4 recomputed).
    assert r["compiled TP all-gathers"] == r["eager TP all-gathers"] == "6/9", r
    assert "compile the whole model instead: torch.compile(model)" in r["blocks"], r


def test_compiled_buckets_reduce_trainable_slots_only(results):
    """Note [Compiled buckets]: frozen weights send no gradient in compiled code either."""
    rows = result(results, "frozen")
    assert_expected_inline("\n".join(f"{k}: {v}" for k, v in rows.items()), """\
zero2: bitwise, reduce-scatter bytes per step: eager 56448 (all trainable 82048), compiled 56448
zero3: bitwise, reduce-scatter bytes per step: eager 56448 (all trainable 82048), compiled 56448""")
