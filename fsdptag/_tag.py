"""The provenance tag: :class:`FSDPTaggedTensor` and the table of ops that keep it.

Note [Tag life cycle]
---------------------
Every access to a parametrized parameter wraps its *local shard* in an
``FSDPTaggedTensor`` carrying an :class:`FSDPTag` (the parameter's FQN and its
reshard decision). From there the tag follows the FSDP data path and nothing
else:

==========================  =====================================================
op (as the dispatcher sees)  why it keeps the tag
==========================  =====================================================
``aten._to_copy``            mixed-precision cast of the shard before the gather
``constant_pad_nd``,         uneven shards: only some ranks pad before the
``new_zeros``, ``cat``,      all-gather, so these must keep the tag or ranks take
``clone``                    different save/recompute decisions and deadlock
``all_gather_into_tensor``   the FSDP all-gather itself
``split_with_sizes_copy``    copies a bucket's gathered parameters out (each
                             piece tagged as its own parameter: ``tag.parts``)
``_wrap_tensor_autograd``    wraps the gather output in an AsyncCollectiveTensor;
                             we put the tag *inside* it (ACT(tagged)) so that ...
``wait_tensor``              ... the later wait, which sees ACT's inner tensor,
                             still sees a tagged tensor
view / alias ops             DTensor unpads with ``narrow``/``slice``, splits for
                             ``_StridedShard``
==========================  =====================================================

Every other op (``mm``, ``add``, ``layer_norm``, ...) is real compute: its
outputs are returned as plain tensors, so the tag never leaks into activations,
the loss, gradients or optimizer state. At the end of the path compute gets a
plain tensor whose storage carries the tag (Note [Marked handout] in ``_handout.py``); its views
(``w.t()``) are tagged through it. The tag's decision fields are static
per parameter, hence identical on every rank (rank independence).

The stored parameter itself is never tagged: the parametrization wraps the
local shard at the access boundary with a differentiable :func:`tag_shard`,
whose backward returns a plain gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor

from ._compat import AsyncCollectiveTensor, set_alias_storage

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

__all__ = ["FSDPTag", "FSDPTaggedTensor", "is_fsdp_tagged", "get_fsdp_tag", "mark_gathered", "output_tag"]


@dataclass(frozen=True)
class FSDPTag:
    """Provenance of a tensor on the FSDP data path of one parameter.

    ``fqn`` names the parameter (as in ``model.named_parameters()`` before
    parametrization); ``reshard_after_forward`` is its zero3 (True) / zero2
    (False) decision. Both are fixed at ``parametrize`` time and identical on
    every rank. A bucket's tag (``fqn`` = its root module) lists its parameters'
    tags in ``parts``, in slot order: its copy-out gives piece ``i`` tag ``parts[i]``.
    """

    fqn: str
    reshard_after_forward: bool
    parts: tuple[FSDPTag, ...] = ()


class FSDPTaggedTensor(torch.Tensor):
    """A plain tensor plus an :class:`FSDPTag`; see Note [Tag life cycle].

    Ops in the tag table return tagged outputs (with correct aliasing for views);
    every other op returns plain tensors.

    Example::

        >>> t = FSDPTaggedTensor(torch.randn(4, 4), FSDPTag("w", True))
        >>> is_fsdp_tagged(t.t()), is_fsdp_tagged(t @ t)
        (True, False)
    """

    _elem: torch.Tensor
    tag: FSDPTag
    __slots__ = ("_elem", "tag")
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, elem: torch.Tensor, tag: FSDPTag, requires_grad: bool = False):
        if type(elem) is FSDPTaggedTensor:
            raise TypeError("FSDPTaggedTensor cannot wrap another FSDPTaggedTensor")
        out = torch.Tensor._make_wrapper_subclass(  # strided layout: the default
            cls,
            elem.size(),
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            device=elem.device,
            requires_grad=requires_grad,
        )
        out._elem = elem
        out.tag = tag
        return out

    def __repr__(self) -> str:
        return f"FSDPTaggedTensor({self._elem!r}, tag={self.tag})"

    def __tensor_flatten__(self):
        return ["_elem"], self.tag

    @staticmethod
    def __tensor_unflatten__(inner_tensors, tag, outer_size, outer_stride):
        return FSDPTaggedTensor(inner_tensors["_elem"], tag)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        tag, inner_args, inner_kwargs = _unwrap(args, kwargs)
        rule = _TAG_TABLE.get(func)
        if rule is None and _is_mutable(func):
            raise in_place_error(tag.fqn, f"in-place op {func}")
        out = func._op(*inner_args, **inner_kwargs)  # the C++ op: skips OpOverload.__call__
        return out if rule is None else rule(func, tag, args, kwargs, out)


def in_place_error(fqn: str, what: str) -> RuntimeError:
    """The error for changing a gathered parameter in place (``what`` names the op)."""
    return RuntimeError(
        f"fsdptag: {what} on the gathered parameter {fqn!r}. The gathered copy is "
        "temporary, so the change would be lost; modify the stored parameter inside "
        "`with fsdptag.disable_active_parametrization():`."
    )


# ---------------------------------------------------------------- unwrapping


# Note [Lean dispatch]: the hot path is hand-written (no pytree): ops on the FSDP
# path take the tagged tensor first and ints/dtypes after; only cat takes a list.


def _unwrap(args: tuple, kwargs: dict | None) -> tuple[FSDPTag, tuple, dict]:
    tag = None
    out = list(args)
    for i, a in enumerate(args):
        if type(a) is FSDPTaggedTensor:
            tag = tag or a.tag
            out[i] = a._elem
        elif type(a) in (list, tuple) and a and isinstance(a[0], torch.Tensor):
            out[i] = type(a)(x._elem if type(x) is FSDPTaggedTensor else x for x in a)
            tag = tag or next((x.tag for x in a if type(x) is FSDPTaggedTensor), None)
    if kwargs:
        kwargs = dict(kwargs)
        for k, v in kwargs.items():
            if type(v) is FSDPTaggedTensor:
                tag = tag or v.tag
                kwargs[k] = v._elem
    return tag, tuple(out), kwargs or {}


_MUTABLE: dict[Any, bool] = {}


def _is_mutable(func) -> bool:
    mutable = _MUTABLE.get(func)
    if mutable is None:
        mutable = _MUTABLE[func] = func._schema.is_mutable
    return mutable


def _wrap(x: Any, tag: FSDPTag) -> Any:
    if isinstance(x, torch.Tensor):
        return FSDPTaggedTensor(x, tag)
    if isinstance(x, (list, tuple)):
        return type(x)(_wrap(y, tag) for y in x)
    return x


# ---------------------------------------------------------------- the tag table

# A rule gets (op, tag, the op's original args and kwargs, the plain output).
_Rule = Callable[[Any, FSDPTag, tuple, dict, Any], Any]
_TAG_TABLE: dict[Any, _Rule] = {}


def _keeps_tag(*ops: Any) -> Callable[[_Rule], _Rule]:
    """Register ``rule`` as the way ``ops`` rewrap their outputs."""

    def register(rule: _Rule) -> _Rule:
        for op in ops:
            _TAG_TABLE[op] = rule
        return rule

    return register


@_keeps_tag(
    # the FSDP cast, gather and wait
    aten._to_copy.default,
    c10d.all_gather_into_tensor.default,
    c10d.wait_tensor.default,
    # padding / repacking DTensor does around the gather (uneven shards, _StridedShard)
    aten.constant_pad_nd.default,
    aten.new_zeros.default,
    aten.cat.default,
    aten.clone.default,
)
def _rewrap_new(func, tag, args, kwargs, out):
    return _wrap(out, tag)


@_keeps_tag(aten.split_with_sizes_copy.default)
def _rewrap_parts(func, tag, args, kwargs, out):
    # A bucket's copy-out (Note [Buckets] in _bucket.py): piece i is parameter i.
    return [FSDPTaggedTensor(x, t) for x, t in zip(out, _parts(tag, len(out)))]


def _parts(tag: FSDPTag, n: int) -> tuple[FSDPTag, ...]:
    return tag.parts if len(tag.parts) == n else (tag,) * n


@_keeps_tag(
    aten.view.default,
    aten._unsafe_view.default,
    aten.slice.Tensor,
    aten.narrow.default,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.chunk.default,
    aten.unbind.int,
    aten.select.int,
    aten.detach.default,
    aten.alias.default,
    aten.t.default,
    aten.transpose.int,
    aten.permute.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.expand.default,
    aten.as_strided.default,
)
def _rewrap_view(func, tag, args, kwargs, out):
    # A view's wrapper must alias its base's storage too, as return_and_correct_aliasing
    # does; every view in the table aliases args[0], so do it directly (Note [Lean dispatch]).
    out = _wrap(out, tag)
    for r in out if isinstance(out, (list, tuple)) else (out,):
        set_alias_storage(r, args[0])
    return out


@_keeps_tag(c10d._wrap_tensor_autograd.default)
def _rewrap_async(func, tag, args, kwargs, out):
    # Tag inside the AsyncCollectiveTensor: its wait_tensor then sees a tagged tensor.
    return AsyncCollectiveTensor(FSDPTaggedTensor(out.elem, tag))


TAG_KEEPING_OPS = frozenset(_TAG_TABLE)
"""Every op whose outputs keep the tag (for docs and tests)."""


# ---------------------------------------------------------------- queries


def _peel(t: Any) -> Any:
    """The tensor one wrapper (DTensor or AsyncCollectiveTensor) in, or None."""
    if isinstance(t, DTensor):
        return t._local_tensor
    if isinstance(t, AsyncCollectiveTensor):
        return t.elem
    return None


_MARK = "_fsdptag_tag"


def mark_gathered(t: torch.Tensor, tag: FSDPTag) -> torch.Tensor:
    """Mark the storage of the plain gathered tensor ``t`` (so every view of it) with
    ``tag``; see Note [Marked handout]. Returns ``t``."""
    setattr(t.untyped_storage(), _MARK, tag)
    return t


def _mark_of(t: torch.Tensor) -> FSDPTag | None:
    """The mark on ``t``'s storage; only plain (or fake, in the estimator) strided
    tensors carry one, and other wrappers may have no storage to ask."""
    if not (type(t) is torch.Tensor or isinstance(t, (torch.nn.Parameter, FakeTensor))):
        return None
    if t.layout is not torch.strided or t.is_nested:
        return None
    try:
        storage = t.untyped_storage()  # ~0.1 µs with the lookup
    except NotImplementedError:  # functorch wrappers (vmap, grad) have no storage to ask
        return None
    return getattr(storage, _MARK, None)


def get_fsdp_tag(t: Any) -> FSDPTag | None:
    """The tag of ``t``, looking through DTensor and AsyncCollectiveTensor wrappers
    (for a plain tensor: its mark, Note [Marked handout])."""
    while not isinstance(t, FSDPTaggedTensor):
        inner = _peel(t)
        if inner is None:
            return _mark_of(t)
        t = inner
    return t.tag


def first_tag(x: Any) -> FSDPTag | None:
    """The tag of ``x``, or of its first element for an op's list/tuple output or input.

    Called by the checkpoint policy for every op: the common cases return first."""
    cls = type(x)
    if cls is torch.Tensor:
        return _mark_of(x)
    if cls is FSDPTaggedTensor:
        return x.tag
    if cls is list or cls is tuple:
        x = x[0] if x else None
    return get_fsdp_tag(x) if isinstance(x, torch.Tensor) else None


def _tagged_inside(x: Any) -> FSDPTaggedTensor | None:
    """The ``FSDPTaggedTensor`` inside ``x``'s DTensor / AsyncCollectiveTensor wrappers."""
    while not isinstance(x, FSDPTaggedTensor):
        x = _peel(x)
        if x is None:
            return None
    return x


