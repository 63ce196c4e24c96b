"""KV pool layout: plane counts per family/layout, bytes per token, the ring rule, the
"last exited" fill, and the paged backend against dense causal attention."""

import importlib

import jax.numpy as jnp
import numpy as np
import pytest

from loopjax import attention_backend, config, kv_cache
from loopjax.batch import build_step_batch
from loopjax.layers import causal_attention
from loopjax.sampling_params import SamplingParams


def test_plane_counts_and_bytes_per_token():
    ouro = kv_cache.make_layout(config.preset("ouro-1.4b"), "per_loop", page_size=16,
                                dtype=jnp.bfloat16, num_pages=10)
    assert ouro.num_planes == (4,) * 24
    assert ouro.bytes_per_token == 768 * 1024  # docs/models.md: 768 KiB per token
    huginn = config.preset("huginn-0125")
    full = kv_cache.make_layout(huginn, "per_loop", page_size=16, dtype=jnp.bfloat16, num_pages=10,
                                max_loops=32)
    assert full.num_planes == (1, 1) + (32,) * 4 + (1, 1)  # packed depth planes: 132
    assert full.bytes_per_token == 132 * 2 * 55 * 96 * 2
    ring = kv_cache.make_layout(huginn, "shared", page_size=16, dtype=jnp.bfloat16, num_pages=10,
                                shared_slots=8)
    assert ring.num_planes == (1, 1) + (2,) * 4 + (1, 1) and ring.ring[2] and not ring.ring[0]
    assert int(ring.plane(3, 5)) == 1 and int(ring.plane(0, 0)) == 0 and int(full.plane(3, 5)) == 5
    assert "tokens of capacity" in full.describe() and "bytes/token" in full.describe()


def test_layout_errors():
    tiny = config.preset("huginn-tiny")
    with pytest.raises(ValueError, match="multiple"):
        kv_cache.make_layout(tiny, "shared", page_size=8, dtype=jnp.float32, num_pages=4, shared_slots=6)
    with pytest.raises(ValueError, match="unknown kv layout"):
        kv_cache.make_layout(tiny, "ring", page_size=8, dtype=jnp.float32, num_pages=4)
    with pytest.raises(ValueError, match="too small: kv_memory_bytes=1000 holds 0 pages of 8 tokens"):
        kv_cache.make_layout(tiny, "per_loop", page_size=8, dtype=jnp.float32, kv_memory_bytes=1000)
    sized = kv_cache.make_layout(tiny, "per_loop", page_size=8, dtype=jnp.float32,
                                 kv_memory_bytes=10 * 8 * 36 * 2 * 64 * 4)
    assert sized.num_pages == 10
    # Neither size given: room for default_tokens (whole pages), at most DEFAULT_KV_BYTES.
    fits = kv_cache.make_layout(tiny, "per_loop", page_size=8, dtype=jnp.float32, default_tokens=75)
    assert fits.num_pages == 10
    ouro = config.preset("ouro-1.4b")  # 768 KiB per bf16 token: 16 GiB hold 21,845 tokens
    capped = kv_cache.make_layout(ouro, "per_loop", page_size=16, dtype=jnp.bfloat16, default_tokens=10**6)
    assert capped.num_pages == kv_cache.DEFAULT_KV_BYTES // (768 * 1024 * 16) == 1365
    with pytest.raises(ValueError, match="give num_pages or kv_memory_bytes"):
        kv_cache.make_layout(tiny, "per_loop", page_size=8, dtype=jnp.float32)


