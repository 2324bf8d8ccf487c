"""Private torch APIs of compiled code: dynamo's compile-start callbacks and config, and
the fix of a partitioner bug (part of :mod:`fsdptag._compat`, whose table lists each).

Note [Compiled checkpoint, DeviceMesh saved]
--------------------------------------------
torch 2.13's partitioner, for a checkpointed region that holds a random op (CPU
flash SDPA counts, even with ``dropout_p=0``), appends the saved RNG states to
the forward's outputs *after* the saved opaque objects (a DTensor's
``DeviceMesh``), while the runtime expects opaque objects last (before SymInts):
the first compiled forward fails with ``expected all tensors_saved_with_vc_check to
be Tensors, got types: [..., DeviceMesh]``. Any compiled checkpoint of DTensor
code with attention hits it (HF's ``gradient_checkpointing_enable()`` with
``layer.compile()``, a plain ``checkpoint`` in a compiled block, full AC); an
fsdptag-free reproduction is in docs/compile.md. ``fix_compiled_rng_states``
wraps ``functionalize_rng_ops`` to move the RNG states before the opaque objects,
in the forward's outputs and the backward's inputs alike; it changes nothing where
no opaque object is saved, so a torch that fixes the bug is unaffected. torch 2.14
still has the bug, but no longer counts SDPA without dropout as random (a dropout
in the region still hits it); torch 2.11 saves no opaque nodes, so it has no bug
and the fix is not installed there. ``tests/test_compat.py`` pins all three.
"""

from __future__ import annotations

import functools
import operator

import torch
import torch._dynamo
import torch._functorch.partitioners as partitioners
from torch._functorch._aot_autograd import graph_compile

__all__ = ["allow_checkpoint_side_effects", "fix_compiled_rng_states", "is_opaque_node", "on_compile_start"]

# torch 2.13+ saves opaque objects (a DTensor's DeviceMesh) in compiled graphs as
# opaque nodes, which is what Note [Compiled checkpoint, DeviceMesh saved] is about;
# torch 2.11 has neither the nodes nor the bug.
is_opaque_node = getattr(graph_compile, "is_opaque_node", None)


def on_compile_start(fn) -> None:
    """Call ``fn(args)`` whenever dynamo starts compiling (once per ``fn``)."""
    handler = torch._dynamo.callback_handler
    if fn not in handler.start_callbacks:
        handler.register_start_callback(fn)


def _is_rng_state(node) -> bool:
    """A saved RNG state: ``run_and_save_rng_state(...)[0]``."""
    return (isinstance(node, torch.fx.Node) and node.op == "call_function"
            and node.target is operator.getitem and node.args[1] == 0
            and isinstance(node.args[0], torch.fx.Node)
            and node.args[0].target is torch._prims.rng_prims.run_and_save_rng_state)


def _rng_states_before_opaque(fw_module: torch.fx.GraphModule, bw_module: torch.fx.GraphModule) -> bool:
    """Note [Compiled checkpoint, DeviceMesh saved]: reorder; True when it had to."""
    out = next(iter(fw_module.graph.find_nodes(op="output")))
    outs = list(out.args[0])
    states = [n for n in outs if _is_rng_state(n)]
    opaque = [i for i, n in enumerate(outs) if isinstance(n, torch.fx.Node) and is_opaque_node(n)]
    if not states or not opaque or opaque[0] > outs.index(states[0]):
        return False
    rest = [n for n in outs if not _is_rng_state(n)]
    out.args = (tuple(rest[:opaque[0]] + states + rest[opaque[0]:]), *out.args[1:])
    placeholders = list(bw_module.graph.find_nodes(op="placeholder"))
    first_opaque = next(p for p in placeholders if is_opaque_node(p))
    for p in placeholders:
        if p.name.startswith("rng_state_output_"):
            first_opaque.prepend(p)
    fw_module.recompile()
    bw_module.recompile()
    return True


def fix_compiled_rng_states() -> None:
    """Install the fix of Note [Compiled checkpoint, DeviceMesh saved] (idempotent),
    on a torch whose partitioner saves opaque nodes (2.13+) only."""
    if is_opaque_node is None:
        return
    original = partitioners.functionalize_rng_ops
    if getattr(original, "_fsdptag_fix", False):
        return

    @functools.wraps(original)
    def functionalize_rng_ops(joint_module, fw_module, bw_module, num_sym_nodes):
        fw_module, bw_module = original(joint_module, fw_module, bw_module, num_sym_nodes)
        _rng_states_before_opaque(fw_module, bw_module)
        return fw_module, bw_module

    functionalize_rng_ops._fsdptag_fix = True
    partitioners.functionalize_rng_ops = functionalize_rng_ops


def allow_checkpoint_side_effects() -> None:
    """Let dynamo trace Python attribute writes inside a checkpoint region, without
    replaying them in the recompute (torchtitan's compile path sets the same)."""
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
