"""Which attention implementation a step runs (`EngineConfig.attention_backend`): the choice
`kv_cache.PagedAttention` makes per layer call at trace time, and the engine-build check
that an explicit Pallas backend can read the model's KV layout.

Backends: 'xla' (`ref_paged_attention`), 'pallas' (the Triton decode kernel for decode steps,
`StepBatch.decode`, `prefill_attention` for packed prompts), 'pallas_mgpu' (the Mosaic GPU
decode kernel instead of the Triton one) and 'auto' (per phase, the fastest that fits; see
`attention_fn`). A decode step on the Mosaic GPU kernel also writes its K/V in that kernel
(`write_attention_fn`). Kernel modules are imported when first chosen.
"""

from __future__ import annotations

import importlib

import jax

from loopjax.engine_config import OPTION_CHOICES

ATTENTION_BACKENDS = OPTION_CHOICES["attention_backend"]
_PA = "loopjax.kernels.paged_attention"
_MGPU = "loopjax.kernels.paged_attention_mgpu"


def decode_kernel_problems(layout, group_size: int) -> dict[str, str | None]:
    """Why each Pallas decode kernel cannot read this layout (a kv_cache.KVLayout) with
    `group_size` q heads per kv head (None: it can), fastest first on the H200
    (bench/RESULTS.md run 10: Mosaic GPU 57-105% of the copy rate at 32-128 rows, Triton
    29-41%). The Triton kernel takes no per-page plane table (Ouro 'shared'); the Mosaic one
    does, on a Hopper GPU only."""
    mgpu, triton = importlib.import_module(_MGPU), importlib.import_module(_PA)
    mosaic_gpu_problem = importlib.import_module("loopjax.kernels._common").mosaic_gpu_problem
    if layout.decode_page_planes:
        triton_problem = ("Ouro kv layout 'shared' reads decode pages through a per-page plane "
                          "table, which the Triton decode kernel does not take")
    else:
        triton_problem = triton.shape_problem(group_size, layout.page_size)
    return {"pallas_mgpu": mosaic_gpu_problem() or mgpu.shape_problem(
                group_size, layout.page_size, layout.head_dim, layout.dtype),
            "pallas": triton_problem}


def prefill_kernel_problem(layout) -> str | None:
    """Why the Triton prefill kernel (both Pallas backends' prefill) cannot read this layout."""
    prefill = importlib.import_module("loopjax.kernels.prefill_attention")
    return prefill.shape_problem(layout.page_size, layout.head_dim)


def decode_kernels_that_fit(layout, group_size: int) -> tuple[str, ...]:
    """The Pallas decode kernels that can read this layout, fastest first."""
    return tuple(name for name, problem in decode_kernel_problems(layout, group_size).items()
                 if problem is None)


def check_attention_backend(layout, backend: str, cfg) -> None:
    """At engine build: one line when an explicit Pallas backend cannot run this model's
    attention (else a kernel would refuse it at warm-up, naming only its own arguments).
    'auto' takes only kernels that fit and 'xla' reads anything: both always pass."""
    if backend not in ("pallas", "pallas_mgpu"):
        return
    group_size = cfg.num_heads // cfg.num_kv_heads
    problem = decode_kernel_problems(layout, group_size)[backend] or prefill_kernel_problem(layout)
    if problem:
        raise ValueError(f"attention_backend {backend!r} cannot run this {cfg.family} model "
                         f"({group_size} q heads per kv head, head_dim {layout.head_dim}, page_size "
                         f"{layout.page_size}, {layout.dtype.name}, kv layout {layout.kind!r}): "
                         f"{problem}; use 'auto' or 'xla'")


def attention_fn(backend: str, decode: bool, decode_fits: tuple[str, ...] = ("pallas_mgpu", "pallas"),
                 prefill_fits: bool = True):
    """'xla': ref_paged_attention. 'pallas': the Triton decode kernel for decode steps; for
    prefill the kernels' prefill_attention. 'pallas_mgpu': the same with the Mosaic GPU
    decode kernel (kernels/paged_attention_mgpu.py). 'auto' picks per phase what won on the H200:
    on a GPU the first decode kernel of `decode_fits` (run 10: Mosaic 1.6-3.2x Triton and
    1.3-2.3x XLA at 8-128 rows; the Triton kernel beat XLA end to end because it stops at each
    row's length, run 9), XLA when none fits; the flash prefill kernel (1.7-11x, run 1) where
    it fits (`prefill_fits`), else XLA. XLA on CPU."""
    pa = importlib.import_module(_PA)
    if backend == "auto":
        if jax.default_backend() != "gpu":
            return pa.ref_paged_attention
        if not decode:
            return pa.prefill_attention if prefill_fits else pa.ref_paged_attention
        backend = decode_fits[0] if decode_fits else "xla"
    if backend == "xla":
        return pa.ref_paged_attention
    if backend in ("pallas", "pallas_mgpu"):
        if decode and backend == "pallas_mgpu":
            return importlib.import_module(_MGPU).paged_attention_mgpu
        if decode:
            return pa.paged_attention
        return pa.prefill_attention
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(ATTENTION_BACKENDS)}")


def step_attention_fn(backend: str, decode: bool, layout, group_size: int):
    """`attention_fn` for a step of this layout, with the kernels that fit it."""
    return attention_fn(backend, decode, decode_kernels_that_fit(layout, group_size),
                        prefill_kernel_problem(layout) is None)


def kv_write_fn(attend):
    """How a step whose attention function is `attend` writes its K/V before attending: XLA's
    scatter (`paged_attention.write_kv`) beside XLA's attention, the Pallas write kernel
    (`kernels/kv_write.py`, the same copy) beside a Pallas attention kernel."""
    pa = importlib.import_module(_PA)
    if attend is pa.ref_paged_attention:
        return pa.write_kv
    return importlib.import_module("loopjax.kernels.kv_write").write_kv_kernel


def rope_write_fn(attend, layout):
    """The kernel that rotates a step's q and k from the fused projection and writes its K/V
    before `attend` reads them (`kernels/rope_kv_write.py`, one kernel for XLA's two RoPE
    fusions, v's slice and the write), or None (the model rotates, then `kv_write_fn`). Only
    beside the Pallas prefill kernel, and only for layouts with one plane per write (Ouro
    'shared' writes a token into several planes)."""
    if attend is not importlib.import_module(_PA).prefill_attention or layout.decode_page_planes:
        return None
    return importlib.import_module("loopjax.kernels.rope_kv_write").rope_write_kv


def write_attention_fn(attend, layout):
    """The kernel that writes a decode step's K/V and attends in one call, where the step's
    attention function is `attend`, or None (write_kv first, then attend). Only the Mosaic GPU
    decode kernel has one (`paged_attention_mgpu_write`: no XLA scatter kernels), and only for
    layouts without per-page plane tables (Ouro 'shared' writes a token into several planes)."""
    mgpu = importlib.import_module(_MGPU)
    if attend is mgpu.paged_attention_mgpu and not layout.decode_page_planes:
        return mgpu.paged_attention_mgpu_write
    return None