def test_fill_last_exited():
    cfg = config.preset("huginn-tiny")
    layout = kv_cache.make_layout(cfg, "per_loop", page_size=4, dtype=jnp.float32, num_pages=3,
                                  max_loops=4)
    rng = np.random.default_rng(0)
    pool = kv_cache.KVPool(tuple(jnp.asarray(rng.normal(size=k.shape), jnp.float32)
                                 for k in kv_cache.allocate(layout).k),
                           tuple(jnp.asarray(rng.normal(size=k.shape), jnp.float32)
                                 for k in kv_cache.allocate(layout).v))
    slots = jnp.array([1, 6, layout.drop_slot], jnp.int32)
    exit_depth = jnp.array([0, 3, 1], jnp.int32)  # token 0 exited after loop 0; token 1 ran all
    core = range(2, 6)
    filled = kv_cache.fill_last_exited(pool, layout, core, slots, exit_depth, 4)
    for layer in range(8):
        before, after = np.asarray(pool.k[layer]), np.asarray(filled.k[layer])
        flat_b = before.reshape(before.shape[0], before.shape[1], -1, before.shape[-1])
        flat_a = after.reshape(flat_b.shape)
        if layer not in core:
            np.testing.assert_array_equal(flat_a, flat_b)
            continue
        for t in range(4):  # token 0: planes 1..3 now hold its plane-0 entry
            np.testing.assert_array_equal(flat_a[t, :, 1], flat_b[0, :, 1])
        np.testing.assert_array_equal(flat_a[:, :, 6], flat_b[:, :, 6])  # token 1 unchanged
        untouched = np.ones(flat_b.shape[2], bool)
        untouched[1] = False
        np.testing.assert_array_equal(flat_a[:, :, untouched], flat_b[:, :, untouched])


