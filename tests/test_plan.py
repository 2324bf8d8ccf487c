"""The planner: its sweep on a small Llama, its recommendation run for real, its inputs."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json

import pytest
import torch
import torch.distributed as dist
from expecttest import assert_expected_inline
from torch._subclasses.fake_tensor import FakeTensorMode

from fsdptag.tools import estimate as est
from fsdptag.tools import plan as planner
from fsdptag.tools.llama import CONFIGS, Llama
from fsdptag.tools.report import calls

from .harness import launch

SEQ = 64
# Between the sweep's smallest and largest peaks (1259364 and 1624420 B at world 2).
BUDGET = 1_550_000


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """``python -m fsdptag.plan`` on the small Llama: (its Plan, stdout, the JSON it wrote)."""
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    with contextlib.redirect_stdout(io.StringIO()) as stdout:
        p = planner.main(["--model", "llama3-debug", "--world-size", "2", "--memory", str(BUDGET),
                          "--seq-len", str(SEQ), "--ac", "none,full", "--json", str(out), "--all"])
    return p, stdout.getvalue(), json.loads(out.read_text())


@pytest.fixture(scope="module")
def swept(cli_run):
    return cli_run[0]


def test_plan_table(swept):
    """Every configuration estimated (zero3-keep-last only where zero2 does not fit and
    zero3 does), the Pareto set fastest first, the recommended calls."""
    assert_expected_inline(planner.format_plan(swept, show_all=True), """\
Pareto set: 1 of 4 configurations that fit in 1.48 MiB (1 do not), fastest first

| # | zero | AC | TP | HSDP | batch | peak | FSDP collectives | TP collectives | compute (recompute) | comm ms | exposed ms | compute ms | GPU-us/token |
|---|---|---|---|---|---|---|---|---|---|---|---|---|---|
| 1 | zero2 | full | 1 | 1 | 1 | 1.21 MiB | 733.88 KiB | 0 B | 60.0 MFLOP (11.0 MFLOP) | 0.007515 | 0.007448 | 0.0001501 | 0.1187 |

Recommended (zero2 full TP1 b1, peak 1.21 MiB):

mesh = init_device_mesh("cuda", (2,), mesh_dim_names=("dp",))
fsdptag.parametrize(model, mesh, reshard_after_forward=False, mp_policy=fsdptag.MixedPrecisionPolicy(torch.bfloat16, torch.float32))
fsdptag.apply_ac(model, "full")
# batch: 1 x 64 tokens per data-parallel rank

Closest that does not fit: zero2 none TP1 b1 1.55 MiB

All configurations, in the order estimated:

