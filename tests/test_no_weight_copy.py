"""Issue 8, item 1: the decode step never copies a weight inside its loop.

Slicing a stacked weight inside a loop body (by the loop counter, or even by a constant)
materializes a copy of that layer's weights on every iteration (docs/h200.md: 22% of the
copy rate instead of 41-58%). docs/design.md therefore keeps each layer's weights in
separate buffers. These tests compile the decode step (the engine's runner, and the model's
own `ouro.loop` in a `fori_loop`) for the CPU and read the optimized HLO: no instruction
reachable from a while-loop body may dynamic-slice, slice, gather or copy a value of a
weight's shape. Deliberately stacked-weights steps show that the check does fail. The same
check holds the KV pool: a 1-row decode step copies none of it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import loopjax
from loopjax import kv_cache, runner, steps
from loopjax.bench.weight_copies import weight_copies_in_loops, weight_shapes
from loopjax.layers import rope_angles
from loopjax.models import ouro


@pytest.fixture(scope="module")
def model():
    return loopjax.load("ouro-tiny", dtype="float32")


class _NoAttention:
    """Attention backend stand-in: out = q, cache untouched (the weights are what counts)."""

    def __call__(self, kv, layer_id, depth, q, k, v):
        return kv, q


def _loop_decode(layer_fn, num_loops: int):
    """jit((params, x [N, H]) -> x) running layer_fn(params, x, depth) num_loops times."""

    def step(params, x):
        return jax.lax.fori_loop(0, num_loops, lambda d, x: layer_fn(params, x, d), x)

    return jax.jit(step)


def _compiled(fn, *args) -> str:
    return fn.lower(*args).compile().as_text()


def _decode_step_hlo(name: str, num_rows: int, num_pages: int):
    """(model, runner, optimized HLO) of the runner's fused decode step at num_rows rows, as
    the engine jits it (paged KV, exit gate or recurrence, sampling)."""
    m = loopjax.load(name, dtype="float32")
    loops = m.cfg.default_loops
    layout = kv_cache.make_layout(m.cfg, "per_loop", page_size=8, dtype=jnp.float32, num_pages=num_pages,
                                  max_loops=loops)
    r = runner.Runner(m, layout, decode_rows=(num_rows,), prefill_buckets=((1, 8),), max_pages=4,
                      max_loops=loops)
    batch = r.make_batch([], decode=True, loop_begin=0, loop_end=loops, num_rows=num_rows)
    return m, r, _compiled(r._step, r.params, r.state, batch, steps.fused(loops))


@pytest.mark.parametrize("name", ["ouro-tiny", "huginn-tiny"])
def test_engine_decode_step_copies_no_weight(name):
    # NOTE: 3 rows, so that no activation ([3, ...]) has a weight's shape (qk_bias is [2, Hq, D]).
    m, _, hlo = _decode_step_hlo(name, num_rows=3, num_pages=8)
    assert weight_copies_in_loops(hlo, weight_shapes(m.params)) == []


@pytest.mark.parametrize("name", ["ouro-tiny", "huginn-tiny"])
def test_one_row_decode_step_copies_no_kv_pool(name):
    """A one-token K/V scatter became a dynamic-update-slice, and XLA:CPU copied the layer's
    whole pool around it in every loop: the 1-row decode step ran ~50x slower than the 8-row
    one on CPU (kernels/paged_attention.write_plane keeps it a scatter)."""
    _, r, hlo = _decode_step_hlo(name, num_rows=1, num_pages=64)
    pools = {a.shape for a in jax.tree.leaves(r.state.kv)}
    pools |= {(pl, h, p * s, d) for pl, h, p, s, d in pools}  # the flat view the writes use
    assert weight_copies_in_loops(hlo, pools) == []


def _positions(n):
    return rope_angles(jnp.arange(n, dtype=jnp.int32), 16, 10000.0)


def test_model_loop_copies_no_weight(model):
    """ouro.loop (layers unrolled over per-layer buffers) inside the fori_loop over loops."""
    cfg, x = model.cfg, jnp.ones((2, model.cfg.hidden_size), jnp.float32)
    cos, sin = _positions(2)

    def one_loop(params, x, depth):
        return ouro.loop(params, cfg, x, cos, sin, _NoAttention(), None, depth)[0]

    hlo = _compiled(_loop_decode(one_loop, 4), model.params, x)
    assert weight_copies_in_loops(hlo, weight_shapes(model.params)) == []


def _stack_layers(params):
    return {**params, "layers": jax.tree.map(lambda *a: jnp.stack(a), *params["layers"])}


def test_check_fails_on_stacked_weights_indexed_by_counter(model):
    """Negative control: layers in a fori_loop over stacked weights (the slow layout)."""
    cfg, x = model.cfg, jnp.ones((2, model.cfg.hidden_size), jnp.float32)
    cos, sin = _positions(2)
    stacked = _stack_layers(model.params)

    def one_loop(params, x, depth):
        def layer(i, x):  # NOTE: ouro.loop over a one-layer list = that layer + final norm
            lp = jax.tree.map(lambda a: a[i], params["layers"])
            return ouro.loop({**params, "layers": [lp]}, cfg, x, cos, sin, _NoAttention(), None,
                             depth)[0]

        return jax.lax.fori_loop(0, cfg.num_layers, layer, x)

    hlo = _compiled(_loop_decode(one_loop, 4), stacked, x)
    found = weight_copies_in_loops(hlo, weight_shapes(model.params))
    assert found, "stacked weights indexed by the layer counter must be flagged"
    assert any("dynamic-slice" in f for f in found)


def test_check_fails_on_static_slices_of_stacked_weights(model):
    """Negative control: layers unrolled, but each takes a constant slice of stacked weights."""
    cfg, x = model.cfg, jnp.ones((2, model.cfg.hidden_size), jnp.float32)
    cos, sin = _positions(2)
    stacked = _stack_layers(model.params)

    def one_loop(params, x, depth):
        lps = [jax.tree.map(lambda a, i=i: a[i], params["layers"]) for i in range(cfg.num_layers)]
        return ouro.loop({**params, "layers": lps}, cfg, x, cos, sin, _NoAttention(), None, depth)[0]

    hlo = _compiled(_loop_decode(one_loop, 4), stacked, x)
    assert weight_copies_in_loops(hlo, weight_shapes(model.params)), \
        "static slices of stacked weights inside the loop must be flagged"


def test_checker_parses_hlo():
    hlo = """HloModule m

