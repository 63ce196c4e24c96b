"""The device KV pool: paged, with depth planes, donated into every device step.

Layout (docs/design.md, the kernels read it so): one K and one V array per cache layer,
`[num_planes(layer), num_kv_heads, num_pages, page_size, head_dim]` in the model dtype.
A token's flat slot is `page * page_size + offset`; slot `num_pages * page_size`
(`KVLayout.drop_slot`) means "do not write" (padding tokens) and every write uses
`mode="drop"`, so a padded row never touches a real page.

Planes per cache layer ("packed depth planes": no plane is allocated that no loop writes):
- Ouro, `per_loop`: every layer has `max_loops` (default `total_ut_steps`) planes, plane =
  loop index.
- Huginn prelude/coda layers: 1 plane. Core layers: `max_loops` planes (`per_loop`) or a
  ring of `K // num_core_layers` planes (`shared`, the reference's compress-sK: core layer
  j of loop i uses ring slot (4i + j) mod K, i.e. plane i mod (K // 4) of layer j).
- Ouro `shared` (prompt tokens keep every loop, decoded tokens only their last): a full page
  has `max_loops` planes as in `per_loop`; a decode page (`KVLayout.decode_page_planes` > 0)
  is ONE plane of a physical page, so a physical page hosts `max_loops` decode pages
  (`block_manager.py` hands them out). Per step (`StepBatch.page_plane`, `write_plane`):
  a prompt token writes the loop's plane; a decoded token in a full page (the prompt's last
  page) writes every plane at each loop (after its step every plane holds its last loop's
  K/V, and at loop l plane l holds loop l's); a decoded token in a decode page writes its
  page's plane at each loop (the last write is its last loop's). A decode step reads each
  page entry at its own plane (decode pages) or the loop's plane (full pages), through a
  plane table that `ref_paged_attention` and the Mosaic GPU decode kernel read (the Triton
  one does not); prefill rows hold only full pages (the engine asserts).

`PagedAttention` is the model's attention backend (`layers.AttentionBackend`): it maps
(layer, depth) to a plane, writes the step's K/V at the step's slots, then attends through
the implementation `attention_backend.py` picks for the step (XLA's `ref_paged_attention`
or a Pallas kernel); a decode step on the Mosaic GPU kernel writes and attends in that one
kernel (`attention_backend.write_attention_fn`).
"Last exited" (`fill_last_exited`): a token that stopped at loop e < max (adaptive skip,
exit traces) gets its loop-e KV copied into its deeper planes of the looped layers, so the
kernels need no per-token plane choice. `DeviceState` = the pool + the per-request carry
(per-loop decode state, Huginn warm-start states) and the last sampled token of each
request's token slot (what lets step n+1 be dispatched before step n is read back), which
every step donates and returns.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from loopjax import attention_backend, penalties
from loopjax.engine_config import OPTION_CHOICES
from loopjax.kernels.paged_attention import write_plane
from loopjax.wording import counted, pool_size

LAYOUTS = OPTION_CHOICES["kv_layout"]
DEFAULT_KV_BYTES = 16 * 2**30  # pool cap of make_layout's default size (default_tokens)
# StepBatch.write_plane codes besides a plane index (Ouro 'shared' only):
WRITE_LOOP_PLANE = -2   # a prompt token: the loop's plane
WRITE_EVERY_PLANE = -1  # a decoded token in a full page: every plane


@dataclass(frozen=True)
class KVLayout:
    """Static description of the pool: shapes and the (layer, depth) -> plane rule."""

    family: str
    kind: str                        # 'per_loop' | 'shared'
    num_planes: tuple[int, ...]      # planes per cache layer
    ring: tuple[bool, ...]           # per cache layer: plane = depth mod num_planes
    num_kv_heads: int
    head_dim: int
    num_pages: int
    page_size: int
    dtype: Any
    decode_page_planes: int = 0      # Ouro 'shared': decode pages per physical page (0: none)

    @property
    def num_layers(self) -> int:
        return len(self.num_planes)

    @property
    def drop_slot(self) -> int:
        """The slot index that writes nothing (one past the last real slot)."""
        return self.num_pages * self.page_size

    @property
    def bytes_per_token(self) -> int:
        """K + V bytes one (prompt) token occupies across every plane of every layer."""
        itemsize = np.dtype(self.dtype).itemsize
        return 2 * sum(self.num_planes) * self.num_kv_heads * self.head_dim * itemsize

    @property
    def bytes_per_decoded_token(self) -> int:
        """K + V bytes of a decoded token in a decode page: one plane per layer (Ouro shared)."""
        return self.bytes_per_token // max(1, self.decode_page_planes)

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_token * self.capacity_tokens

    def plane(self, layer_id: int, depth):
        """The plane of cache layer `layer_id` that loop `depth` (traced int ok) reads/writes."""
        if self.num_planes[layer_id] == 1:
            return jnp.int32(0)
        depth = jnp.asarray(depth, jnp.int32)
        if self.ring[layer_id]:
            return depth % self.num_planes[layer_id]
        return depth

    def ring_wraps(self, loops: int) -> bool:
        """A ring layer (Huginn 'shared') reuses a plane within `loops` loops. Then a token at
        loop i reads an earlier token's loop-i entry only if both run in the same step (the
        reference's one prefill); a later step reads that token's last write of the plane."""
        return any(ring and loops > planes for ring, planes in zip(self.ring, self.num_planes))

    def describe(self) -> str:
        gib = self.total_bytes / 2**30
        text = (f"loopjax KV pool: {self.family} layout={self.kind}, {self.num_pages} pages x "
                f"{self.page_size} tokens = {self.capacity_tokens} tokens of capacity, "
                f"{self.bytes_per_token} bytes/token ({sum(self.num_planes)} planes over "
                f"{self.num_layers} layers), {gib:.3f} GiB")
        if self.decode_page_planes:
            text += (f"; decoded tokens: {self.bytes_per_decoded_token} bytes/token (1 plane per "
                     f"layer, {self.decode_page_planes} decode pages per page, "
                     f"{self.capacity_tokens * self.decode_page_planes} decoded tokens of capacity)")
        return text


def plane_counts(cfg, kind: str, max_loops: int | None = None,
                 shared_slots: int | None = None) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """(planes per cache layer, ring flag per layer) for a family config and layout kind.

    max_loops: the deepest loop any request may run (per_loop); shared_slots: K of
    Huginn compress-sK (a multiple of the core layer count)."""
    if kind not in LAYOUTS:
        raise ValueError(f"unknown kv layout {kind!r}; choose one of {', '.join(LAYOUTS)}")
    if cfg.family == "ouro":  # 'shared' has the same planes: its decode pages use one each
        return (max_loops or cfg.total_ut_steps,) * cfg.num_layers, (False,) * cfg.num_layers
    pre, core, coda = cfg.num_prelude_layers, cfg.num_core_layers, cfg.num_coda_layers
    if kind == "per_loop":
        loops = max_loops or cfg.mean_recurrence
        core_planes, ring = loops, False
    else:
        k = shared_slots or 8
        if k % core or k < core:
            raise ValueError(f"shared kv slots K={k} must be a positive multiple of the "
                             f"{core} core layers")
        core_planes, ring = k // core, True
    return ((1,) * pre + (core_planes,) * core + (1,) * coda,
            (False,) * pre + (ring,) * core + (False,) * coda)


def make_layout(cfg, kind: str, *, page_size: int, dtype, num_pages: int | None = None,
                kv_memory_bytes: int | None = None, max_loops: int | None = None,
                shared_slots: int | None = None, default_tokens: int | None = None,
                min_tokens: int = 0) -> KVLayout:
    """The pool layout, sized by `num_pages`, else by a memory budget in bytes, else (both
    None) to hold `default_tokens` prompt tokens, at most DEFAULT_KV_BYTES yet at least
    `min_tokens` (one context: the engine refuses a pool that cannot hold one)."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    planes, ring = plane_counts(cfg, kind, max_loops, shared_slots)
    decode_planes = planes[0] if cfg.family == "ouro" and kind == "shared" else 0
    layout = KVLayout(cfg.family, kind, planes, ring, cfg.num_kv_heads, cfg.head_dim,
                      num_pages or 1, page_size, jnp.dtype(dtype), decode_planes)
    if num_pages is None:
        if kv_memory_bytes is None and default_tokens:
            page_bytes = page_size * layout.bytes_per_token
            kv_memory_bytes = max(min(-(-default_tokens // page_size) * page_bytes, DEFAULT_KV_BYTES),
                                  -(-min_tokens // page_size) * page_bytes)
        if not kv_memory_bytes:
            raise ValueError("give num_pages or kv_memory_bytes to size the KV pool")
        num_pages = kv_memory_bytes // (layout.bytes_per_token * page_size)
    if num_pages <= 0:  # NOTE: a budget given (num_pages and the default budget are >= 1 page): named
        raise ValueError(f"KV pool too small: kv_memory_bytes={kv_memory_bytes} holds "
                         f"{counted(int(num_pages), 'page')} of {counted(page_size, 'token')} at "
                         f"{layout.bytes_per_token} bytes/token")
    return dataclasses.replace(layout, num_pages=int(num_pages))


def check_holds_context(layout: KVLayout, max_context_len: int) -> None:
    """vLLM's start-up check: the pool holds one request's whole context, else a one-line
    ValueError naming both and the ways out (such a pool silently cut every request at its size)."""
    if layout.capacity_tokens < max_context_len:
        raise ValueError(f"max_context_len {max_context_len} is larger than the KV pool holds "
                         f"({pool_size(layout.num_pages, layout.page_size)}): give a larger "
                         "kv_memory_bytes (or num_pages), or a smaller max_context_len")


@jax.tree_util.register_dataclass
@dataclass
class KVPool:
    """The device pool: k[l], v[l] are `[planes_l, Hkv, num_pages, page_size, D]`."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    def replace_layer(self, layer_id: int, k_layer, v_layer) -> KVPool:
        k = self.k[:layer_id] + (k_layer,) + self.k[layer_id + 1:]
        v = self.v[:layer_id] + (v_layer,) + self.v[layer_id + 1:]
        return KVPool(k, v)


def allocate(layout: KVLayout) -> KVPool:
    """Zero-filled pool (zeros keep the reads of padding rows finite)."""
    def one(planes):
        return jnp.zeros((planes, layout.num_kv_heads, layout.num_pages, layout.page_size,
                          layout.head_dim), layout.dtype)
    return KVPool(tuple(one(p) for p in layout.num_planes), tuple(one(p) for p in layout.num_planes))


@jax.tree_util.register_dataclass
@dataclass
class DeviceState:
    """Everything a step donates and returns: the pool and the per-loop decode state."""

    kv: KVPool             # the paged pool
    carry: dict            # per-loop decode state, each [max_rows + 1, ...], indexed by carry slot
    last_tokens: jax.Array  # [max_rows + 1] i32 last sampled token per token slot (the last slot:
    #                         padding rows'); the next step reads a token the host has not yet
    history: penalties.TokenHistory  # [max_rows + 1, V] per token slot: penalties and logit_bias


def allocate_state(cfg, layout: KVLayout, max_rows: int, dtype) -> DeviceState:
    """The pool plus `max_rows` carry slots (+1: the padding rows' slot) of per-loop state:
    Huginn (e, s, warm), Ouro (x, exit state), and as many last-token slots and token
    histories."""
    rows, h = max_rows + 1, cfg.hidden_size
    if cfg.family == "huginn":
        carry = {"e": jnp.zeros((rows, h), dtype), "s": jnp.zeros((rows, h), dtype),
                 "warm": jnp.zeros((rows, h), dtype)}  # warm start: ln_f of the last final state
    else:
        from loopjax.models import ouro
        # NOTE: copies, so no two donated leaves share a buffer (exit_init reuses its zeros).
        carry = {"x": jnp.zeros((rows, h), dtype), "exit": jax.tree.map(
            lambda a: jnp.array(a, copy=True), ouro.exit_init(rows, h, cfg.total_ut_steps, dtype))}
    return DeviceState(allocate(layout), carry, jnp.zeros(rows, jnp.int32),
                       penalties.allocate(rows, cfg.vocab_size))


def read_plane(cache, plane, slots):
    """[N, Hkv, D]: the entries of plane `plane` at slots[N] (slots must be real)."""
    planes, hkv, pages, size, d = cache.shape
    return cache.reshape(planes, hkv, pages * size, d)[plane, :, slots]


def fill_last_exited(pool: KVPool, layout: KVLayout, layer_ids, slots, exit_depth, max_depth: int):
    """The "last exited" rule: a token whose final loop was `exit_depth[n]` (< max) gets its
    KV of that loop copied into its deeper planes t in (exit_depth, max_depth) of every
    looped layer in `layer_ids`, so later reads of any deeper plane see its deepest entry.
    A ring layer (P planes, loop t writes plane t mod P) fills its planes t in (exit_depth, P):
    a token that stopped before the ring wrapped left them unwritten (latest-m4-compress-sK
    reads them at its deepest plane below). Tokens with slot = drop_slot are skipped."""
    for layer_id in layer_ids:
        planes = layout.num_planes[layer_id]
        if planes == 1:
            continue
        k_layer, v_layer = pool.k[layer_id], pool.v[layer_id]
        source = jnp.clip(exit_depth, 0, planes - 1)  # a deeper exit writes nothing below
        src_k = read_plane(k_layer, source, jnp.minimum(slots, layout.drop_slot - 1))
        src_v = read_plane(v_layer, source, jnp.minimum(slots, layout.drop_slot - 1))

        def body(t, kv, src_k=src_k, src_v=src_v):
            dst = jnp.where(t > exit_depth, slots, layout.drop_slot)
            return write_plane(kv[0], t, dst, src_k), write_plane(kv[1], t, dst, src_v)

        k_layer, v_layer = jax.lax.fori_loop(0, min(max_depth, planes), body, (k_layer, v_layer))
        pool = pool.replace_layer(layer_id, k_layer, v_layer)
    return pool


def fill_rows(pool: KVPool, layout: KVLayout, layer_ids, batch, exit_loop):
    """`fill_last_exited` for the tokens of a step's skip rows (batch.exit_skip [R]), which
    stopped at exit_loop [R] (0-based). Ouro 'shared' needs none: a decoded token's last write
    is its exit loop's K/V (every plane of a full page, or its decode page's plane), and
    prompt tokens never stop early."""
    if layout.decode_page_planes:
        return pool
    slots = jnp.where(batch.exit_skip[batch.row_of_token], batch.slot_mapping, layout.drop_slot)
    return fill_last_exited(pool, layout, layer_ids, slots, exit_loop[batch.row_of_token],
                            max(layout.num_planes))


class PagedAttention:
    """`attn(kv, layer_id, depth, q, k, v) -> (kv, out)` over the paged pool of one step.

    Closes over the step's metadata (the StepBatch): traced slot_mapping [N], page_table
    [R, max_pages], row_of_token [N], positions [N], and its static `decode`, which picks the
    decode or the prefill kernel. Writes first (or in the attention kernel itself), so a
    token attends to its own K/V, then attends plane `layout.plane(layer_id, depth)`."""

    def __init__(self, layout: KVLayout, batch, backend: str = "xla", write_mask=None):
        self.layout = layout
        self.batch = batch
        self.backend = backend
        # write_mask [N] bool (optional): tokens whose KV must not be written this loop
        # (rows already past their last loop); they write to the drop slot.
        self.write_mask = write_mask

    def with_write_mask(self, mask) -> PagedAttention:
        return PagedAttention(self.layout, self.batch, self.backend, mask)

    def _slots(self):
        """The step's slot_mapping [N], with the write mask's tokens sent to the drop slot."""
        if self.write_mask is None:
            return self.batch.slot_mapping
        return jnp.where(self.write_mask, self.batch.slot_mapping, self.layout.drop_slot)

    def _attend_fn(self, group_size: int):
        return attention_backend.step_attention_fn(self.backend, self.batch.decode, self.layout, group_size)

    def __call__(self, kv: KVPool, layer_id: int, depth, q, k, v):
        return self._attend(kv, layer_id, depth, q, k, v, self._attend_fn(q.shape[1] // k.shape[1]))

    def _attend(self, kv: KVPool, layer_id: int, depth, q, k, v, attend):
        """`__call__` with the step's attention function `attend` chosen."""
        plane, batch, slots = self.layout.plane(layer_id, depth), self.batch, self._slots()
        k, v = k.astype(kv.k[layer_id].dtype), v.astype(kv.v[layer_id].dtype)
        write_attend = attention_backend.write_attention_fn(attend, self.layout)
        if write_attend is not None:  # NOTE: one kernel writes the K/V and attends (no scatters)
            out, k_layer, v_layer = write_attend(q, k, v, slots, kv.k[layer_id], kv.v[layer_id], plane,
                                                 batch.page_table, batch.row_of_token, batch.positions)
        else:
            k_layer, v_layer, read_plane = self._write(kv, layer_id, plane, slots, k, v, attend)
            out = attend(q, k_layer, v_layer, read_plane, batch.page_table, batch.row_of_token,
                         batch.positions)
        return kv.replace_layer(layer_id, k_layer, v_layer), out.astype(q.dtype)

    def attend_projected(self, kv: KVPool, layer_id: int, depth, ops, x, w_qkv, rope):
        """`__call__` from a layer's normed input x [N, H] and fused projection w_qkv
        (layers.rotary_attention): beside the Pallas prefill kernel, `ops.linear`'s qkv goes to
        one kernel that rotates q and k and writes k and v (attention_backend.rope_write_fn);
        otherwise the model's own projection and RoPE (`rope.project`), then `__call__`."""
        attend = self._attend_fn(rope.num_heads // rope.num_kv_heads)  # batch.decode: static
        rope_write = attention_backend.rope_write_fn(attend, self.layout)
        if rope_write is None:
            return self._attend(kv, layer_id, depth, *rope.project(ops, x, w_qkv), attend)
        plane, batch = self.layout.plane(layer_id, depth), self.batch
        q, k_layer, v_layer = rope_write(ops.linear(x, w_qkv), rope.cos, rope.sin, kv.k[layer_id],
                                         kv.v[layer_id], plane, self._slots(), num_heads=rope.num_heads,
                                         num_kv_heads=rope.num_kv_heads, qk_bias=rope.qk_bias)
        out = attend(q, k_layer, v_layer, plane, batch.page_table, batch.row_of_token, batch.positions)
        return kv.replace_layer(layer_id, k_layer, v_layer), out.astype(q.dtype)

    def _write(self, kv: KVPool, layer_id: int, plane, slots, k, v, attend):
        """(k_layer, v_layer) with the step's K/V written (as fits `attend`), and the plane
        (scalar or [R, M] table) the attention reads."""
        if not self.layout.decode_page_planes:
            write = attention_backend.kv_write_fn(attend)
            return *write(kv.k[layer_id], kv.v[layer_id], plane, slots, k, v), plane
        k_layer, v_layer = write_shared(kv.k[layer_id], kv.v[layer_id], plane, slots,
                                        self.batch.write_plane, self.layout.drop_slot, k, v)
        if not self.batch.decode:  # NOTE: prefill rows hold only full pages: the loop's plane is right
            return k_layer, v_layer, plane
        table = self.batch.page_plane
        return k_layer, v_layer, jnp.where(table >= 0, table, plane).astype(jnp.int32)


def write_shared(k_cache, v_cache, plane, slots, token_planes, drop_slot: int, k, v):
    """Ouro 'shared' writes: token n goes to every plane p with token_planes[n] == p, or
    == WRITE_EVERY_PLANE, or == WRITE_LOOP_PLANE and p == plane (the loop's); one scatter of
    [planes, N] targets per cache, the others dropped."""
    planes = jnp.arange(k_cache.shape[0], dtype=jnp.int32)[:, None]  # [planes, 1]
    tp = token_planes[None, :]
    hit = (tp == planes) | (tp == WRITE_EVERY_PLANE) | ((tp == WRITE_LOOP_PLANE) & (planes == plane))
    targets = jnp.where(hit, slots[None, :], drop_slot)  # [planes, N]
    return write_plane(k_cache, planes, targets, k), write_plane(v_cache, planes, targets, v)
