"""Ouro's 'shared' KV layout end to end (tiny golden Ouro, fp32): the engine's greedy tokens
equal a dense reference of the rule (prompt tokens keep every loop's K/V, decoded tokens only
their last loop's), differ from 'per_loop', and a decode-heavy load fits a pool where
'per_loop' preempts. Strict engines, shared per module."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_helpers import greedy, run_requests

import loopjax
from loopjax import cli
from loopjax.engine import Engine, EngineConfig
from loopjax.layers import causal_attention, rope_angles
from loopjax.models import ouro
from loopjax.sampling_params import SamplingParams

OURO = "tests/data/ouro"
SMALL = dict(page_size=8, max_num_rows=4, decode_row_buckets=(4,), max_prefill_tokens=32,
             prefill_token_buckets=(32,), max_prefill_rows=2, max_context_len=64,
             strict_compile=True, verbose=False)
NUM_NEW = 24


class _RuleAttention:
    """Dense attention by the 'shared' rule. Prefill (`prompt` None): causal over the prompt,
    storing every (loop, layer) K/V in `kept`. Decode: the prompt's loop-l K/V [L, layers, T],
    the last-loop K/V of the decoded tokens so far [layers, NUM_NEW] (the first
    `num_decoded` real), then the token's own; `kept[layer]` ends as its last loop's K/V."""

    def __init__(self, prompt=None, decoded=None, num_decoded=None):
        self.prompt, self.decoded, self.num_decoded = prompt, decoded, num_decoded
        self.kept: dict = {}

    def __call__(self, kv, layer_id, depth, q, k, v):
        if self.prompt is None:
            self.kept[(depth, layer_id)] = (k, v)
            n = q.shape[0]
            return kv, causal_attention(q, k, v, jnp.tril(jnp.ones((n, n), bool)))
        self.kept[layer_id] = (k, v)
        (pk, pv), (dk, dv) = self.prompt, self.decoded
        keys = jnp.concatenate([pk[depth, layer_id], dk[layer_id], k])
        values = jnp.concatenate([pv[depth, layer_id], dv[layer_id], v])
        mask = jnp.concatenate([jnp.ones(pk.shape[2], bool),
                                jnp.arange(dk.shape[1]) < self.num_decoded, jnp.ones(1, bool)])
        return kv, causal_attention(q, keys, values, mask[None])


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _rule_token(params, cfg, num_loops, exit_step, ids, positions, prompt, decoded, num_decoded):
    """One token of the rule running `num_loops` loops: (greedy next token, the K/V it keeps);
    the logits of loop `exit_step`, or (None) of the threshold rule's loop."""
    attn = _RuleAttention(prompt, decoded, num_decoded)
    x = ouro.embed(params, ids)
    cos, sin = rope_angles(positions, cfg.head_dim, cfg.rope_theta)
    hidden, gates = [], []
    for depth in range(num_loops):
        x, _ = ouro.loop(params, cfg, x, cos, sin, attn, None, depth)
        hidden.append(x[-1:])
        gates.append(ouro.gate_logits(params, x[-1:]))
    threshold = cfg.early_exit_threshold if cfg.early_exit_threshold is not None else 2.0
    exit_loop = ouro.threshold_exit(ouro.exit_cdf(ouro.exit_pdf(jnp.stack(gates))), threshold)
    if exit_step is not None:
        exit_loop = jnp.full_like(exit_loop, exit_step)
    logits = ouro.lm_head(params, ouro.select_loop(jnp.stack(hidden), exit_loop))
    return jnp.argmax(logits[0]), attn.kept


def rule_greedy(model, prompt, num_new: int, skip_at: int | None = None) -> list[int]:
    """Greedy tokens of the 'shared' rule, by the model's own loop functions over dense K/V.
    skip_at=k: exit_step k in skip mode (decoded tokens run loops 0..k and keep loop k's K/V;
    prompt tokens still run every loop)."""
    params, cfg = model.params, model.cfg
    n, depth = len(prompt), cfg.total_ut_steps
    decode_loops = depth if skip_at is None else skip_at + 1
    token, kept = _rule_token(params, cfg, depth, skip_at, jnp.asarray(prompt, jnp.int32),
                              jnp.arange(n), None, None, None)
    loops, layers = range(cfg.total_ut_steps), range(cfg.num_layers)
    prompt_kv = tuple(jnp.stack([jnp.stack([kept[(d, i)][j] for i in layers]) for d in loops])
                      for j in (0, 1))  # [L, layers, T, Hkv, D]
    shape = (cfg.num_layers, num_new, cfg.num_kv_heads, cfg.head_dim)
    decoded = (jnp.zeros(shape, model.dtype), jnp.zeros(shape, model.dtype))
    tokens = [int(token)]
    for t in range(num_new - 1):
        token, kept = _rule_token(params, cfg, decode_loops, skip_at,
                                  jnp.asarray([tokens[-1]], jnp.int32),
                                  jnp.asarray([n + t]), prompt_kv, decoded, t)
        decoded = tuple(d.at[:, t].set(jnp.stack([kept[i][j][0] for i in layers]))
                        for j, d in enumerate(decoded))
        tokens.append(int(token))
    return tokens


@pytest.fixture(scope="module")
def model():
    return loopjax.load(OURO)


