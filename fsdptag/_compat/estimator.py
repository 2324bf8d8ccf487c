"""Private torch APIs the estimator needs: the ``fake`` process group's store, FLOP
formulas of grouped-query attention on torch 2.11, and fake collectives that wait as real
ones do (part of :mod:`fsdptag._compat`, whose table lists each)."""

from __future__ import annotations

import contextlib
import importlib

import torch
import torch.distributed._functional_collectives as _funcol
from torch.fx.experimental.proxy_tensor import get_proxy_mode

__all__ = ["fake_store", "fakes_run_eager", "gqa_sdpa_flop_formulas"]


def fake_store():
    """A ``FakeStore`` for the ``fake`` process group (the estimator's, the tests').
    Imported on first use: ``torch.testing`` is not part of ``import fsdptag``."""
    return importlib.import_module("torch.testing._internal.distributed.fake_pg").FakeStore()


_SDPA_FORWARD = ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")


def gqa_sdpa_flop_formulas(formulas: dict) -> dict:
    """``formulas`` (``FlopCounterMode``'s, by op packet) with the SDPA ones counting
    grouped-query attention: torch 2.13+ counts key/value heads broadcast to the
    query's; torch 2.11's formulas assert equal head counts, so there the key and value
    shapes are widened to the query's heads first (the same count)."""
    aten = torch.ops.aten
    probe = formulas[aten._scaled_dot_product_flash_attention]
    q, kv = torch.empty(1, 4, 2, 8, device="meta"), torch.empty(1, 2, 2, 8, device="meta")
    try:
        probe(q, kv, kv, out_val=None)
        return dict(formulas)
    except AssertionError:
        pass
    out = dict(formulas)
    for name in _SDPA_FORWARD:
        for op, q_at in ((getattr(aten, name, None), 0), (getattr(aten, f"{name}_backward", None), 1)):
            if op is not None and op in formulas:
                out[op] = _widen_kv(formulas[op], q_at)
    return out


def _widen_kv(formula, q_at: int):
    def counted(*args, **kwargs):
        q, k, v = args[q_at:q_at + 3]
        if k.shape[1] != q.shape[1]:
            k, v = (torch.empty(t.shape[0], q.shape[1], *t.shape[2:], device="meta") for t in (k, v))
            args = (*args[:q_at + 1], k, v, *args[q_at + 3:])
        return formula(*args, **kwargs)

    return counted


def _eager_are_we_tracing() -> bool:  # torch's, without its "a fake mode is on" guess
    return (torch.compiler.is_compiling() or get_proxy_mode() is not None
            or torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.PythonDispatcher))


@contextlib.contextmanager
def fakes_run_eager():
    """Within: fake collectives wait at first use as real ones do (torch waits at once
    under any fake mode, taking it for a trace): estimates see a real run's waits."""
    saved, _funcol._are_we_tracing = _funcol._are_we_tracing, _eager_are_we_tracing
    try:
        yield
    finally:
        _funcol._are_we_tracing = saved
