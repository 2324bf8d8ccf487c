"""``fsdptag.parametrize``: the entry point. It plans (``_plan.py``: validation, the
sharded parameters, buckets) and only then changes the model: registers the new
parameters, attaches each module's state (``_state.py``) and the root's hooks.
See Note [Parametrization] in ``_param.py`` for what an access does."""

from __future__ import annotations

from typing import Mapping

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ._api import BucketPolicy, DataParallelMode, MixedPrecisionPolicy, OverlapPolicy, ReshardPolicy
from ._class_swap import register_kind
from ._compat import fix_compiled_rng_states
from ._hf import hf_root_methods
from ._plan import plan_parametrization
from ._state import attach, is_parametrized, root_methods

__all__ = ["is_parametrized", "parametrize"]

# The model root's generated class: its own methods and Hugging Face's (Note [Hugging Face Trainer])
register_kind("Parametrized", lambda cls, key: root_methods(cls) | hf_root_methods(cls))


def parametrize(
    model: nn.Module,
    mesh: DeviceMesh | Mapping[str, DeviceMesh],
    *,
    mode: str | DataParallelMode | None = None,
    reshard_after_forward: ReshardPolicy = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    shard_dim: int = 0,
    bucket: BucketPolicy = "blocks",
    prefetch: bool | int | OverlapPolicy = True,
    gradient_divide_factor: float | None = None,
) -> nn.Module:
    """Make ``model`` data parallel over ``mesh``, SimpleFSDP style, in place.

    Every parameter becomes a sharded DTensor; every access to it (``module.weight``)
    returns the all-gathered, cast tensor whose FSDP data path carries an
    :class:`~fsdptag.FSDPTag`. ``reshard_after_forward=True`` (zero3) frees gathered
    parameters after forward and re-gathers them in backward; ``False`` (zero2)
    keeps them. Pass a callable ``(module_fqn, module) -> bool`` or a dict of
    module-FQN prefixes to choose per module. Parameters already on a TP mesh
    (after ``parallelize_module``) gain the data-parallel mesh dims in front.

    ``mesh`` is either the data-parallel mesh or a mesh that also holds the TP dims
    named by the TP parameters' meshes; the data-parallel dims are the dims no TP
    parameter uses. ``mode`` (default: from those dims) is ``"fully_shard"`` (FSDP,
    the default for one dim), ``"hybrid_shard"`` (HSDP: replicate over the first of
    two dims, shard over the second; the default for two) or ``"replicate"`` (DDP,
    one dim). A mesh dim named like a TP dim (``"tp"``) that no parameter uses is an
    error without an explicit ``mode`` (``parallelize_module`` was likely forgotten).
    A dict of module-FQN prefixes to meshes (``""``: the rest) gives modules their
    own mesh, as expert parallelism needs: experts sharded over EP by
    ``parallelize_module`` take ``mesh[("efsdp", "ep")]``, the rest ``mesh["fsdp"]``
    (Note [Meshes per module] in ``_mesh.py``).

    Gradients are averaged over the data-parallel ranks of the ``""`` mesh, also
    where a module's own mesh has fewer (experts: the all-to-all's backward summed
    the rest); ``gradient_divide_factor`` sets what every summed gradient is divided
    by instead (FSDP2's ``set_gradient_divide_factor``; torchtitan, which divides its
    loss by the global token count, passes 1.0).

    ``bucket`` groups parameters into one all-gather / reduce-scatter each (Note
    [Buckets]): ``"blocks"`` (default: each child of an ``nn.ModuleList``, e.g. each
    transformer block, is a bucket root and the model root takes the rest, like
    torchtitan's ``fully_shard`` per block + root), ``"param"`` (one per parameter),
    ``"module"`` (the direct parameters of each module), or ``fn(module_fqn, module)
    -> bool`` marking bucket roots. A bucket is gathered at the first access inside
    its root's ``forward`` and kept until that ``forward`` returns; accesses outside
    it gather per parameter. Buckets apply in every mode, with or without TP
    (``replicate``: one cast and one gradient all-reduce per bucket); with
    ``shard_dim > 0`` parameters gather per parameter. Parameters of one root with
    different dtypes or reshard decisions form separate buckets (one gather each).
    Tied parameters (one tensor registered in several modules) stay one stored
    parameter; a bucket whose root's ``forward`` covers every use gathers it once.

    ``prefetch`` (default True) issues the next bucket's all-gather (in the previous
    forward's order) as soon as a bucket has gathered, so on NCCL it overlaps this
    bucket's compute, also across checkpointed blocks; zero3 re-gathers in backward
    are prefetched the same way, in reverse. It costs one more gathered bucket alive,
    as FSDP2's prefetch does (Note [Prefetch]). ``prefetch=False`` waits each gather
    right after its issue; ``prefetch=k`` keeps k buckets' all-gathers in flight, and
    an :class:`~fsdptag.OverlapPolicy` also sets how many gradient reductions stay in
    flight during backward (default 1, waited by the next or at backward's end).

    A call that raises leaves the model unchanged.

    Example::

        >>> mesh = init_device_mesh("cpu", (world_size,))
        >>> fsdptag.parametrize(model, mesh, reshard_after_forward=False)   # fully_shard
        >>> model(x).sum().backward(); optim.step()
    """
    plan = plan_parametrization(model, mesh, mode, reshard_after_forward, mp_policy, shard_dim,
                                bucket, prefetch, gradient_divide_factor)
    # Everything above only validated; from here on the model changes.
    for fqn, gather in plan.params.items():
        for module, name in gather.module_info.registrations():
            module.register_parameter(name, plan.sharded[fqn])
    for change in plan.modules.values():
        attach(change.module, change.state)
    plan.root.install(model, plan.params, [b for c in plan.modules.values() for b in c.state.buckets])
    fix_compiled_rng_states()  # Note [Compiled checkpoint, DeviceMesh saved] in _compat/compiled.py
    return model