def test_paged_backend_matches_dense_causal():
    """Two packed sequences written and attended through the pool == dense causal attention
    of each sequence alone (plane 1 of a 2-plane layer)."""
    cfg = config.preset("ouro-tiny")
    layout = kv_cache.make_layout(cfg, "per_loop", page_size=4, dtype=jnp.float32, num_pages=8)
    params = SamplingParams(temperature=0.0, seed=0)
    from loopjax.batch import RowInput
    rows = [RowInput([1] * 6, 0, [5, 2], True, 4, params), RowInput([1] * 3, 0, [7], True, 4, params)]
    batch = build_step_batch(rows, decode=False, num_rows=2, num_tokens=12, max_pages=3, page_size=4,
                             drop_slot=layout.drop_slot, loop_begin=0, loop_end=4, pad_slot=2)
    batch = jax_tree_asarray(batch)
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.normal(size=(12, 4, 16)), jnp.float32) for _ in range(3))
    attn = kv_cache.PagedAttention(layout, batch)
    pool, out = attn(kv_cache.allocate(layout), 0, 1, q, k, v)
    for lo, hi in ((0, 6), (6, 9)):
        n = hi - lo
        mask = np.arange(n)[:, None] >= np.arange(n)[None, :]
        dense = causal_attention(q[lo:hi], k[lo:hi], v[lo:hi], jnp.asarray(mask))
        np.testing.assert_allclose(np.asarray(out[lo:hi]), np.asarray(dense), atol=1e-5)
    # Padding tokens 9..11 wrote nothing; plane 0 is untouched.
    assert not np.any(np.asarray(pool.k[0])[0])
    written = np.asarray(pool.k[0])[1].transpose(1, 2, 0, 3).reshape(32, 4, 16)
    assert np.count_nonzero(np.any(written != 0, axis=(1, 2))) == 9


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_prefill_rotates_in_the_kv_write_on_the_pallas_kernels(family):
    """layers.rotary_attention on a prefill batch: with the Pallas backend the step's K/V write
    takes the projection's qkv and rotates q and k itself (kernels/rope_kv_write.py); the pool
    and the attention's output are bit for bit those of the model's RoPE, then the call on
    (q, k, v). XLA's backend, decode batches and Ouro's 'shared' layout keep the call. In bf16:
    in f32 XLA's CPU fusion of the RoPE is 1 ulp apart from the same ops alone (pointwise_ops)."""
    import dataclasses
    import functools

    import jax

    from loopjax import layers
    from loopjax.batch import RowInput
    cfg = config.preset(f"{family}-tiny")
    hq = cfg.num_heads
    hkv = cfg.num_kv_heads if family == "ouro" else hq
    d = cfg.head_dim
    layout = kv_cache.make_layout(cfg, "per_loop", page_size=4, dtype=jnp.bfloat16, num_pages=8)
    params = SamplingParams(temperature=0.0, seed=0)
    rows = [RowInput([1] * 6, 0, [5, 2], True, 4, params), RowInput([1] * 3, 0, [7], True, 4, params)]
    batch = jax_tree_asarray(build_step_batch(
        rows, decode=False, num_rows=2, num_tokens=12, max_pages=3, page_size=4,
        drop_slot=layout.drop_slot, loop_begin=0, loop_end=4, pad_slot=2))
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(12, cfg.hidden_size)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(cfg.hidden_size, (hq + 2 * hkv) * d)) * 0.1, jnp.bfloat16)
    cos, sin = layers.rope_angles(batch.positions, d, 10000.0)
    bias = None if family == "ouro" else jnp.asarray(rng.normal(size=(2, hq, d)), jnp.bfloat16)
    rope = layers.QKVRope(cos, sin, hq, hkv, bias)
    layer_id = 1 if family == "ouro" else 2  # Huginn's first core layer: 4 planes
    pool = kv_cache.allocate(layout)

    def run(backend, rotate, layout=layout, batch=batch):
        attn = kv_cache.PagedAttention(layout, batch, backend)
        if rotate:
            return layers.rotary_attention(attn, layers.XLA_OPS, pool, layer_id, 1, x, w, rope)
        return attn(pool, layer_id, 1, *rope.project(layers.XLA_OPS, x, w))

    def rotates(*args, **kwargs):
        return "loopjax_rope_write_kv" in str(jax.make_jaxpr(lambda: run(*args, **kwargs))())

    jit = functools.partial(jax.jit, compiler_options=layers.IDENTITY_COMPILER_OPTIONS)
    assert rotates("pallas", True)
    got, want = jit(lambda: run("pallas", True))(), jit(lambda: run("pallas", False))()
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert np.count_nonzero(np.asarray(got[0].k[layer_id])) > 0
    assert not rotates("xla", True)
    assert not rotates("pallas", True, batch=dataclasses.replace(batch, decode=True))
    if family == "ouro":
        shared = kv_cache.make_layout(cfg, "shared", page_size=4, dtype=jnp.bfloat16, num_pages=8)
        assert not rotates("pallas", True, layout=shared)
    # Nor does a decode step on the Mosaic kernel (it writes in the attention kernel; Huginn's
    # decode with the rotating write was 0.4% slower, bench/RESULTS.md run 21).
    layout8 = kv_cache.make_layout(cfg, "per_loop", page_size=8, dtype=jnp.bfloat16, num_pages=4)
    drows = [RowInput([1], 9, [3, 1], True, 4, params, decoded=True)] * 2
    decode = jax_tree_asarray(build_step_batch(
        drows, decode=True, num_rows=2, num_tokens=2, max_pages=2, page_size=8,
        drop_slot=layout8.drop_slot, loop_begin=0, loop_end=4, pad_slot=2))
    x, rope, pool = x[:2], layers.QKVRope(cos[:2], sin[:2], hq, hkv, bias), kv_cache.allocate(layout8)
    assert not rotates("pallas_mgpu", True, layout=layout8, batch=decode)


def jax_tree_asarray(tree):
    import jax
    return jax.tree.map(jnp.asarray, tree)


