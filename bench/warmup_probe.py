"""Start-up (warm-up) time per executable, the default decode buckets against the old ones:
`python -m loopjax.bench.warmup_probe`.

    python -m loopjax.bench.warmup_probe ouro-1.4b                 # on the GPU: a table of both
    python -m loopjax.bench.warmup_probe huginn-0125 --max-num-rows 32
    python -m loopjax.bench.warmup_probe ouro-1.4b --lower-only    # any host: lowering for CUDA only

Settings: `default` (the engine's decode row buckets for the model) and `old-buckets` (1, 2, 4, ..., 128,
the default before the 8-row floor), over the same engine options (--max-num-rows 128,
--max-context-len 1024: run 10's burst engine; --engine-arg KEY=VALUE sets any other
EngineConfig field for both). On the device each setting runs in its own process (no JAX or
Mosaic cache carried from one to the other): the Engine is built and timed (the warm-up wall
time), every executable's lowering and XLA compile seconds (`Runner.compile_times`) are
listed, then one request of --prompt-len tokens decodes --decode-tokens tokens: its time per
output token checks that a 1-row step padded to the smallest bucket costs nothing. A long
request (--max-context-len 4096 --prompt-len 3500) is the hard case: the decode kernels split
each row's context over fewer programs when the bucket has more rows.

--lower-only needs no accelerator: the engine is built over abstract weights and pool
(`jax.ShapeDtypeStruct`, nothing allocated) as the GPU would build it (attention and matmul
'auto' resolved for a GPU, kernels not interpreted) and each warm-up executable is lowered
for CUDA against an abstract H200, with the number of Mosaic GPU kernels in it (custom calls,
distinct kernel hashes: XLA compiles one Mosaic kernel per distinct hash, one at a time) and
of Triton-lowered calls and distinct Triton kernels, by kernel name.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import subprocess
import sys
import time
from collections import Counter
from unittest import mock

SETTINGS = {"default": {}, "old-buckets": {"decode_row_buckets": (1, 2, 4, 8, 16, 32, 64, 128)}}
RESULT_TAG = "WARMUP_PROBE_RESULT "  # the line a per-setting child prints its JSON on


def engine_config(setting: str, args):
    """The setting's EngineConfig: the probe's options, then --engine-arg, then the setting."""
    from loopjax.engine import EngineConfig
    from loopjax.engine_args import engine_config_kwargs
    options = dict(max_num_rows=args.max_num_rows, max_context_len=args.max_context_len,
                   kv_memory_bytes=args.kv_memory_bytes, verbose=False)
    return EngineConfig(**{**options, **engine_config_kwargs(args), **SETTINGS[setting]})


@contextlib.contextmanager
def cuda_target():
    """Trace as on an H200 from any host: `jax.default_backend()` answers 'gpu' to loopjax's
    choices (attention / matmul 'auto', kernels' interpret default), under an abstract H200."""
    import jax
    from jax._src.mesh import AbstractDevice, AbstractMesh
    from jax.sharding import use_abstract_mesh
    h200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H200", 132, "gpu"))
    with mock.patch.object(jax, "default_backend", lambda: "gpu"), use_abstract_mesh(h200):
        yield


def abstract_engine(model_cfg, config, dtype="bfloat16"):
    """An Engine over abstract params and pool (nothing allocated, nothing compiled); build it
    and lower its steps inside `cuda_target()`."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from loopjax import checkpoint, kv_cache
    from loopjax.engine import Engine
    from loopjax.model import Model
    params = checkpoint.model_module(model_cfg).param_specs(model_cfg, jnp.dtype(dtype))
    allocate = kv_cache.allocate_state
    with mock.patch.object(kv_cache, "allocate_state",
                           lambda *a: jax.eval_shape(lambda: allocate(*a))):
        return Engine(Model(model_cfg, params), dataclasses.replace(config, warmup=False))


def mosaic_kernels(stablehlo: str) -> tuple[int, int]:
    """(Mosaic GPU custom calls, distinct kernel hashes) in a lowered module's text."""
    hashes = re.findall(r'kernel_hash = "((?:[^"\\]|\\.)*)"', stablehlo)
    return stablehlo.count("custom_call @mosaic_gpu"), len(set(hashes))


_MOSAIC_NAME = re.compile(r"mosaic_gpu\.dump_basename\\00(\w+?)_\d+\\00")


def mosaic_calls(stablehlo: str) -> dict[str, int]:
    """Mosaic GPU custom calls in a lowered module's text, by kernel name (the name the kernel
    module carries; a jitted kernel function called from several sites is lowered once)."""
    return dict(Counter(m.group(1) for line in stablehlo.splitlines() if "custom_call @mosaic_gpu" in line
                        for m in [_MOSAIC_NAME.search(line)] if m))


_TRITON_CALL = re.compile(r"custom_call @__gpu\$xla\.gpu\.triton\([^)]*\)(.*)")


def _triton_lines(stablehlo: str) -> list[tuple[str, str]]:
    """(kernel name, kernel: its config, IR and operand types) of each Triton-lowered Pallas
    custom call in a lowered module's text; the operands' SSA names are left out."""
    found = []
    for line in stablehlo.splitlines():
        call = _TRITON_CALL.search(line)
        if call:
            name = re.search(r'name = "([^"]*)"', line)
            found.append((name.group(1) if name else "?", call.group(1)))
    return found


def triton_calls(stablehlo: str) -> dict[str, int]:
    """Triton-lowered Pallas custom calls in a lowered module's text, by kernel name (a
    jitted kernel function called from several sites is lowered, and counted, once)."""
    return dict(Counter(name for name, _ in _triton_lines(stablehlo)))


def triton_kernels(stablehlo: str) -> dict[str, int]:
    """Distinct Triton kernels (config, IR, operand types) in a lowered module, by name."""
    return dict(Counter(name for name, _ in set(_triton_lines(stablehlo))))


def lower_warmup(engine) -> list[dict]:
    """Each warm-up executable of `engine` (an abstract_engine) lowered for CUDA: its label,
    lowering seconds (trace included) and Mosaic kernels. Call inside `cuda_target()`."""
    from loopjax.compilation import CompileTime
    runner, records = engine.runner, []
    for batch, kind in runner.warmup_steps(**engine.warmup_options):
        start = time.perf_counter()
        lowered = runner._step.trace(runner.params, runner.state, batch, kind).lower(
            lowering_platforms=("cuda",))
        seconds = time.perf_counter() - start
        text = lowered.as_text()
        calls, distinct = mosaic_kernels(text)
        records.append({"label": CompileTime.of(batch, kind, seconds).label, "lower_s": seconds,
                        "mosaic_calls": calls, "mosaic_kernels": distinct,
                        "mosaic_names": mosaic_calls(text),
                        "triton_calls": triton_calls(text), "triton_kernels": triton_kernels(text)})
    return records


def run_lower_only(setting: str, args) -> dict:
    from loopjax import config as config_lib
    with cuda_target():
        engine = abstract_engine(config_lib.preset(args.preset), engine_config(setting, args))
        records = lower_warmup(engine)
    return {"setting": setting, "executables": records}


def run_on_device(setting: str, args) -> dict:
    """Build the engine (timed warm-up), list its executables, time one request's decode."""
    import numpy as np

    import loopjax
    from loopjax.engine import Engine
    from loopjax.sampling_params import SamplingParams
    model = loopjax.load(args.preset)
    start = time.perf_counter()
    engine = Engine(model, engine_config(setting, args))
    warmup_s = time.perf_counter() - start
    records = [{"label": t.label, "lower_s": t.lower_s, "compile_s": t.compile_s}
               for t in engine.runner.compile_times]
    built = engine.runner.compilations
    prompt = np.random.default_rng(0).integers(3, model.cfg.vocab_size, args.prompt_len).tolist()
    engine.add_request(prompt, SamplingParams(max_tokens=args.decode_tokens, temperature=0.0,
                                              ignore_eos=True), "probe")
    stamps = []  # time of each step that gave the request a token
    while engine.has_unfinished():
        if any(o.request_id == "probe" for o in engine.step()):
            stamps.append(time.perf_counter())
    tpot_ms = 1e3 * (stamps[-1] - stamps[1]) / max(1, len(stamps) - 2)  # after the first decode
    return {"setting": setting, "warmup_s": warmup_s, "executables": records,
            "compiles_in_request": engine.runner.compilations - built, "one_request_tpot_ms": tpot_ms,
            "decode_rows": list(engine.runner.buckets.decode_rows)}


def child(setting: str, argv: list[str]) -> dict:
    """One setting in a fresh process: this command's arguments plus --one SETTING."""
    cmd = [sys.executable, "-m", "loopjax.bench.warmup_probe", *argv, "--one", setting]
    done = subprocess.run(cmd, capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
    return {"setting": setting, "error": f"exit {done.returncode}: {tail[0][:300]}"}


def table(results: list[dict]) -> str:
    """One row per executable label, lowering (+ compile) seconds per setting; totals last."""
    cols = [r["setting"] for r in results]
    labels = list(dict.fromkeys(e["label"] for r in results for e in r.get("executables", [])))
    cell = lambda e: (f"{e['lower_s']:.1f}" + (f" + {e['compile_s']:.1f}" if "compile_s" in e else "")  # noqa: E731
                      + (f" ({e['mosaic_kernels']} mgpu)" if e.get("mosaic_calls") else ""))
    rows = [["executable", *[f"{c}: lower (+ compile) s" for c in cols]]]
    for label in labels:
        found = [next((e for e in r.get("executables", []) if e["label"] == label), None) for r in results]
        rows.append([label, *[cell(e) if e else "-" for e in found]])
    summary = []
    for r in results:
        ex = r.get("executables", [])
        line = (f"{r['setting']}: " + (r["error"] if "error" in r else
                f"{len(ex)} executables, lowering {sum(e['lower_s'] for e in ex):.1f} s"
                + (f", compiles {sum(e['compile_s'] for e in ex):.1f} s summed over threads, "
                   f"warm-up wall {r['warmup_s']:.1f} s, decode rows {r['decode_rows']}, one request "
                   f"{r['one_request_tpot_ms']:.2f} ms/token ({r['compiles_in_request']} compiles in it)"
                   if "warmup_s" in r else "")))
        summary.append(line)
    width = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, width, strict=True)) for row in rows]
    return "\n".join([*lines, *summary])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("preset", nargs="?", default="ouro-1.4b")
    parser.add_argument("--settings", default="default,old-buckets", help="comma-separated: "
                        + ", ".join(SETTINGS))
    parser.add_argument("--max-num-rows", type=int, default=128)
    parser.add_argument("--max-context-len", type=int, default=1024)
    parser.add_argument("--kv-memory-bytes", type=int, default=None)
    parser.add_argument("--prompt-len", type=int, default=512, help="the timed request's prompt")
    parser.add_argument("--decode-tokens", type=int, default=64, help="the timed request's output")
    parser.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="any other EngineConfig field, for every setting (repeatable)")
    parser.add_argument("--lower-only", action="store_true",
                        help="no accelerator: lower each executable for CUDA, abstract weights")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child's setting
    parser.add_argument("--out", default=None, help="write the results as JSON here")


PARSER = argparse.ArgumentParser(prog="python -m loopjax.bench.warmup_probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
add_arguments(PARSER)


def main(argv: list[str] | None = None) -> int:
    parser = PARSER
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.decode_tokens < 3:
        parser.error("--decode-tokens must be at least 3 (the time per token skips the first decode)")
    run = run_lower_only if args.lower_only else run_on_device
    if args.one:
        print(RESULT_TAG + json.dumps(run(args.one, args)), flush=True)
        return 0
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        parser.error(f"unknown settings {unknown}; choose from {', '.join(SETTINGS)}")
    results = [child(s, argv) for s in settings]
    print(table(results), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"preset": args.preset, "results": results}, f, indent=1)
    return 0 if not any("error" in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