| # | zero | AC | TP | HSDP | batch | peak | FSDP collectives | TP collectives | compute (recompute) | comm ms | exposed ms | compute ms | GPU-us/token |
|---|---|---|---|---|---|---|---|---|---|---|---|---|---|
| 1 | zero2 | none | 1 | 1 | 1 | 1.55 MiB | 733.88 KiB | 0 B | 49.0 MFLOP (0 FLOP) | 0.007515 | 0.007461 | 0.0001226 | 0.1185 |
| 2 | zero3 | none | 1 | 1 | 1 | 1.44 MiB | 978.50 KiB | 0 B | 49.0 MFLOP (0 FLOP) | 0.01002 | 0.00993 | 0.0001226 | 0.1571 |
| 3 | zero2 | full | 1 | 1 | 1 | 1.21 MiB | 733.88 KiB | 0 B | 60.0 MFLOP (11.0 MFLOP) | 0.007515 | 0.007448 | 0.0001501 | 0.1187 |
| 4 | zero3 | full | 1 | 1 | 1 | 1.25 MiB | 978.50 KiB | 0 B | 60.0 MFLOP (11.0 MFLOP) | 0.01002 | 0.009903 | 0.0001501 | 0.1571 |
| 5 | zero3-keep-last | none | 1 | 1 | 1 | 1.46 MiB | 824.12 KiB | 0 B | 49.0 MFLOP (0 FLOP) | 0.008439 | 0.008422 | 0.0001226 | 0.1335 |""")


def worker_run_configs(configs):
    """Each (name, reshard_after_forward, ac) for real on 2 gloo ranks: its peak."""
    spec = est.builtin_model("llama3-debug", SEQ)
    mesh = est.build_mesh("cpu", dist.get_world_size(), 1, 1)
    peaks = {}
    for name, reshard, ac in configs:
        torch.manual_seed(0)
        model = est.build_model(spec, mesh, policy="tagged", reshard=reshard, ac=ac, mp="bf16")
        tokens = torch.randint(0, spec.vocab_size, (1, SEQ + 1))
        peaks[name] = est.measure_step(model, tokens, mesh)["peak_bytes"]
    return peaks


def test_recommended_fits_and_rejected_does_not_for_real(swept):
    best = swept.recommended
    rejected = min((r for r in swept.rows if not r.fits), key=lambda r: r.us_per_token)  # the fastest that does not
    configs = [(name, r.estimate.reshard_after_forward, r.candidate.ac) for name, r in
               (("recommended", best), ("rejected", rejected))]
    real = launch(2, worker_run_configs, configs)
    print(f"\nbudget {BUDGET} B: recommended {best.candidate} real peak {real['recommended']} B, "
          f"rejected {rejected.candidate} real peak {real['rejected']} B")
    assert real["recommended"] <= BUDGET < real["rejected"]
    assert (real["recommended"], real["rejected"]) == (best.estimate.peak_bytes, rejected.estimate.peak_bytes)


def test_time_proxy_of_partial_reshard():
    """The k-group re-gathers: (k-1)/k of their bytes over the partial bandwidth."""
    fields = {f: 0 for f in est.MemoryEstimate.__dataclass_fields__}
    e = est.MemoryEstimate(**{**fields, "policy": "tagged", "model": "m", "ac": "none", "mp": "bf16",
                              "world_size": 16, "tp": 1, "hsdp_replicas": 1, "seq_len": 8, "batch": 1,
                              "reshard_after_forward": 4, "fsdp_all_gather_bytes": 800,
                              "fsdp_partial_all_gather_bytes": 800})
    rates = planner.Rates(bandwidth=100.0, partial_bandwidth=300.0)
    comm, _ = planner.time_proxy(e, rates)
    assert comm == 800 * 15 / 16 / 100 + 800 * 3 / 4 / 300
    assert planner.reshard_of("zero3@4", None) == 4


def test_time_proxy_is_explicit():
    """Ring collectives: (n-1)/n of an all-gather / reduce-scatter, twice that for an all-reduce."""
    fields = {f: 0 for f in est.MemoryEstimate.__dataclass_fields__}
    e = est.MemoryEstimate(**{**fields, "policy": "tagged", "model": "m", "ac": "none", "mp": "bf16",
                              "world_size": 16, "tp": 2, "hsdp_replicas": 1, "seq_len": 8, "batch": 1,
                              "fsdp_all_gather_bytes": 800, "fsdp_reduce_scatter_bytes": 1600,
                              "tp_all_reduce_bytes": 100, "forward_flops": 10, "backward_flops": 20,
                              "recompute_flops": 10})
    rates = planner.Rates(bandwidth=100.0, tp_bandwidth=50.0, device_flops=4.0)
    comm, compute = planner.time_proxy(e, rates)
    assert comm == (800 + 1600) * 7 / 8 / 100 + 2 * 100 * 1 / 2 / 50
    assert compute == 40 / 4


def test_keep_last_policy():
    with FakeTensorMode():
        model = Llama(CONFIGS["llama3-debug"])
    assert_expected_inline(repr(planner.keep_last_policy(model)), """{'': True, 'layers.1': False, 'tok_embeddings': False, 'norm': False, 'output': False}""")


def test_cli(cli_run, tmp_path):
    p, stdout, record = cli_run
    assert stdout.endswith(planner.format_plan(p, show_all=True) + "\n")
    assert [(r["zero"], r["ac"], r["fits"], r["pareto"]) for r in record["rows"]] == [
        (r.candidate.zero, r.candidate.ac, r.fits, r.pareto) for r in p.rows]
    assert [r["peak_bytes"] for r in record["rows"]] == [r.estimate.peak_bytes for r in p.rows]
    assert record["keep_last"] == planner.keep_last_policy(Llama(CONFIGS["llama3-debug"]))
    plot_args = ["--model", "llama3-debug", "--world-size", "2", "--memory", "1MiB", "--plot", str(tmp_path / "p.png")]
    if importlib.util.find_spec("matplotlib") is None:  # an optional extra: the error comes before the sweep
        with pytest.raises(ImportError) as e:
            planner.main(plot_args)
        assert str(e.value) == "--plot needs matplotlib: pip install matplotlib==3.11.2"
    else:
        planner.plot(p, str(tmp_path / "p.png"))
        assert (tmp_path / "p.png").stat().st_size > 0


def test_bad_inputs_name_the_fix():
    def error(fn) -> str:
        try:
            fn()
        except (ValueError, TypeError, ImportError) as e:
            return f"{type(e).__name__}: {e}" + ("  [PROCESS GROUP LEFT]" if dist.is_initialized() else "")
        return "no error"

    text = "\n".join(error(f) for f in [
        lambda: planner.parse_bytes("80 gigs"),
        lambda: planner.parse_bytes("-1GiB"),
        lambda: planner.plan("llama3-debug", 2, BUDGET, tp=[0]),
        lambda: planner.plan("llama3-debug", 2, BUDGET, ac=["most"]),
        lambda: planner.plan("llama3-debug", 2, BUDGET, batch=[]),
        lambda: planner.plan("llama3-debug", 2, BUDGET, hsdp=[0]),
        lambda: planner.plan("llama3-debug", 2, BUDGET, microbatches=[1, -2]),
        lambda: planner.plan("llama3-debug", 2, BUDGET, jobs=0),
        lambda: planner.main(["--model", "llama3-debug", "--world-size", "2", "--memory", "lots"]),
    ])
    assert_expected_inline(text, """\