def test_ouro_shared_layout_sizes_and_description():
    cfg = config.preset("ouro-1.4b")
    shared = kv_cache.make_layout(cfg, "shared", page_size=16, dtype=jnp.bfloat16, num_pages=10)
    assert shared.num_planes == (4,) * 24 and shared.decode_page_planes == 4
    assert shared.bytes_per_token == 768 * 1024 and shared.bytes_per_decoded_token == 192 * 1024
    text = shared.describe()
    assert "786432 bytes/token" in text and "decoded tokens: 196608 bytes/token" in text
    assert "160 tokens of capacity" in text and "640 decoded tokens of capacity" in text
    per_loop = kv_cache.make_layout(cfg, "per_loop", page_size=16, dtype=jnp.bfloat16, num_pages=10)
    assert per_loop.decode_page_planes == 0 and "decoded tokens" not in per_loop.describe()
    with pytest.raises(ValueError, match="per-page plane table, which the Triton decode kernel"):
        attention_backend.check_attention_backend(shared, "pallas", cfg)
    attention_backend.check_attention_backend(shared, "auto", cfg)
    attention_backend.check_attention_backend(shared, "pallas_mgpu", cfg)  # reads the per-page plane table


def test_ouro_shared_writes_and_reads_by_page_kind():
    """Decode step at loop 2: row 0's token sits in a decode page (plane 1 of page 2) after a
    full prompt page and an earlier decoded token; row 1's token is in the tail of a full page.
    Row 0 writes plane 1 only, row 1 every plane; each reads full pages at plane 2 and the
    decode page at plane 1 == dense attention over exactly those keys."""
    from loopjax.batch import RowInput
    cfg = config.preset("ouro-tiny")
    layout = kv_cache.make_layout(cfg, "shared", page_size=4, dtype=jnp.float32, num_pages=4)
    rng = np.random.default_rng(2)
    shape = kv_cache.allocate(layout).k[0].shape  # [4 planes, Hkv, 4 pages, 4, D]
    pool = kv_cache.KVPool(*((jnp.asarray(rng.normal(size=shape), jnp.float32),) for _ in range(2)))
    params = SamplingParams(temperature=0.0, seed=0)
    rows = [RowInput([1], 5, [0, 2], True, 4, params, page_planes=[-1, 1], decoded=True),
            RowInput([1], 2, [1], True, 4, params, page_planes=[-1], decoded=True)]
    batch = jax_tree_asarray(build_step_batch(
        rows, decode=True, num_rows=2, num_tokens=2, max_pages=2, page_size=4, drop_slot=layout.drop_slot,
        loop_begin=0, loop_end=4, pad_slot=2))
    q, k, v = (jnp.asarray(rng.normal(size=(2, 4, 16)), jnp.float32) for _ in range(3))
    new, out = kv_cache.PagedAttention(layout, batch)(
        kv_cache.KVPool(pool.k[:1], pool.v[:1]), 0, 2, q, k, v)
    before, after = np.asarray(pool.k[0]), np.asarray(new.k[0])
    expected = before.copy()
    expected[1, :, 2, 1] = k[0]          # row 0: its decode page's plane only
    expected[:, :, 1, 2] = k[1]          # row 1: every plane of its full page
    np.testing.assert_array_equal(after, expected)
    vb = np.asarray(pool.v[0])
    def entries(cache, plane, page, num):  # [num, Hkv, D]: the first num slots of a page
        return cache[plane, :, page, :num].transpose(1, 0, 2)
    keys0 = np.concatenate([entries(before, 2, 0, 4), entries(before, 1, 2, 1), k[:1]])
    vals0 = np.concatenate([entries(vb, 2, 0, 4), entries(vb, 1, 2, 1), v[:1]])
    keys1 = np.concatenate([entries(before, 2, 1, 2), k[1:]])
    vals1 = np.concatenate([entries(vb, 2, 1, 2), v[1:]])
    for i, (ks, vs) in enumerate(((keys0, vals0), (keys1, vals1))):
        dense = causal_attention(q[i:i + 1], jnp.asarray(ks), jnp.asarray(vs), jnp.ones((1, len(ks)), bool))
        np.testing.assert_allclose(np.asarray(out[i:i + 1]), np.asarray(dense), atol=1e-5)


