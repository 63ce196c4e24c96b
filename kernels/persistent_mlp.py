"""The MLP half of a decode layer in one resident Mosaic GPU kernel (issue 8, item 4's first
step; docs/persistent_kernel.md): act = silu_mul(x @ w_gate_up), act @ w_down as fp32 split-K
partials, and Ouro's norms after them, with no kernel boundary between them.

At most one program per SM (<= NUM_SMS programs; each takes most of an SM's shared memory).
NOTE (why the waits cannot deadlock): a program only waits for programs of this grid, which
are resident or get an SM as soon as any other kernel's blocks retire (no other kernel
waits on this one), and a program never waits for a later phase. Every product is taken with
swapped operands (out^T = w_tile^T @ x^T: the 64-column weight tile is wgmma's A, the few rows
of x its B), so x needs 8-64 rows of shared memory, not 64.
- Phase 0 (`norm_add_norm_silu_mul`, with phase 1), programs r < M: the attention branch's
  norms before the MLP, row r of kernels/rms_norm.py norm_add_norm on wo's product or
  partials y: h = residual + norm(y) and phase 1's input x = norm(h), stored, then signalled
  to every phase-1 program. Those have their first weight tiles in flight meanwhile and load
  x once all M rows are in.
- Phase 1, programs j < F / 64: the gate and up tiles of columns [64j, 64j + 64) over all of K,
  then act's columns = silu(gate) * up (layers.silu_mul's roundings), stored to `act`, then a
  release-add on the semaphore of the down product's K split that holds those columns.
- Phase 2, programs p < (H / 64) * split_k: column tile p % (H / 64) of w_down over K split
  p // (H / 64). Its first weight tiles are in flight before it waits (its own phase-1 tail,
  or from the start for programs without phase-1 work); it waits until the split's phase-1
  programs have all signalled, then streams act's tiles beside the rest of the weights.
- Phase 3 (`persistent_mlp_norm_add_norm`), programs r < M: once every phase-2 program has
  signalled, row r of the partials summed in split order, then kernels/rms_norm.py
  norm_add_norm's math: h = residual + norm(y), and norm(h) with the next weight.
`persistent_mlp` stops after phase 2: act and the partials [split_k, M, H] f32.

The programs synchronize through `counters`, a jax Ref of int32 [NUM_COUNTERS] updated in
place, zero on entry and zero again on exit (so one buffer serves every call of a step:
Ops.mlp_scratch). Each waiting program has its own counter: a signaller adds 1 to each of
its waiters' counters (one release fence, then relaxed adds), and a waiter waits for its
count and takes it back off (acquire). Pallas's own global semaphores are zero-filled before
every call instead (a memset and one more launch gap per call: bench/RESULTS.md runs 17 and
25). Counters [0, units2) are phase 2's, [units2, units2 + M) phase 3's rows', and
[PHASE1_COUNTERS, + F / 64) phase 1's programs' (waiting for phase 0).

Interpret mode has no semaphores and runs programs one after another, so there each phase
runs as its own kernel (same bodies) for the CPU tests; the GPU runs the phases in one
kernel, checked against the same twins on the device (bench/probes/persistent_mlp_check.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plmgpu

from loopjax import layers

from ._common import SMEM_BUDGET, one_lowering_per_config, resolve_interpret
from ._mgpu import B_ROWS, b_rows, proxy_fence, signal_counters, stream_tiles, tile_transforms, wait_counter
from .rms_norm import check_norm_add_norm_inputs, ref_norm_add_norm
from .streaming_config import NUM_SMS

__all__ = ["default_split_k", "norm_add_norm_silu_mul", "norms_silu_mul_problem", "persistent_mlp",
           "persistent_mlp_norm_add_norm", "ref_norm_add_norm_silu_mul", "ref_persistent_mlp",
           "shape_problem", "silu_mul_problem", "silu_mul_product"]

TILE = 64  # weight tile columns (wgmma's A rows) and rows (K per step)
F32 = jnp.float32
PHASE1_COUNTERS = NUM_SMS + 64  # phase 2's programs (<= NUM_SMS) and phase 3's rows (<= 64) below
NUM_COUNTERS = PHASE1_COUNTERS + NUM_SMS  # then phase 1's programs (waiting for phase 0)


def ref_persistent_mlp(x, w_gate_up, w_down):
    """(act, act @ w_down in fp32): layers.linear_silu_mul, then the f32 product (its split-K
    partials summed)."""
    act = layers.linear_silu_mul(x, w_gate_up)
    return act, jnp.dot(act, w_down, preferred_element_type=F32)


def ref_norm_add_norm_silu_mul(y, residual, norm_weight, next_norm_weight, eps: float, w_gate_up):
    """(h, act): kernels/rms_norm.py ref_norm_add_norm, then layers.linear_silu_mul of its normed h."""
    h, x = ref_norm_add_norm(y, residual, norm_weight, next_norm_weight, eps)
    return h, layers.linear_silu_mul(x, w_gate_up)


def default_split_k(h: int, f: int) -> int | None:
    """The down product's K splits: the most of (4, 2, 1) whose tiles divide F and whose
    programs ((H / 64) per split) fit one per SM; None if none does."""
    return next((s for s in (4, 2, 1) if f % (TILE * s) == 0 and (h // TILE) * s <= NUM_SMS), None)


def shape_problem(x, w_gate_up, w_down, split_k: int | None = None) -> str | None:
    """Why the kernel cannot take these inputs (a one-line error), or None when it can."""
    (m, h), f = x.shape, w_down.shape[0]
    if x.ndim != 2 or x.dtype == F32 or w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
        return "persistent_mlp takes bfloat16/float16 x [M, H] and weights of x's dtype"
    if w_gate_up.shape != (h, 2 * f) or w_down.shape != (f, h):
        return (f"persistent_mlp needs w_gate_up [H, 2F] and w_down [F, H], got "
                f"{w_gate_up.shape} and {w_down.shape} for x {x.shape}")
    split_k = split_k or default_split_k(h, f)
    if m > 64 or h % TILE or not split_k or f % (TILE * split_k):
        return (f"persistent_mlp takes <= 64 rows and H, F / split_k multiples of {TILE}: "
                f"M={m}, H={h}, F={f}, split_k={split_k}")
    if f // TILE > NUM_SMS or (h // TILE) * split_k > NUM_SMS:
        return (f"persistent_mlp needs at most {NUM_SMS} programs per phase: "
                f"{f // TILE} and {(h // TILE) * split_k}")
    return None


def silu_mul_problem(x, w_gate_up) -> str | None:
    """Why `silu_mul_product` cannot take these inputs (a one-line error), or None."""
    (m, h), n = x.shape, w_gate_up.shape[1]
    if x.ndim != 2 or x.dtype == F32 or w_gate_up.dtype != x.dtype or w_gate_up.shape[0] != h:
        return "silu_mul_product takes bfloat16/float16 x [M, H] and w_gate_up [H, 2F] of x's dtype"
    if m not in B_ROWS or h % TILE or n % (2 * TILE):
        return (f"silu_mul_product takes M in {B_ROWS} and H, F multiples of {TILE}: "
                f"M={m}, H={h}, 2F={n}")
    return None


def silu_mul_product(x, w_gate_up, *, num_stages: int = 6, interpret: bool | None = None):
    """layers.linear_silu_mul(x, w_gate_up) -> act [M, F]: phase 1 alone, as its own kernel
    (F / 64 programs, no semaphores). M must be its own row padding (8, 16, 32, 64)."""
    problem = silu_mul_problem(x, w_gate_up)
    if problem:
        raise ValueError(problem)
    (act,) = _call(x, w_gate_up, None, None, None, None, None, split_k=1, num_stages=num_stages,
                   phases=(1,), eps=None, interpret=resolve_interpret(interpret))
    return act


def new_counters():
    """A zeroed counters Ref (see the module's docstring): one serves any number of calls."""
    return jax.new_ref(jnp.zeros((NUM_COUNTERS,), jnp.int32))


def persistent_mlp(x, w_gate_up, w_down, *, split_k: int | None = None, num_stages: int = 6,
                   phases: tuple | None = None, interpret: bool | None = None):
    """x [M, H] (M <= 64, bf16) -> (act [M, F], partials [split_k, M, H] f32) with
    act = layers.linear_silu_mul(x, w_gate_up) and sum(partials) = act @ w_down in fp32."""
    act, partials, _ = _run(x, w_gate_up, w_down, None, None, split_k, num_stages, phases, interpret, None)
    return act, partials[:, : x.shape[0]]


def persistent_mlp_norm_add_norm(x, w_gate_up, w_down, residual, norm_weight, next_norm_weight,
                                 eps: float, counters=None, *, split_k: int | None = None,
                                 num_stages: int = 6, phases: tuple | None = None,
                                 interpret: bool | None = None):
    """layers.mlp_norm_add_norm (Ouro's MLP branch and the norms after it) -> (h, norm(h)),
    all three phases in one kernel on the GPU (the interpreter: one kernel per phase, counters
    unused). counters: a new_counters() Ref, shared with other calls (None: a new one)."""
    _, _, (h, h_normed) = _run(x, w_gate_up, w_down, (residual, norm_weight, next_norm_weight),
                               float(eps), split_k, num_stages, phases, interpret, counters)
    return h, h_normed


def norms_silu_mul_problem(y, residual, w_gate_up) -> str | None:
    """Why `norm_add_norm_silu_mul` cannot take these inputs (a one-line error), or None.
    Assumes y and residual that passed kernels/rms_norm.py check_norm_add_norm_inputs."""
    (m, h), n = residual.shape, w_gate_up.shape[1]
    if residual.dtype == F32 or w_gate_up.dtype != residual.dtype or w_gate_up.shape[0] != h:
        return ("norm_add_norm_silu_mul takes a bfloat16/float16 residual [M, H] and w_gate_up [H, 2F] "
                "of its dtype")
    if m > 64 or h % TILE or n % (2 * TILE) or n // (2 * TILE) > NUM_SMS:
        return (f"norm_add_norm_silu_mul takes <= 64 rows, H a multiple of {TILE} and F of {TILE} up to "
                f"{TILE * NUM_SMS}: M={m}, H={h}, 2F={n}")
    return None


def norm_add_norm_silu_mul(y, residual, norm_weight, next_norm_weight, eps: float, w_gate_up, counters=None,
                           *, num_stages: int = 6, interpret: bool | None = None):
    """(h, act): (h, x) = kernels/rms_norm.py norm_add_norm(y, residual, norm_weight,
    next_norm_weight, eps) with y a product [M, H] in residual's dtype or its fp32 split-K
    partials [S, M, H], and act = layers.linear_silu_mul(x, w_gate_up) [M, F] (Ouro: the
    attention branch's norms, then the MLP's first product). On the GPU, phases 0 and 1 in one
    kernel: every phase-1 program puts its first weight tiles in flight, programs r < M norm
    row r and signal, and the phase-1 programs load x once every row is signalled; no norms
    kernel runs between wo's product and this one. Measured slower than the norms kernel then
    SiLU*up (bench/RESULTS.md run 28), so no step uses it. The interpreter runs the two phases
    as two kernels. counters: a new_counters() Ref, shared with other calls (None: a new one)."""
    check_norm_add_norm_inputs(y, residual, norm_weight, next_norm_weight)
    problem = norms_silu_mul_problem(y, residual, w_gate_up)
    if problem:
        raise ValueError(problem)
    interpret = resolve_interpret(interpret)
    attn = (y if y.ndim == 3 else y[None], residual, norm_weight, next_norm_weight)
    kw = dict(split_k=1, num_stages=num_stages, eps=float(eps), interpret=interpret)
    if interpret:  # no counters there, and programs run one after another
        h, x = _call(None, w_gate_up, None, None, None, None, None, attn, phases=(0,), **kw)
        (act,) = _call(x, w_gate_up, None, None, None, None, None, phases=(1,), **kw)
        return h, act
    counters = new_counters() if counters is None else counters
    h, _, act = _call(None, w_gate_up, None, None, None, None, counters, attn, phases=(0, 1), **kw)
    return h, act


def _run(x, w_gate_up, w_down, norms, eps, split_k, num_stages, phases, interpret, counters):
    """Checks the inputs, then runs each group of phases as one kernel, feeding a group the
    outputs of the earlier ones -> (act, partials, (h, h_normed)) (None where not run).
    phases None: phases 1, 2 (and 3 with norms) in one kernel, one kernel each when
    interpreting (no semaphores there)."""
    interpret = resolve_interpret(interpret)
    if phases is None:
        all_phases = (1, 2, 3) if norms is not None else (1, 2)
        phases = tuple((p,) for p in all_phases) if interpret else (all_phases,)
    problem = shape_problem(x, w_gate_up, w_down, split_k)
    if problem:
        raise ValueError(problem)
    split_k = split_k or default_split_k(x.shape[1], w_down.shape[0])
    if isinstance(phases[0], int):
        phases = (phases,)
    act = partials = normed = None
    for run in phases:
        sync = len(run) > 1 and not interpret
        if sync and counters is None:
            counters = new_counters()
        outs = list(_call(x, w_gate_up, w_down, act, partials, norms, counters if sync else None,
                          split_k=split_k, num_stages=num_stages, phases=tuple(run), eps=eps,
                          interpret=interpret))
        act = outs.pop(0) if 1 in run else act
        partials = outs.pop(0) if 2 in run else partials
        normed = tuple(outs) if 3 in run else normed
    return act, partials, normed


@one_lowering_per_config("split_k", "num_stages", "phases", "eps", "interpret")
def _call(x, w_gu, w_down, act_in, part_in, norms, counters, attn=None, *, split_k: int, num_stages: int,
          phases: tuple[int, ...], eps: float | None, interpret: bool):
    """The kernel running `phases` (a subset of 0, 1, 2, 3 in order); x: phase 1's input (None
    when phase 0 makes it); act_in / part_in: the earlier phases' outputs when they ran as their
    own kernels; norms: (residual, norm_weight, next_norm_weight) for phase 3; attn: (y [S, M, H],
    residual, norm_weight, next_norm_weight) for phase 0; counters: the Ref the phases
    synchronize through (None when one phase runs)."""
    (m, h), f = (x if attn is None else attn[1]).shape, w_gu.shape[1] // 2
    dtype, rows = w_gu.dtype, b_rows(m)
    units1, col_tiles2 = f // TILE, h // TILE
    units2, k2 = col_tiles2 * split_k, f // split_k
    steps1, steps2 = h // TILE, k2 // TILE
    per_split = k2 // TILE  # phase-1 programs (64 act columns each) per down K split
    # NOTE: >= 2 slots where a program has >= 2 tiles: a slot is refilled after the next
    # tile's product is issued (one wgmma group in flight), so one slot would wait forever
    stages1, stages2 = min(max(2, num_stages), steps1), min(max(2, num_stages), steps2)
    stages1, stages2 = _fit_smem(stages1 if 1 in phases else 0, stages2 if 2 in phases else 0, rows,
                                 dtype.itemsize)
    sync = counters is not None
    assert sync == (len(phases) > 1 and not interpret) and units2 + m <= PHASE1_COUNTERS
    staged = rows != m  # act's tiles leave through shared memory, TMA clipping the rows past M
    transforms = tile_transforms(TILE, dtype)  # 64 columns: the weight tile (A) and x (B)
    in_names = (["y", "attn_residual", "attn_norm_w", "mlp_norm_w"] if 0 in phases else [])
    in_names += (["x"] if 1 in phases and 0 not in phases else []) + ["w_gu"]
    in_names += ["w_down"] if 2 in phases else []
    in_names += ["act"] if 2 in phases and 1 not in phases else []
    in_names += ["part"] if 3 in phases and 2 not in phases else []
    in_names += ["residual", "norm_w", "next_norm_w"] if 3 in phases else []
    in_names += ["counters"] if sync else []
    out_names = (["attn_h", "x"] if 0 in phases else []) + (["act"] if 1 in phases else [])
    out_names += (["part"] if 2 in phases else []) + (["h", "h_normed"] if 3 in phases else [])

    def body(*refs):
        r = dict(zip(in_names + out_names, refs, strict=False))
        (wg_smem, wu_smem, x1_smem, bar1_w, bar1_x,
         wd_smem, x2_smem, bar2_w, bar2_x, *act_smem) = refs[len(in_names) + len(out_names):]
        p = jax.lax.axis_index("p")
        # [0, units2): phase 2's programs, then phase 3's rows; from PHASE1_COUNTERS phase 1's
        cnt = r.get("counters")
        c2, s2 = jax.lax.rem(p, col_tiles2), jax.lax.div(p, col_tiles2)  # phase-2 unit of p

        def fetch_w1(t, slot):
            for w_smem, col in ((wg_smem, p * TILE), (wu_smem, f + p * TILE)):
                plmgpu.copy_gmem_to_smem(r["w_gu"].at[pl.ds(t * TILE, TILE), pl.ds(col, TILE)],
                                         w_smem.at[slot], bar1_w.at[slot])

        def fetch_x1(t, slot):
            plmgpu.copy_gmem_to_smem(r["x"].at[pl.ds(0, rows), pl.ds(t * TILE, TILE)],
                                     x1_smem.at[slot], bar1_x.at[slot])

        def fetch_w2(t, slot):
            plmgpu.copy_gmem_to_smem(
                r["w_down"].at[pl.ds(s2 * k2 + t * TILE, TILE), pl.ds(c2 * TILE, TILE)],
                wd_smem.at[slot], bar2_w.at[slot])

        def scope(acc_g, acc_u, acc_d):  # [TILE, rows] f32 each: out^T tiles
            def issue_w1():  # the weights need no activation: in flight before x is in
                for t in range(stages1):
                    fetch_w1(t, t)

            if 0 in phases:
                # NOTE: the row programs norm and signal before their own tiles are in flight: the
                # signal's release fence waited for the copies the signaller had in flight
                # (bench/RESULTS.md run 28: the handoff ~5 -> ~2.8 µs at 1 row)
                if 1 in phases:
                    pl.when((p < units1) & (p >= m))(issue_w1)

                @pl.when(p < m)
                def _():  # row p of the attention branch's norms, and phase 1's input x
                    _norm_add_norm_row(r["y"], p, r["attn_residual"], r["attn_norm_w"], r["mlp_norm_w"],
                                       r["attn_h"], r["x"], eps, dtype)
                    if sync:
                        signal_counters(cnt.at[pl.ds(PHASE1_COUNTERS, units1)], units1)
                    if 1 in phases:
                        pl.when(p < units1)(issue_w1)

            if 1 in phases:
                @pl.when(p < units1)
                def _():
                    def fetch(t, slot):
                        fetch_w1(t, slot)
                        fetch_x1(t, slot)

                    if 0 in phases:  # the weights are in flight: x once every row is signalled
                        if sync:
                            wait_counter(cnt.at[pl.ds(PHASE1_COUNTERS + p, 1)], m)
                            proxy_fence()
                        for t in range(stages1):
                            fetch_x1(t, t)
                    else:
                        for t in range(stages1):
                            fetch(t, t)

                    def multiply(t, slot):
                        x_t = x1_smem.at[slot].T
                        plmgpu.wgmma(acc_g, wg_smem.at[slot].T, x_t)
                        plmgpu.wgmma(acc_u, wu_smem.at[slot].T, x_t)

                    stream_tiles(steps1, stages1, (bar1_w, bar1_x), fetch, multiply, groups=2)
                    plmgpu.wgmma_wait(0)
                    # layers.silu_mul's roundings: gate, up in dtype; silu in f32 rounded; * up
                    gate = acc_g[...].astype(dtype).astype(F32)
                    up = acc_u[...].astype(dtype).astype(F32)
                    silu = (gate / (1.0 + jnp.exp(-gate))).astype(dtype).astype(F32)
                    act = plmgpu.layout_cast((silu * up).astype(dtype),  # [TILE, rows]: act^T's tile
                                             plmgpu.Layout.WGMMA_TRANSPOSED)
                    act_cols = r["act"].at[pl.ds(0, rows), pl.ds(p * TILE, TILE)]
                    if staged:
                        act_smem[0].T[...] = act
                        plmgpu.commit_smem()
                        plmgpu.copy_smem_to_gmem(act_smem[0], act_cols)
                        plmgpu.wait_smem_to_gmem(0)
                    else:
                        act_cols.T[...] = act
                    if sync and 2 in phases:  # the phase-2 programs of this columns' K split
                        # NOTE: a TMA store is complete (wait_smem_to_gmem) before the fence
                        signal_counters(cnt.at[pl.ds(jax.lax.div(p, per_split) * col_tiles2, col_tiles2)],
                                        col_tiles2)
                    if 2 in phases:  # this program's phase-2 weights start streaming now, after
                        # the signal: its release fence would wait for them (run 28)
                        for t in range(stages2):
                            fetch_w2(t, t)

            if 2 in phases:
                @pl.when(p < units2)
                def _():
                    if 1 in phases:
                        @pl.when(p >= units1)  # no phase-1 work: prefetch from the start
                        def _():
                            for t in range(stages2):
                                fetch_w2(t, t)
                    else:
                        for t in range(stages2):
                            fetch_w2(t, t)
                    if sync and 1 in phases:
                        wait_counter(cnt.at[pl.ds(p, 1)], per_split)
                        proxy_fence()

                    def fetch_x(t, slot):
                        plmgpu.copy_gmem_to_smem(
                            r["act"].at[pl.ds(0, rows), pl.ds(s2 * k2 + t * TILE, TILE)],
                            x2_smem.at[slot], bar2_x.at[slot])

                    for t in range(stages2):
                        fetch_x(t, t)

                    def fetch(t, slot):
                        fetch_w2(t, slot)
                        fetch_x(t, slot)

                    def multiply(t, slot):
                        plmgpu.wgmma(acc_d, wd_smem.at[slot].T, x2_smem.at[slot].T)

                    stream_tiles(steps2, stages2, (bar2_w, bar2_x), fetch, multiply, groups=1)
                    plmgpu.wgmma_wait(0)
                    r["part"].at[s2, pl.ds(0, rows), pl.ds(c2 * TILE, TILE)].T[...] = plmgpu.layout_cast(
                        acc_d[...], plmgpu.Layout.WGMMA_TRANSPOSED)
                    if sync and 3 in phases:  # every row
                        signal_counters(cnt.at[pl.ds(units2, m)], m)

            if 3 in phases:
                @pl.when(p < m)
                def _():  # row p: kernels/rms_norm.py norm_add_norm's math on the partials
                    if sync and 2 in phases:
                        wait_counter(cnt.at[pl.ds(units2 + p, 1)], units2)
                    _norm_add_norm_row(r["part"], p, r["residual"], r["norm_w"], r["next_norm_w"], r["h"],
                                       r["h_normed"], eps, dtype)

        acc = plmgpu.ACC((TILE, rows), F32)
        pl.run_scoped(scope, acc, acc, acc)

    shapes = dict(attn_h=((m, h), dtype), x=((m, h), dtype), act=((m, f), dtype),
                  part=((split_k, rows, h), F32), h=((m, h), dtype), h_normed=((m, h), dtype))
    out_type = [jax.ShapeDtypeStruct(*shapes[name]) for name in out_names]
    smem = lambda *shape: plmgpu.SMEM(shape, dtype, transforms=transforms)  # noqa: E731
    s1 = stages1 or 1
    s2_ = stages2 or 1
    scratch = [smem(s1, TILE, TILE), smem(s1, TILE, TILE), smem(s1, rows, TILE),
               plmgpu.Barrier(num_arrivals=2, num_barriers=s1),
               plmgpu.Barrier(num_arrivals=1, num_barriers=s1),
               smem(s2_, TILE, TILE), smem(s2_, rows, TILE),
               plmgpu.Barrier(num_arrivals=1, num_barriers=s2_),
               plmgpu.Barrier(num_arrivals=1, num_barriers=s2_)]
    scratch += [plmgpu.SMEM((rows, TILE), dtype)] if staged and 1 in phases else []
    num_programs = max(units1 if 1 in phases else 0, units2 if 2 in phases else 0,
                       m if 3 in phases or 0 in phases else 0)
    args = dict(x=x, w_gu=w_gu, w_down=w_down, act=act_in, part=part_in, counters=counters)
    if norms is not None:
        args.update(residual=norms[0], norm_w=norms[1], next_norm_w=norms[2])
    if attn is not None:
        args.update(y=attn[0], attn_residual=attn[1], attn_norm_w=attn[2], mlp_norm_w=attn[3])
    return plmgpu.kernel(body, out_type=out_type, scratch_types=scratch, grid=(num_programs,),
                         grid_names=("p",), kernel_name="loopjax_persistent_mlp",
                         interpret=plmgpu.InterpretGPUParams() if interpret else None)(
        *[args[name] for name in in_names])


def _norm_add_norm_row(y_ref, row, residual_ref, norm_w_ref, next_norm_w_ref, h_ref, h_normed_ref,
                       eps: float, dtype):
    """Row `row` of kernels/rms_norm.py norm_add_norm: y_ref [S, M, H] (a product in dtype, S = 1,
    or fp32 split-K partials, summed in split order and rounded once), h = residual + norm(y),
    stored with norm(h) by the next weight."""
    h = residual_ref.shape[1]
    y = y_ref[0, row].astype(F32)
    for s in range(1, y_ref.shape[0]):
        y = y + y_ref[s, row]
    y = _rnd(y, dtype)
    out = _rnd(residual_ref[row].astype(F32) + _normalize(y, norm_w_ref[...], h, eps, dtype), dtype)
    h_ref[row] = out.astype(dtype)
    h_normed_ref[row] = _normalize(out, next_norm_w_ref[...], h, eps, dtype).astype(dtype)


def _fit_smem(stages1: int, stages2: int, rows: int, itemsize: int) -> tuple[int, int]:
    """Ring slots of the phases that run (0: not run) with one slot fewer for the larger ring
    until both fit SMEM_BUDGET, not below 2 (a ring of two or more tiles deadlocks with one).
    NOTE: 64 rows at 6 + 6 slots asked for 248,000 bytes of the H200's 232,448 (run 18)."""
    tile = TILE * TILE * itemsize
    def smem(s1, s2):
        return s1 * (2 * tile + rows * TILE * itemsize) + s2 * (tile + rows * TILE * itemsize)
    while smem(stages1, stages2) > SMEM_BUDGET and max(stages1, stages2) > 2:
        if stages2 <= 2 or (stages1 > 2 and 2 * stages1 >= stages2):  # the ring holding more bytes
            stages1 -= 1
        else:
            stages2 -= 1
    return stages1, stages2


def _rnd(v, dtype):
    return v.astype(dtype).astype(F32)


def _normalize(v, weight, h: int, eps: float, dtype):
    """layers.rms_norm of an f32 row v [H] (values of dtype) with weight [H] in dtype, as
    kernels/rms_norm.py spells it: f32 statistics, the normalized row rounded to dtype before
    the weight multiply, rounded again (f32 out)."""
    mean = jnp.sum(v * v) * jnp.float32(1.0 / h)
    return _rnd(weight.astype(F32) * _rnd(v * jax.lax.rsqrt(mean + eps), dtype), dtype)
