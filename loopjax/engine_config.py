"""EngineConfig: the engine's options (frozen; one field per option, each with its default and
a one-line contract). `loopjax.engine_args` turns every field into a command-line flag; the
Engine (loopjax/engine.py) reads them once at build time."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# Counts that must be >= 1 when set (None, where allowed, picks the documented default).
_POSITIVE = ("page_size", "num_pages", "kv_memory_bytes", "max_num_rows", "max_prefill_tokens",
             "max_prefill_rows", "max_context_len", "shared_kv_slots", "max_loops", "loop_unroll",
             "compile_threads")

HUGINN_INITS = ("seeded", "zero")  # huginn_init's values
# The fields that pick one implementation by name, and the names: the one table the engine
# checks (before it allocates anything) and every command line's choices (`loopjax generate`,
# serve, bench) read; here, not beside the implementations, so `--help` imports no JAX.
OPTION_CHOICES = {"kv_layout": ("per_loop", "shared"),
                  "attention_backend": ("auto", "xla", "pallas", "pallas_mgpu"),
                  "matmul": ("auto", "xla", "streaming", "persistent"), "pointwise": ("xla", "pallas"),
                  "huginn_init": HUGINN_INITS}

# What each default of no value means, in words (the command-line help prints them, not "None").
DEFAULT_WORDS = {
    "num_pages": "from --kv-memory-bytes",
    "kv_memory_bytes": "max-num-rows full contexts, at most 16 GiB yet one at least (when --num-pages is "
                       "unset too)",
    "decode_row_buckets": "1 8 16 32 64 128 (1 4 8 ... past a 4096 context), up to max-num-rows",
    "max_context_len": "the model's context length, at most 4096",
    "decode_context_buckets": "none (the max context only)",
    "max_loops": "the model's default loop count",
    "loop_buckets": "none (the default and max loop counts only)",
    "compile_threads": "the CPU count",
    "compilation_cache_dir": "none (no persistent cache)",
}


@dataclass(frozen=True)
class EngineConfig:
    page_size: int = 16
    num_pages: int | None = None          # KV pool pages; None: from kv_memory_bytes
    kv_memory_bytes: int | None = None    # pool budget; both None: max_num_rows full contexts
    max_num_rows: int = 32                # rows of a decode step (running requests)
    decode_row_buckets: tuple[int, ...] | None = None  # None: step_plan.default_decode_row_buckets
    max_prefill_tokens: int = 2048        # packed prompt tokens per prefill step (chunked above; run 12)
    prefill_token_buckets: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048)
    max_prefill_rows: int = 4             # prompts packed into one prefill step
    max_context_len: int | None = None    # prompt + output; None: min(model context, 4096)
    decode_context_buckets: tuple[int, ...] = ()  # decode contexts compiled besides the max
    kv_layout: str = "per_loop"           # 'per_loop' | 'shared' (docs/semantics.md, Cache layouts)
    shared_kv_slots: int = 8              # K of the shared ring (Huginn)
    max_loops: int | None = None          # deepest loop a request may ask; None: model default
    loop_buckets: tuple[int, ...] = ()    # fused loop counts compiled besides default and max
    attention_backend: str = "auto"       # 'auto' (per phase, measured) | 'xla' | 'pallas' | 'pallas_mgpu'
    matmul: str = "auto"                  # 'auto' | 'xla' | 'streaming' | 'persistent' (matmul_ops.py)
    pointwise: str = "xla"                # 'xla' | 'pallas' (bitwise-equal kernels; pointwise_ops.py)
    loop_unroll: int = 1                  # fixed-depth loops unrolled per fori_loop iteration
    fused_decode: bool = True             # all loops of a fixed-depth decode in one submission
    max_prefill_batches_before_decode: int = 1
    prefill_share_per_loop: bool = True   # a decode of L loops allows L x the prefill batches
    enable_prefix_caching: bool = False   # share KV pages of common prefixes (Huginn: s0 by seed)
    max_logprobs: int = 20                # largest `logprobs` a request may ask: the full sampler's
                                          # static top-k (vLLM's default; the greedy sampler has none)
    adaptive_exit: bool = False           # also compile the adaptive (while_loop) steps at start-up
    enable_weighted_exit: bool = False    # Ouro: compile the weighted-exit steps (exit_weighted)
    huginn_init: str = "seeded"           # default Huginn s0: 'seeded' (position-keyed) | 'zero'
    huginn_seed: int = 0                  # seed of the position-keyed s0
    strict_compile: bool = False          # raise if anything compiles after warm-up
    warmup: bool = True                   # compile every bucket at start-up
    compile_threads: int | None = None    # parallel XLA compiles at warm-up (None: CPU count)
    compilation_cache_dir: str | None = None  # JAX's persistent compile cache (process-wide JAX state)
    verbose: bool = True                  # print the pool at start-up
    async_scheduling: bool = True         # plan and dispatch step n+1 before reading step n

    def check_family(self, family: str) -> None:
        """A one-line ValueError for an option set (off its default) where the model's family
        or the layout ignores it: it ran without effect (enable_weighted_exit on Huginn only
        compiled more steps)."""
        unused = {"enable_weighted_exit": family != "ouro", "huginn_init": family != "huginn",
                  "huginn_seed": family != "huginn",
                  "shared_kv_slots": family != "huginn" or self.kv_layout != "shared"}
        for name, ignored in unused.items():
            value = getattr(self, name)
            if ignored and value != _FIELDS[name].default:  # NOTE: the layout explains only Huginn's ring
                this = (f"this Huginn model has kv_layout={self.kv_layout!r}"
                        if name == "shared_kv_slots" and family == "huginn" else
                        f"this is {_A_MODEL.get(family, f'a {family} model')}")
                raise ValueError(f"EngineConfig.{name}={value!r} applies to {APPLIES_TO[name]}; {this}")

    def context_len(self, model_context_len: int) -> int:
        """The context the engine serves for a model of `model_context_len`."""
        return self.max_context_len or min(model_context_len, 4096)

    def __post_init__(self):
        """Each field has its annotated type (bool is no int here; a list of ints becomes a tuple)
        and the counts are positive: a one-line ValueError naming the field, before the
        engine builds anything (a wrong type came out as a TypeError deep in the build)."""
        for field in dataclasses.fields(self):
            value, kinds = getattr(self, field.name), str(field.type).replace(" ", "").split("|")
            if isinstance(value, list) and "tuple[int,...]" in kinds:  # a list is taken as its tuple
                value = tuple(value)
                object.__setattr__(self, field.name, value)
            if not any(_has_type(value, kind) for kind in kinds):
                raise ValueError(f"EngineConfig.{field.name} must be {field.type}, got {value!r}")
            if field.name in _POSITIVE and value is not None and value < 1:
                raise ValueError(f"EngineConfig.{field.name} must be >= 1, got {value!r}")
        for name in ("loop_buckets", "decode_context_buckets"):  # loop counts, context lengths
            if any(v < 1 for v in getattr(self, name)):
                raise ValueError(f"EngineConfig.{name} entries must be >= 1, got {getattr(self, name)!r}")
        for name in ("decode_row_buckets", "prefill_token_buckets"):  # NOTE: () ran the defaults, resp.
            if getattr(self, name) == ():  # failed naming SchedulerConfig
                raise ValueError(f"EngineConfig.{name} must list at least one count, got ()")
        if self.num_pages is not None and self.kv_memory_bytes is not None:  # NOTE: the budget did nothing
            raise ValueError("EngineConfig.num_pages and kv_memory_bytes both size the KV pool; give one")
        if self.huginn_init not in HUGINN_INITS:  # a request's initial_state=None takes it
            raise ValueError(f"EngineConfig.huginn_init must be 'seeded' or 'zero', got {self.huginn_init!r}")


_FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}
_A_MODEL = {"ouro": "an Ouro model", "huginn": "a Huginn model"}
APPLIES_TO = {"enable_weighted_exit": "Ouro models (exit_weighted)", "huginn_init": "Huginn models",
              "huginn_seed": "Huginn models", "shared_kv_slots": "Huginn's kv_layout='shared' ring"}


def _has_type(value, kind: str) -> bool:
    if kind == "None":
        return value is None
    if kind == "tuple[int,...]":
        return isinstance(value, tuple) and all(_has_type(v, "int") for v in value)
    if kind == "float":  # an int is a float here, as in Python's numeric tower
        return isinstance(value, int | float) and not isinstance(value, bool)
    expected = {"int": int, "str": str, "bool": bool}[kind]
    return isinstance(value, expected) and (kind == "bool" or not isinstance(value, bool))