def test_auto_attention_picks_by_phase_device_and_layout(monkeypatch):
    """'auto': on a GPU the fastest decode kernel that fits (Mosaic, then Triton; measured,
    RESULTS.md run 10) and the Pallas prefill kernel, XLA for a decode no kernel can read; on
    CPU always XLA."""
    pa = importlib.import_module("loopjax.kernels.paged_attention")
    mgpu = importlib.import_module("loopjax.kernels.paged_attention_mgpu")

    monkeypatch.setattr(attention_backend.jax, "default_backend", lambda: "gpu")
    assert attention_backend.attention_fn("auto", True) is mgpu.paged_attention_mgpu
    assert attention_backend.attention_fn("auto", True, ("pallas",)) is pa.paged_attention
    assert attention_backend.attention_fn("auto", True, ()) is pa.ref_paged_attention
    assert attention_backend.attention_fn("auto", False, ()) is pa.prefill_attention
    # A page size the flash prefill kernel cannot take: 'auto' prefills with XLA.
    assert attention_backend.attention_fn("auto", False, (), prefill_fits=False) is pa.ref_paged_attention
    assert attention_backend.attention_fn("pallas", False) is pa.prefill_attention
    monkeypatch.setattr(attention_backend.jax, "default_backend", lambda: "cpu")
    assert attention_backend.attention_fn("auto", True) is pa.ref_paged_attention
    assert attention_backend.attention_fn("auto", False) is pa.ref_paged_attention
    assert attention_backend.attention_fn("xla", True) is pa.ref_paged_attention


def test_decode_kernels_that_fit_follow_layout_and_shapes():
    """Which decode kernels can read a layout: Mosaic needs page_size % 8 and G <= 8, Triton
    power-of-two G and page size and no per-page plane table (Ouro 'shared')."""
    cfg = config.preset("ouro-tiny")
    fits = attention_backend.decode_kernels_that_fit

    def layout(kind="per_loop", page_size=8):
        return kv_cache.make_layout(cfg, kind, page_size=page_size, dtype=jnp.float32, num_pages=4)

    assert fits(layout(), 2) == ("pallas_mgpu", "pallas")
    assert fits(layout(page_size=12), 2) == ()
    assert fits(layout(page_size=24), 2) == ("pallas_mgpu",)
    assert fits(layout(), 3) == ("pallas_mgpu",)
    assert fits(layout(), 16) == ("pallas",)
    assert fits(layout("shared"), 2) == ("pallas_mgpu",)
    assert fits(layout("shared", page_size=12), 2) == ()
    mgpu = importlib.import_module("loopjax.kernels.paged_attention_mgpu")
    assert mgpu.shape_problem(1, 16, 128, jnp.bfloat16) is None
    # 56 tokens a page: the smallest block is lcm(56, 64) = 448 keys, 2 x 448 x 256 bytes of K/V
    assert "exceeds its 204800 bytes of shared memory" in mgpu.shape_problem(1, 56, 128, jnp.bfloat16)
    assert attention_backend.prefill_kernel_problem(layout()) is None
    assert "page_size (128)" in attention_backend.prefill_kernel_problem(layout(page_size=128))
    assert "page_size (24)" in attention_backend.prefill_kernel_problem(layout(page_size=24))


