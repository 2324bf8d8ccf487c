"""The estimator's tables in docs/estimates.md and the README's "Will it fit?".

    python benchmarks/estimate_tables.py [MODEL:WORLD:TP ...] > estimate_tables.md
    python benchmarks/estimate_tables.py --speed     # 70B estimate, 8B and 405B sweeps: composed vs full depth
    python benchmarks/estimate_tables.py --plan      # the planner: llama3-8b and an HF Llama 3 8B config
    python benchmarks/estimate_tables.py --validate  # estimates next to real 2-rank gloo steps

Default: ``fsdptag.estimate`` (fake tensors, one rank) for llama3-8b at world 64 with
TP 8 and TP 1 and llama3-70b at world 256 with TP 8 (or the setups given), seq 8192,
batch 1, bf16, zero2/zero3 x full/selective AC, every policy.

``--plan`` runs ``python -m fsdptag.plan --world-size 64 --memory 80GiB --tp 1,2,4,8``
for ``--model llama3-8b`` and for ``--hf-config`` of Meta-Llama-3-8B's published sizes
(written to a temporary config.json: no network), timing each sweep.

``--validate`` runs a few small configurations (llama3-debug sizes, seq 64, world 2)
for real on 2 gloo ranks and on fake tensors, and prints both side by side.
"""

from __future__ import annotations

import contextlib
import io
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from fsdptag import estimate as est
from fsdptag import plan as planner
from fsdptag.testing.launch import spawn

try:
    import transformers
except ImportError:  # --plan and --validate need it: pip install transformers==5.23.0
    transformers = None

SETUPS = [("llama3-8b", 64, 8), ("llama3-8b", 64, 1), ("llama3-70b", 256, 8)]
# Meta-Llama-3-8B's config.json, the fields that size the model.
HF_LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
                    rope_theta=500000.0, tie_word_embeddings=False)
HF_DEBUG = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, rms_norm_eps=1e-5)
VALIDATE = [  # (model, tp, reshard_after_forward, ac)
    ("llama3-debug", 1, False, "selective"), ("llama3-debug", 1, True, "full"),
    ("llama3-debug", 2, False, "selective"), ("llama3-debug", 2, True, "layer"),
    ("hf", 1, False, "selective"), ("hf", 1, True, "full"), ("hf", 2, False, "none"), ("hf", 2, True, "full"),
]
SEQ = 64


def _g(n: int) -> str:
    return f"{n / 2**30:.2f}"


def memory_tables(setups) -> None:
    for model, world, tp in setups:
        t0 = time.perf_counter()
        print(f"\n#### {model}, world {world}, TP {tp} (rank 0, GiB)\n")
        print("| zero | AC | policy | peak | kept for bwd | gathered params | TP collectives | casts |")
        print("|---|---|---|---|---|---|---|---|")
        for reshard in (False, True):
            for ac in ("full", "selective"):
                for r in est.estimate(model, world, tp=tp, reshard_after_forward=reshard, ac=ac):
                    print(f"| {3 if reshard else 2} | {ac} | {r.policy} | {_g(r.peak_bytes)} | "
                          f"{_g(r.activation_bytes)} | {_g(r.gathered_param_bytes)} | "
                          f"{_g(r.kept_collective_bytes)} | {_g(r.kept_cast_bytes)} |", flush=True)
        print(f"\n({time.perf_counter() - t0:.0f} s)")


SPEED = [  # the commands of issue 26's targets (docs/estimates.md, "Estimates in seconds at any depth")
    ("estimate", "--model llama3-70b --world-size 256 --tp 8 --reshard-after-forward false --ac full --policy tagged"),
    ("plan", "--model llama3-8b --world-size 64 --memory 80GiB --tp 1,2,4,8"),
    ("plan", "--model llama3-405b --world-size 512 --memory 80GiB --tp 8"),
]