%fused_slice (p0: f32[3,8,16], p1: s32[]) -> f32[1,8,16] {
  %p0 = f32[3,8,16]{2,1,0} parameter(0)
  ROOT %ds = f32[1,8,16]{2,1,0} dynamic-slice(%p0, %p1, %c, %c), dynamic_slice_sizes={1,8,16}
}

%body (t: (s32[], f32[3,8,16])) -> (s32[], f32[3,8,16]) {
  %f = f32[1,8,16]{2,1,0} fusion(%a, %b), kind=kLoop, calls=%fused_slice
  %c = f32[8,16]{1,0} copy(%x)
}

ENTRY %main (a: f32[3,8,16]) -> f32[3,8,16] {
  %c2 = f32[8,16]{1,0} copy(%a)
  %w = (s32[], f32[3,8,16]) while(%t), condition=%cond, body=%body
}
"""
    found = weight_copies_in_loops(hlo, {(8, 16)})
    assert len(found) == 2 and "fused_slice" in found[0] + found[1]  # not the ENTRY copy
    assert weight_copies_in_loops(hlo, {(16, 8)}) == []
    with pytest.raises(AssertionError, match="no while loop"):
        weight_copies_in_loops("ENTRY %main () -> f32[] {\n}\n", {(8, 16)})