_ALIASES: dict[Any, bool] = {}


def _aliases_input(func) -> bool:
    """Whether ``func``'s output is a view of an input (schema alias info, not a write)."""
    aliases = _ALIASES.get(func)
    if aliases is None:
        returns = getattr(func, "_schema", None) and func._schema.returns
        aliases = _ALIASES[func] = bool(returns) and any(
            r.alias_info is not None and not r.alias_info.is_write for r in returns)
    return aliases


def output_tag(func, args: tuple) -> FSDPTag | None:
    """The tag ``func(*args)``'s output carries, told from the op and its inputs before
    it runs (torch 2.11 asks a checkpoint policy then: Note [Policy without the output]
    in ``_checkpoint.py``). The same answer as :func:`first_tag` of the output: an op on
    a tagged tensor keeps the tag iff the tag table has it; a view of a marked handout
    shares its storage, hence its mark (Note [Marked handout]); anything else is plain."""
    for a in args:
        items = a if type(a) in (list, tuple) else (a,)
        for x in items:
            inner = _tagged_inside(x)
            if inner is not None:
                if func is aten.split_with_sizes_copy.default:  # _rewrap_parts: the first piece's
                    return _parts(inner.tag, len(args[1]))[0]
                return inner.tag if func in _TAG_TABLE else None
    if args and _aliases_input(func):
        return first_tag(args[0])
    return None


def innermost(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor inside DTensor / AsyncCollectiveTensor / FSDPTaggedTensor wrappers."""
    while True:
        if isinstance(t, FSDPTaggedTensor):
            t = t._elem
        inner = _peel(t)
        if inner is None:
            return t
        t = inner


def is_fsdp_tagged(t: Any) -> bool:
    """True when ``t`` (or the local tensor inside its DTensor / AsyncCollectiveTensor
    wrappers) is on the FSDP data path of a parameter.

    Example::

        >>> w = model.weight            # a parametrized access: gathered, tagged
        >>> is_fsdp_tagged(w), is_fsdp_tagged(w.t()), is_fsdp_tagged(x @ w.t())
        (True, True, False)
    """
    return get_fsdp_tag(t) is not None