@pytest.fixture(scope="module")
def prompts():
    ref = np.load(f"{OURO}/reference_fp32.npz")
    ids = {k: ref[f"{k}_input_ids"].tolist() for k in ("p0", "p1", "p2")}
    ids["page"] = ids["p2"][:8]  # the first decoded token opens a decode page
    golden = {k: ref[f"{k}_greedy_tokens"].tolist()[:NUM_NEW] for k in ("p0", "p1", "p2")}
    return ids, golden


@pytest.fixture(scope="module")
def engines(model):
    return {"per_loop": Engine(model, EngineConfig(**SMALL)),
            "shared": Engine(model, EngineConfig(**SMALL, kv_layout="shared", adaptive_exit=True))}


def test_shared_equals_the_rule_and_differs_from_per_loop(model, engines, prompts):
    ids, golden = prompts
    requests = {k: (p, greedy(NUM_NEW)) for k, p in ids.items()}
    shared = run_requests(engines["shared"], requests)
    per_loop = run_requests(engines["per_loop"], requests)
    for k in golden:
        assert per_loop[k].token_ids == golden[k], k
    for k, prompt in ids.items():
        assert shared[k].token_ids == rule_greedy(model, prompt, NUM_NEW), k
    assert any(shared[k].token_ids != per_loop[k].token_ids for k in ids)
    stats = engines["shared"].stats()
    assert stats["pages_free"] == stats["pages_total"] and stats["preemptions"] == 0
    assert stats["kv_bytes_per_token"] == 4 * stats["kv_bytes_per_decoded_token"]


def test_skip_exit_keeps_the_loop_a_decoded_token_stopped_at(model, engines, prompts):
    ids, _ = prompts
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True,
                            exit_mode="skip", exit_step=1)
    finals = run_requests(engines["shared"], {k: (p, params) for k, p in ids.items()})
    for k, prompt in ids.items():
        assert finals[k].token_ids == rule_greedy(model, prompt, NUM_NEW, skip_at=1), k
        assert finals[k].exit_loops == [2] * NUM_NEW
    stats = engines["shared"].stats()
    assert stats["pages_free"] == stats["pages_total"]


def test_prefix_hits_are_prompt_pages_only(model, engines, prompts):
    """A second turn resends turn 1's prompt and reply: with the prefix cache it reuses only
    pages computed by prefill, so its tokens equal a cache-off run (the reply's tokens are
    recomputed as prompt tokens either way)."""
    ids, _ = prompts
    cached = Engine(model, EngineConfig(**SMALL, kv_layout="shared", enable_prefix_caching=True))
    first = run_requests(cached, {"t1": (ids["p2"], greedy(12))})["t1"]
    turn2 = ids["p2"] + first.token_ids + [5, 6, 7]
    second = run_requests(cached, {"t2": (turn2, greedy(12))})["t2"]
    stats = cached.stats()
    assert stats["prefix_cache_hit_pages"] == len(ids["p2"]) // SMALL["page_size"] == 2
    assert second.token_ids == run_requests(engines["shared"], {"t2": (turn2, greedy(12))})["t2"].token_ids
    assert second.token_ids == rule_greedy(model, turn2, 12)
    assert stats["pages_free"] == stats["pages_total"]


def test_decode_pages_fit_where_per_loop_preempts(model):
    # 12 pages of 8 tokens; 4 requests of 8 prompt + 40 decoded tokens: per_loop needs 6 pages
    # each (24 > 12), shared 1 full page + 5 decode pages each (4 + 20 / 4 = 9 pages).
    cfg = {**SMALL, "num_pages": 12}
    requests = {f"r{i}": ([i + 1] * 8, greedy(40)) for i in range(4)}
    per_loop = Engine(model, EngineConfig(**cfg))
    run_requests(per_loop, requests)
    assert per_loop.stats()["preemptions"] > 0
    shared = Engine(model, EngineConfig(**cfg, kv_layout="shared"))
    finals = run_requests(shared, requests)
    assert all(len(out.token_ids) == 40 for out in finals.values())
    assert shared.stats()["preemptions"] == 0 and shared.stats()["pages_free"] == 12
    # Longer prompts: 2 full + 5 decode pages each (8 + 20 / 4 = 13 > 12 pages), so shared
    # preempts too; recompute returns every page.
    more = {f"s{i}": ([i + 1] * 16, greedy(40)) for i in range(4)}
    finals = run_requests(shared, more)
    assert all(len(out.token_ids) == 40 for out in finals.values())
    stats = shared.stats()
    assert stats["preemptions"] > 0 and stats["pages_free"] == stats["pages_total"] == 12


def test_pallas_decode_refuses_the_shared_layout(model):
    with pytest.raises(ValueError, match="per-page plane table, which the Triton decode kernel"):
        Engine(model, EngineConfig(**{**SMALL, "warmup": False}, kv_layout="shared",
                                   attention_backend="pallas"))


def test_generate_cli_with_shared_layout(model, capsys):
    code = cli.main(["generate", OURO, "--prompt-ids", "1,2,3", "--max-tokens", "12",
                     "--kv-layout", "shared", "--ignore-eos", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and out["token_ids"] == rule_greedy(model, [1, 2, 3], 12)
