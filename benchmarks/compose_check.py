"""Composed vs full-depth estimates (Note [Composed depth]): python benchmarks/compose_check.py 7,8
prints every differing row and the count; 0 expected."""
import sys, time
from dataclasses import replace, asdict
from fsdptag.tools import estimate as est
from fsdptag.tools.models import builtin_model

depths = [int(x) for x in sys.argv[1].split(",")] if len(sys.argv) > 1 else [7, 8]
base = builtin_model("llama3-debug", seq_len=64)
C = est.StepConfig
configs = []
for pol in est.POLICIES:
    for r in (False, True):
        for ac in est.AC_MODES:
            configs.append(C(reshard_after_forward=r, ac=ac, policy=pol))
    configs += [C(tp=2, reshard_after_forward=False, ac="selective", policy=pol),
                C(tp=2, reshard_after_forward=True, ac="full", policy=pol),
                C(hsdp_replicas=2, reshard_after_forward=True, ac="selective", policy=pol),
                C(reshard_after_forward=2, ac="full", policy=pol),
                C(reshard_after_forward="keep-last", ac="selective", policy=pol),
                C(reshard_after_forward="keep-last", ac="layer", policy=pol),
                C(reshard_after_forward=False, ac="selective", policy=pol, microbatches=2, mp="fp32", batch=2)]
bad = 0
for d in depths:
    spec = replace(base, build=base.at_depth(d), depth=d)
    t0 = time.time()
    full = list(est.estimate_each(spec, 8, configs, compose=False))
    t1 = time.time()
    comp = list(est.estimate_each(spec, 8, configs, compose=True))
    t2 = time.time()
    for c, f, g in zip(configs, full, comp):
        fa, ga = asdict(f), asdict(g)
        diff = {k: (fa[k], ga[k]) for k in fa if fa[k] != ga[k]}
        if diff:
            bad += 1
            print("DIFF depth", d, c, diff, flush=True)
    print(f"depth {d}: {len(configs)} configs, full {t1-t0:.1f}s composed {t2-t1:.1f}s", flush=True)
print("differing rows:", bad)