def test_mosaic_kernels_only_on_a_hopper_gpu(monkeypatch):
    """On a GPU that is not a Hopper (no wgmma / TMA), 'auto' takes no Mosaic GPU kernel (the
    decode attention falls back to Triton's, the products to their Triton kernels) and an
    explicit 'pallas_mgpu' fails at engine build with one line naming the device."""
    import jax

    from loopjax import matmul_ops
    from loopjax.kernels import _common

    class Device:
        platform, device_kind, compute_capability = "gpu", "NVIDIA A100-SXM4-80GB", "8.0"

    cfg = config.preset("ouro-tiny")
    layout = kv_cache.make_layout(cfg, "per_loop", page_size=8, dtype=jnp.float32, num_pages=4)
    x = jnp.zeros((8, 64), jnp.bfloat16)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda *args: [Device()])
    _common.mosaic_gpu_problem.cache_clear()
    try:
        problem = _common.mosaic_gpu_problem()
        assert problem == ("the Mosaic GPU kernels need a Hopper GPU (compute capability 9.x), not "
                           "NVIDIA A100-SXM4-80GB (compute capability 8.0)")
        assert attention_backend.decode_kernels_that_fit(layout, 2) == ("pallas",)
        with pytest.raises(ValueError, match="need a Hopper GPU") as err:
            attention_backend.check_attention_backend(layout, "pallas_mgpu", cfg)
        assert "\n" not in str(err.value)
        assert not matmul_ops._on_mosaic("linear_silu_mul", x)
        Device.compute_capability = "9.0"  # an H100 / H200
        _common.mosaic_gpu_problem.cache_clear()
        assert _common.mosaic_gpu_problem() is None
        assert attention_backend.decode_kernels_that_fit(layout, 2) == ("pallas_mgpu", "pallas")
        assert matmul_ops._on_mosaic("linear_silu_mul", x)
    finally:
        monkeypatch.undo()
        _common.mosaic_gpu_problem.cache_clear()
    assert _common.mosaic_gpu_problem() is None  # a CPU host: interpreter and lowering tests


def test_the_step_kind_reaches_the_attention(monkeypatch):
    """A prefill of as many tokens as rows (N == R) is still a prefill: StepBatch.decode, a
    static field its builder sets, reaches PagedAttention through the jitted step (traced
    here, not compiled), and the two kinds of one shape are two executables."""
    import jax

    import loopjax
    from loopjax.batch import greedy_row
    from loopjax.compilation import CompileTime
    from loopjax.runner import Runner
    from loopjax.steps import fused
    model = loopjax.load("ouro-tiny", dtype="float32")
    layout = kv_cache.make_layout(model.cfg, "per_loop", page_size=8, dtype=jnp.float32, num_pages=8)
    runner = Runner(model, layout, decode_rows=(2,), prefill_buckets=((2, 2),), max_pages=2,
                    max_loops=4)
    seen, real = [], attention_backend.attention_fn
    monkeypatch.setattr(attention_backend, "attention_fn",
                        lambda backend, decode, *fits: seen.append(decode) or real(backend, decode, *fits))
    rows = [greedy_row([5], 0, [1], loops=4), greedy_row([6], 0, [2], loops=4)]
    batches = {}
    for decode in (False, True):
        seen.clear()
        batch = batches[decode] = runner.make_batch(rows, decode=decode, loop_begin=0, loop_end=4)
        assert batch.token_ids.shape == (2,) and batch.page_table.shape == (2, 2)
        assert batch.decode is decode and jax.tree.map(jnp.asarray, batch).decode is decode
        runner._step.trace(runner.params, runner.state, batch, fused(4))
        assert len(seen) == model.cfg.num_layers and set(seen) == {decode}  # the loop traced once
        label = CompileTime.of(batch, fused(4), 0.0).label
        assert label.startswith("decode rows=2" if decode else "prefill rows=2 tokens=2"), label
    assert runner._key(batches[False], fused(4)) != runner._key(batches[True], fused(4))
    assert runner.compilations == 2


def test_a_decode_batch_has_one_token_per_row():
    from loopjax.batch import greedy_row
    with pytest.raises(ValueError, match="one token per row"):
        build_step_batch([greedy_row([5, 6], 0, [1], loops=4)], decode=True, num_rows=2, num_tokens=2,
                         max_pages=1, page_size=8, drop_slot=64, loop_begin=0, loop_end=4, pad_slot=2)


