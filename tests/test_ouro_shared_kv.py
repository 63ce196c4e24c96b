"""Ouro's 'shared' KV layout end to end (tiny golden Ouro, fp32): the engine's greedy tokens
equal a dense reference of the rule (prompt tokens keep every loop's K/V, decoded tokens only
their last loop's), differ from 'per_loop', and a decode-heavy load fits a pool where
'per_loop' preempts. Strict engines, shared per module."""

from __future__ import annotations

import json
from collections import defaultdict

import jax.numpy as jnp
import numpy as np
import pytest

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
    """Dense attention backend keeping K/V by the 'shared' rule: `prompt[(loop, layer)]` for the
    prompt tokens, `decoded[layer]` the last-loop K/V of each decoded token so far."""

    def __init__(self):
        self.prompt: dict = {}
        self.decoded = defaultdict(list)
        self.current: dict = {}  # this decoded token's K/V at the latest loop, per layer
        self.prefill = True

    def __call__(self, kv, layer_id, depth, q, k, v):
        if self.prefill:
            self.prompt[(depth, layer_id)] = (k, v)
            n = q.shape[0]
            return kv, causal_attention(q, k, v, jnp.tril(jnp.ones((n, n), bool)))
        self.current[layer_id] = (k, v)
        pk, pv = self.prompt[(depth, layer_id)]
        keys = jnp.concatenate([pk, *(a for a, _ in self.decoded[layer_id]), k])
        values = jnp.concatenate([pv, *(b for _, b in self.decoded[layer_id]), v])
        return kv, causal_attention(q, keys, values, jnp.ones((1, keys.shape[0]), bool))

    def end_token(self):
        for layer_id, kv in self.current.items():
            self.decoded[layer_id].append(kv)


def rule_greedy(model, prompt, num_new: int) -> list[int]:
    """Greedy tokens of the 'shared' rule, by the model's own loop functions over dense K/V."""
    params, cfg = model.params, model.cfg
    threshold = cfg.early_exit_threshold if cfg.early_exit_threshold is not None else 2.0
    attn, tokens = _RuleAttention(), []
    ids, positions = jnp.asarray(prompt, jnp.int32), jnp.arange(len(prompt))
    for _ in range(num_new):
        x = ouro.embed(params, ids)
        cos, sin = rope_angles(positions, cfg.head_dim, cfg.rope_theta)
        hidden, gates = [], []
        for depth in range(cfg.total_ut_steps):
            x, _ = ouro.loop(params, cfg, x, cos, sin, attn, None, depth)
            hidden.append(x[-1:])
            gates.append(ouro.gate_logits(params, x[-1:]))
        exit_loop = ouro.threshold_exit(ouro.exit_cdf(ouro.exit_pdf(jnp.stack(gates))), threshold)
        logits = ouro.lm_head(params, ouro.select_loop(jnp.stack(hidden), exit_loop))
        tokens.append(int(jnp.argmax(logits[0])))
        if not attn.prefill:
            attn.end_token()
        attn.prefill = False
        ids, positions = jnp.asarray(tokens[-1:], jnp.int32), positions[-1:] + 1
    return tokens


def greedy(max_tokens):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_all(engine, requests):
    for rid, (prompt, params) in requests.items():
        engine.add_request(prompt, params, rid)
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


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
    return {layout: Engine(model, EngineConfig(**SMALL, kv_layout=layout))
            for layout in ("per_loop", "shared")}


def test_shared_equals_the_rule_and_differs_from_per_loop(model, engines, prompts):
    ids, golden = prompts
    requests = {k: (p, greedy(NUM_NEW)) for k, p in ids.items()}
    shared = run_all(engines["shared"], requests)
    per_loop = run_all(engines["per_loop"], requests)
    for k in golden:
        assert per_loop[k].token_ids == golden[k], k
    for k, prompt in ids.items():
        assert shared[k].token_ids == rule_greedy(model, prompt, NUM_NEW), k
    assert any(shared[k].token_ids != per_loop[k].token_ids for k in ids)
    stats = engines["shared"].stats()
    assert stats["pages_free"] == stats["pages_total"] and stats["preemptions"] == 0
    assert stats["kv_bytes_per_token"] == 4 * stats["kv_bytes_per_decoded_token"]


def test_decode_pages_fit_where_per_loop_preempts(model):
    # 12 pages of 8 tokens; 4 requests of 8 prompt + 40 decoded tokens: per_loop needs 6 pages
    # each (24 > 12), shared 1 full page + 5 decode pages each (4 + 20 / 4 = 9 pages).
    cfg = {**SMALL, "num_pages": 12}
    requests = {f"r{i}": ([i + 1] * 8, greedy(40)) for i in range(4)}
    per_loop = Engine(model, EngineConfig(**cfg))
    run_all(per_loop, requests)
    assert per_loop.stats()["preemptions"] > 0
    shared = Engine(model, EngineConfig(**cfg, kv_layout="shared"))
    finals = run_all(shared, requests)
    assert all(len(out.token_ids) == 40 for out in finals.values())
    assert shared.stats()["preemptions"] == 0 and shared.stats()["pages_free"] == 12
    # Longer prompts: 2 full + 5 decode pages each (8 + 20 / 4 = 13 > 12 pages), so shared
    # preempts too; recompute returns every page.
    more = {f"s{i}": ([i + 1] * 16, greedy(40)) for i in range(4)}
    finals = run_all(shared, more)
    assert all(len(out.token_ids) == 40 for out in finals.values())
    stats = shared.stats()
    assert stats["preemptions"] > 0 and stats["pages_free"] == stats["pages_total"] == 12


def test_pallas_decode_refuses_the_shared_layout(model):
    with pytest.raises(ValueError, match="Pallas decode kernel"):
        Engine(model, EngineConfig(**{**SMALL, "warmup": False}, kv_layout="shared",
                                   attention_backend="pallas"))


def test_generate_cli_with_shared_layout(model, capsys):
    code = cli.main(["generate", OURO, "--prompt-ids", "1,2,3", "--max-tokens", "12",
                     "--kv-layout", "shared", "--ignore-eos", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and out["token_ids"] == rule_greedy(model, [1, 2, 3], 12)