ValueError: cannot read '80 gigs'; write a positive number with an optional unit, e.g. 80GiB, 50GB/s, 400T
ValueError: cannot read '-1GiB'; write a positive number with an optional unit, e.g. 80GiB, 50GB/s, 400T
ValueError: tp=[0]: pass TP degrees >= 1, e.g. --tp 1,2,4,8
ValueError: ac=['most']: use some of ('none', 'full', 'selective', 'layer')
ValueError: batch=[]: pass sequences per data-parallel rank >= 1, e.g. --batch 1,2
ValueError: hsdp=[0]: pass HSDP replica counts >= 1 (1: fully sharded), e.g. --hsdp 1,8
ValueError: microbatches=[1, -2]: pass forward+backward passes per optimizer step >= 1, e.g. --microbatches 1,4
ValueError: jobs=0: pass the number of processes to estimate in, >= 1 (e.g. --jobs 2)
ValueError: cannot read 'lots'; write a positive number with an optional unit, e.g. 80GiB, 50GB/s, 400T""")
    assert planner.parse_bytes("80GiB") == 80 * 2**30 and planner.parse_bytes("50GB/s", "B/s") == 50e9
    assert planner.parse_bytes("400TFLOPS", "FLOP/s") == 400e12 == planner.parse_bytes("4e14")


def test_parallel_sweep_is_the_sequential_one():
    """Note [Parallel sweep]: TP degrees estimated in two processes give the rows, in
    order, that one process gives."""
    args = dict(seq_len=SEQ, ac=["none", "full"], tp=[1, 2])
    one, two = planner.plan("llama3-debug", 4, BUDGET, **args), planner.plan("llama3-debug", 4, BUDGET, jobs=2, **args)
    assert [(r.candidate, r.estimate) for r in one.rows] == [(r.candidate, r.estimate) for r in two.rows]
    assert (one.skipped, one.tp_plan) == (two.skipped, two.tp_plan) and len(one.rows) >= 8


def test_sweep_axes_hsdp_microbatches():
    """HSDP replica counts and microbatches are sweep axes: every row is the estimate of
    its configuration, a replica count that does not split the ranks is skipped with why,
    and the recommended calls set the mesh and the sync up."""
    p = planner.plan("llama3-debug", 4, 10 * BUDGET, seq_len=SEQ, ac=["none"], hsdp=[1, 2, 3],
                     microbatches=[1, 2], batch=[2])
    assert [planner.label(r.candidate) for r in p.rows] == [
        f"{z} none TP1{h} b2{m}" for h in ("", " HSDP2") for m in ("", "x2") for z in ("zero2", "zero3")]
    assert p.skipped == ["tp=1 hsdp=3: 4 data-parallel ranks do not split into 3 replicas of 2 or more"]
    e = p.rows[6].estimate  # zero2 HSDP2 b2x2
    [direct] = est.estimate("llama3-debug", 4, hsdp_replicas=2, microbatches=2, batch=2, seq_len=SEQ,
                            reshard_after_forward=False, ac="none", policies=("tagged",))
    assert e == direct and (e.hsdp_replicas, e.microbatches, e.batch) == (2, 2, 2) and e.fsdp_all_reduce_bytes > 0
    row = p.rows[6]
    assert row.us_per_token == 1e6 * row.step_s / (2 * 2 * SEQ)
    assert_expected_inline(calls(p, row), """\
mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("replicate", "shard"))
fsdptag.parametrize(model, mesh, mode="hybrid_shard", reshard_after_forward=False, mp_policy=fsdptag.MixedPrecisionPolicy(torch.bfloat16, torch.float32))
# batch: 2 x 64 tokens per data-parallel rank and microbatch, 2 microbatches per step: fsdptag.set_requires_gradient_sync(model, False) before all but the last backward""")


def test_overlap_proxy_and_no_overlap(swept):
    """The time proxy replays the timeline (Note [Exposed communication]): what is exposed
    is at most every collective's time summed, and some is hidden (prefetch, reductions in
    flight); ``Rates(overlap=False)`` (``--no-overlap``) is comm + compute."""
    for r in swept.rows:
        assert 0 <= r.exposed_s < r.comm_s, r.candidate
        assert r.step_s == r.compute_s + r.exposed_s
    row = swept.rows[0]
    rates = planner.Rates(overlap=False)
    plain = planner.Row(row.candidate, row.estimate, *planner.time_proxy(row.estimate, rates), row.fits)
    assert plain.exposed_s is None and plain.step_s == plain.comm_s + plain.compute_s
    # zero2 without AC, compute 1000x slower: all that stays exposed is what no compute can
    # hide, the root's and the first block's gathers (nothing runs before them) and the last
    # block's and the root's reductions (nothing runs after them): ring halves over 50 GB/s
    assert row.candidate == planner.Candidate("zero2", "none", 1, 1)
    slow = planner.Rates(device_flops=planner.Rates().device_flops / 1000)
    floor = (65664 + 92416 + 184832 + 131328) / 2 / 50e9
    assert planner.exposed_proxy(row.estimate, slow) == pytest.approx(floor, rel=1e-9)