def test_page_tables_hold_each_rows_needed_pages_then_fill():
    """A row's table entries are its first pages its positions need (a longer page list is cut),
    then 0; its planes (-1 for a row without decode pages) then -1; padding rows hold fills only."""
    from loopjax.batch import greedy_row
    rows = [greedy_row([5], 5, [7, 3, 9], loops=4, page_planes=[-1, 2, 0], decoded=True),  # needs 2
            greedy_row([6], 0, [4], loops=4, decoded=True)]
    batch = build_step_batch(rows, decode=True, num_rows=3, num_tokens=3, max_pages=3, page_size=4,
                             drop_slot=64, loop_begin=0, loop_end=4, pad_slot=2)
    np.testing.assert_array_equal(batch.page_table, [[7, 3, 0], [4, 0, 0], [0, 0, 0]])
    np.testing.assert_array_equal(batch.page_plane, [[-1, 2, -1], [-1, -1, -1], [-1, -1, -1]])
    np.testing.assert_array_equal(batch.slot_mapping, [3 * 4 + 1, 4 * 4, 64])
    empty = build_step_batch([], decode=True, num_rows=2, num_tokens=2, max_pages=3, page_size=4,
                             drop_slot=64, loop_begin=0, loop_end=4, pad_slot=2)
    assert not empty.page_table.any() and (empty.page_plane == -1).all()


def _engine(cfg_changes: dict, **engine):
    """An Engine (nothing compiled) over the tiny Ouro with `cfg_changes`, fp32 params."""
    import dataclasses

    import jax

    from loopjax.engine import Engine, EngineConfig
    from loopjax.model import Model
    from loopjax.models import ouro
    cfg = dataclasses.replace(config.preset("ouro-tiny"), **cfg_changes)
    model = Model(cfg, ouro.init_params(cfg, jax.random.key(0), jnp.float32))
    return Engine(model, EngineConfig(**{"page_size": 16, "max_num_rows": 2, "max_context_len": 64,
                                         "verbose": False, "warmup": False, **engine}))


@pytest.mark.parametrize("backend,cfg_changes,engine,cause", [
    ("pallas_mgpu", dict(num_heads=16, num_kv_heads=1), {},
     "the Mosaic GPU kernel takes at most 8 q heads per kv head, got 16"),
    ("pallas_mgpu", {}, dict(page_size=12), "page_size a multiple of 8 (got 12)"),
    ("pallas_mgpu", {}, dict(page_size=24), "the Triton prefill kernel needs powers of two"),
    ("pallas", dict(num_heads=12, num_kv_heads=4), {},
     "power-of-two q heads per kv head (got 3) and page_size (got 16)"),
    ("pallas", {}, dict(page_size=24), "power-of-two q heads per kv head (got 1) and page_size (got 24)"),
    ("pallas", {}, dict(kv_layout="shared"), "per-page plane table"),
])
def test_engine_build_refuses_a_misfit_explicit_backend(backend, cfg_changes, engine, cause):
    """An explicit Pallas backend whose kernels cannot take the model's shapes fails at engine
    build with one line naming the cause; 'auto' (only the kernels that fit) and 'xla' build."""
    with pytest.raises(ValueError) as error:
        _engine(cfg_changes, attention_backend=backend, **engine)
    message = str(error.value)
    assert "\n" not in message and cause in message, message
    assert message.startswith(f"attention_backend {backend!r} cannot run this ouro model (")
    assert message.endswith("; use 'auto' or 'xla'")
    for fallback in ("auto", "xla"):
        assert _engine(cfg_changes, attention_backend=fallback, **engine).runner is not None


def test_engine_build_message_names_the_shapes():
    with pytest.raises(ValueError) as error:
        _engine(dict(num_heads=16, num_kv_heads=1), attention_backend="pallas_mgpu")
    assert str(error.value) == (
        "attention_backend 'pallas_mgpu' cannot run this ouro model (16 q heads per kv head, "
        "head_dim 16, page_size 16, float32, kv layout 'per_loop'): the Mosaic GPU kernel takes "
        "at most 8 q heads per kv head, got 16; use 'auto' or 'xla'")
    engine = _engine(dict(num_heads=16, num_kv_heads=1), attention_backend="pallas")  # Triton fits G=16
    assert engine.runner is not None