def speed() -> None:
    """Each command composed, then with ``--full-depth`` (every block run, as before
    composition), in this process: wall and CPU seconds, and whether the two printed
    the same tables (the lines with timings left out)."""
    for tool, args in SPEED:
        main_fn = planner.main if tool == "plan" else est.main
        outputs, times = [], []
        for extra in ([], ["--full-depth"]):
            t0, cpu0 = time.perf_counter(), planner.cpu_seconds()
            with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()):
                main_fn(args.split() + extra)
            times.append(f"{time.perf_counter() - t0:.1f} s wall ({planner.cpu_seconds() - cpu0:.1f} s CPU)")
            outputs.append([line for line in out.getvalue().splitlines() if "estimated in" not in line])
        print(f"python -m fsdptag.{tool} {args}: composed {times[0]}, --full-depth {times[1]}, "
              f"{'same' if outputs[0] == outputs[1] else 'DIFFERENT'} output", flush=True)


def hf_config(directory: str, sizes: dict) -> str:
    if transformers is None:
        raise ImportError("this needs transformers: pip install transformers==5.23.0")
    transformers.LlamaConfig(**sizes).save_pretrained(directory)
    return f"{directory}/config.json"


def plans() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for which in (["--model", "llama3-8b"], ["--hf-config", hf_config(tmp, HF_LLAMA3_8B)]):
            args = which + ["--world-size", "64", "--memory", "80GiB", "--tp", "1,2,4,8"]
            print(f"\n$ python -m fsdptag.plan {' '.join(args)}\n", flush=True)
            t0, cpu0 = time.perf_counter(), time.process_time()
            planner.main(args + ["--all"])
            print(f"\n(sweep: {time.perf_counter() - t0:.0f} s, {time.process_time() - cpu0:.0f} s CPU)", flush=True)


def _spec(model: str, config: str) -> est.ModelSpec:
    return est.builtin_model(model, SEQ) if model != "hf" else est.hf_config_model(config, seq_len=SEQ)


def _real(config: str) -> dict:
    out = {}
    for case in VALIDATE:
        model, tp, reshard, ac = case
        spec = est.model_spec(_spec(model, config))
        mesh = est.build_mesh("cpu", dist.get_world_size(), tp, 1)
        torch.manual_seed(0)
        m = est.build_model(spec, mesh, policy="tagged", reshard=reshard, ac=ac, mp="bf16")
        out[case] = est.measure_step(m, torch.randint(0, 256, (1, SEQ + 1)), mesh)
    return out


def validate() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        config = hf_config(tmp, HF_DEBUG)
        real = spawn(2, _real, config)
        print("| model | TP | zero | AC | peak B (estimate / real) | FSDP all-gather B | FSDP reduce-scatter B | "
              "TP collectives B | FLOPs fwd+bwd+recompute |")
        print("|---|---|---|---|---|---|---|---|---|")
        for case in VALIDATE:
            model, tp, reshard, ac = case
            (e,) = est.estimate(_spec(model, config), 2, tp=tp, reshard_after_forward=reshard, ac=ac,
                                policies=("tagged",))
            r = real[case]

            def pair(*keys) -> str:
                a, b = sum(getattr(e, k) for k in keys), sum(r[k] for k in keys)
                return f"{a} / {b}" if a != b else f"{a} (equal)"

            print(f"| {'HF Llama' if model == 'hf' else model} | {tp} | {3 if reshard else 2} | {ac} | "
                  f"{pair('peak_bytes')} | {pair('fsdp_all_gather_bytes')} | {pair('fsdp_reduce_scatter_bytes')} | "
                  f"{pair('tp_all_gather_bytes', 'tp_reduce_scatter_bytes', 'tp_all_reduce_bytes')} | "
                  f"{pair('forward_flops', 'backward_flops', 'recompute_flops')} |", flush=True)


def main(argv: list[str]) -> None:
    if argv == ["--speed"]:
        speed()
    elif argv == ["--plan"]:
        plans()
    elif argv == ["--validate"]:
        validate()
    else:
        memory_tables([(m, int(w), int(t)) for m, w, t in (a.split(":") for a in argv)] or SETUPS)


if __name__ == "__main__":
    main(sys.argv[1:])
