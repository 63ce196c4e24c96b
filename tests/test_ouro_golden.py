"""Ouro against the PyTorch reference's golden outputs (tests/data/ouro, README there).

Every forward here runs at one padded length (PAD_LEN) per dtype, so `_run_loops` compiles
once per dtype: a prompt followed by the reference's greedy tokens (teacher forcing), right-
padded. Causal attention keeps the padding out of the real positions, so the first T rows
are the prompt run alone. Tolerances: fp32 max|Δ| <= 1e-4·max|ref|; bf16 runs are compared
on decisions (tokens where the reference's margin is decisive, exit steps) and loosely on
values (max|Δ| <= 2e-2·max|ref|, a few bf16 ulps at the logits' magnitude).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ouro_helpers import (
    golden_config,
    golden_params,
    load_npz,
    margin_is_safe,
    numpy_reference,
)

import loopjax
from loopjax.config import OuroConfig
from loopjax.convert import ouro_keys
from loopjax.model import Model
from loopjax.models import ouro

PAD_LEN = 64
PROMPTS = (0, 1, 2)
DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}
REL_TOL = {"fp32": 1e-4, "bf16": 2e-2}


def assert_close(ours, ref, tag, what=""):
    ours, ref = np.asarray(ours, np.float32), np.asarray(ref, np.float32)
    assert ours.shape == ref.shape, (what, ours.shape, ref.shape)
    err, bound = np.abs(ours - ref).max(), REL_TOL[tag] * np.abs(ref).max()
    assert err <= bound, f"{what}: max|Δ| {err:.3g} > {bound:.3g}"


@pytest.fixture(scope="module")
def cfg():
    return golden_config()


@pytest.fixture(scope="module")
def models(cfg):
    """(tag, model) -> params: model "A" or "sat" (gate bias 8.0), in both dtypes."""
    return {(tag, m): golden_params(cfg, dt, gate_bias=8.0 if m == "sat" else None)
            for tag, dt in DTYPES.items() for m in ("A", "sat")}


@pytest.fixture(scope="module")
def refs():
    return {(tag, "A"): load_npz(f"reference_{tag}.npz") for tag in DTYPES} | {
        (tag, "sat"): load_npz(f"reference_sat_{tag}.npz") for tag in DTYPES}


def padded(prompt, tokens=()):
    ids = np.zeros(PAD_LEN, np.int32)
    ids[:len(prompt)] = prompt
    ids[len(prompt):len(prompt) + len(tokens)] = tokens
    return ids


@pytest.fixture(scope="module")
def runs(cfg, models, refs):
    """(tag, model, k) -> default forward of prompt k + that model's reference greedy tokens."""
    cache = {}

    def get(tag, model, k):
        if (tag, model, k) not in cache:
            ref = refs[tag, model]
            ids = padded(ref[f"p{k}_input_ids"], ref[f"p{k}_greedy_tokens"])
            cache[tag, model, k] = ouro.forward(models[tag, model], cfg, ids)
        return cache[tag, model, k]

    return get


# ------------------------------------------------------------------------ prompt forwards

@pytest.mark.parametrize("tag", DTYPES)
@pytest.mark.parametrize("k", PROMPTS)
def test_prompt_forward_matches_reference(cfg, models, refs, runs, tag, k):
    ref, params = refs[tag, "A"], models[tag, "A"]
    ids = ref[f"p{k}_input_ids"]
    t = len(ids)
    out = runs(tag, "A", k)
    assert_close(out.loop_hidden[:, :t], ref[f"p{k}_step_hidden"], tag, "step_hidden")
    assert_close(out.gate_logits[:, :t], ref[f"p{k}_gate_logits"], tag, "gate_logits")
    assert_close(out.loop_logits[:, :t], ref[f"p{k}_step_logits"], tag, "step_logits")
    assert_close(out.logits[:t], ref[f"p{k}_logits"], tag, "logits")
    pdf = ouro.exit_pdf(out.gate_logits[:, :t])
    assert_close(pdf, ref[f"p{k}_exit_pdf"], tag, "exit_pdf")
    assert_close(ouro.exit_cdf(pdf), ref[f"p{k}_exit_cdf"], tag, "exit_cdf")
    # Exit steps are exact in both dtypes; bf16 p2 token 0 is the `>=` knife edge at 0.5
    # (README §7: bf16 λ_0 rounds to exactly 0.5).
    np.testing.assert_array_equal(out.exit_loop[:t], ref[f"p{k}_exit_steps_thr1p0"])
    half = ouro.forward(params, cfg, padded(ids), exit_threshold=0.5)
    np.testing.assert_array_equal(half.exit_loop[:t], ref[f"p{k}_exit_steps_thr0p5"])
    assert_close(half.logits[:t], ref[f"p{k}_exit_logits_thr0p5"], tag, "logits thr 0.5")
    weighted = ouro.forward(params, cfg, padded(ids), weighted=True)
    assert_close(weighted.logits[:t], ref[f"p{k}_weighted_logits"], tag, "weighted logits")
    fixed = ouro.forward(params, cfg, padded(ids), exit_step=1)
    np.testing.assert_array_equal(fixed.logits, fixed.loop_logits[1])
    assert_close(fixed.logits[:t], ref[f"p{k}_step_logits"][1], tag, "exit_step 1 logits")
    assert (np.asarray(fixed.exit_loop) == 1).all()


@pytest.mark.parametrize("tag", DTYPES)
def test_public_forward_takes_the_references_exit_arguments(cfg, models, refs, tag):
    """loopjax.forward offers the reference's exit_at_step and use_weighted_exit (as exit_step,
    exit_weighted) and the exit distribution of its gates (the reference's pdf and cdf)."""
    model, ref = Model(cfg=cfg, params=models[tag, "A"]), refs[tag, "A"]
    ids = ref["p1_input_ids"]
    t = len(ids)
    weighted = loopjax.forward(model, padded(ids), exit_weighted=True)
    assert_close(weighted.logits[:t], ref["p1_weighted_logits"], tag, "weighted logits")
    assert_close(weighted.exit_pdf[:, :t], ref["p1_exit_pdf"], tag, "exit_pdf")
    assert_close(weighted.exit_cdf[:, :t], ref["p1_exit_cdf"], tag, "exit_cdf")
    stepped = loopjax.forward(model, padded(ids), exit_step=2)
    np.testing.assert_array_equal(stepped.logits, stepped.loop_logits[2])
    assert (np.asarray(stepped.exit_loop) == 2).all()


def test_a_configs_early_exit_step_comes_before_its_threshold(cfg, models, refs):
    """The reference's exit_at_step defaults to the config's early_exit_step and is tried before
    the threshold (the config's 1.0 here); past a shallower depth the threshold rule applies."""
    stepped, ids = dataclasses.replace(cfg, early_exit_step=2), padded(refs["fp32", "A"]["p1_input_ids"])
    out = ouro.forward(models["fp32", "A"], stepped, ids)
    assert (np.asarray(out.exit_loop) == 2).all()
    np.testing.assert_array_equal(out.logits, out.loop_logits[2])
    shallow = ouro.forward(models["fp32", "A"], stepped, ids, loops=2)  # 1.0 over 2 loops: the last
    assert (np.asarray(shallow.exit_loop) == 1).all()
    asked = ouro.forward(models["fp32", "A"], stepped, ids, exit_threshold=0.5)  # a request's own rule
    np.testing.assert_array_equal(asked.exit_loop[:12], refs["fp32", "A"]["p1_exit_steps_thr0p5"])


@pytest.mark.parametrize("k", (0, 1))
def test_bf16_prompt_forward_is_bit_exact_on_cpu(runs, refs, k):
    """On CPU the bf16 port rounds exactly where the reference does (per-op rounding, fp32
    accumulation rounded once, no XLA excess precision), so p0 and p1 match bit for bit; p2
    differs by one ulp in its last loop (an fp32 reduction order) and is left to the
    tolerance test above."""
    ref, out = refs["bf16", "A"], runs("bf16", "A", k)
    t = len(ref[f"p{k}_input_ids"])
    np.testing.assert_array_equal(np.asarray(out.loop_hidden[:, :t], np.float32), ref[f"p{k}_step_hidden"])
    np.testing.assert_array_equal(np.asarray(out.gate_logits[:, :t], np.float32), ref[f"p{k}_gate_logits"])
    np.testing.assert_array_equal(out.logits[:t], ref[f"p{k}_logits"])


def test_bf16_threshold_half_knife_edge_exits_at_loop0(refs):
    """The data point behind the `>=` check above: the reference's bf16 cdf_0 is exactly 0.5."""
    ref = refs["bf16", "A"]
    assert ref["p2_exit_cdf"][0, 0] == 0.5 and ref["p2_exit_steps_thr0p5"][0] == 0


def test_unpadded_forward_equals_padded(cfg, models, refs, runs):
    ids = refs["fp32", "A"]["p2_input_ids"]
    alone = ouro.forward(models["fp32", "A"], cfg, ids)
    padded_run = runs("fp32", "A", 2)
    assert alone.loop_hidden.shape == (cfg.total_ut_steps, len(ids), cfg.hidden_size)
    np.testing.assert_allclose(alone.loop_logits, padded_run.loop_logits[:, :len(ids)], atol=1e-5)


def test_batched_reference_rows(cfg, runs, refs):
    """Each row of the left-padded batch vs that row's real tokens run alone (the prompt rows of
    the teacher-forced run), at the real positions."""
    batched = load_npz("reference_batched_fp32.npz")
    for k in PROMPTS:
        mask = batched["attention_mask"][k].astype(bool)
        np.testing.assert_array_equal(batched["input_ids"][k][mask], refs["fp32", "A"][f"p{k}_input_ids"])
        assert_close(runs("fp32", "A", k).logits[:mask.sum()], batched["logits"][k][mask], "fp32",
                     f"batched row {k}")
        np.testing.assert_array_equal(batched["greedy_tokens"][k], refs["fp32", "A"][f"p{k}_greedy_tokens"])


# ------------------------------------------------------------------------------ exit rules

@pytest.mark.parametrize("tag", DTYPES)
def test_exit_rule_on_reference_values_is_bit_exact(refs, tag):
    """From the reference's gate logits / pdf, our pdf (bf16) and cdf (both) are bit-identical:
    this pins the cumsum accumulation rule (fp32: float64 accumulation rounded per output)."""
    dt = DTYPES[tag]
    for model in ("A", "sat"):
        ref = refs[tag, model]
        for k in PROMPTS:
            pdf = jnp.asarray(ref[f"p{k}_exit_pdf"]).astype(dt)
            np.testing.assert_array_equal(np.asarray(ouro.exit_cdf(pdf), np.float32), ref[f"p{k}_exit_cdf"])
            ours = np.asarray(ouro.exit_pdf(jnp.asarray(ref[f"p{k}_gate_logits"]).astype(dt)), np.float32)
            if tag == "bf16":
                np.testing.assert_array_equal(ours, ref[f"p{k}_exit_pdf"])
            else:  # fp32 sigmoids may differ from torch's by an ulp
                np.testing.assert_allclose(ours, ref[f"p{k}_exit_pdf"], rtol=1e-6, atol=1e-12)


def test_fp32_cumsum_matches_float64_accumulation():
    """Sums spanning many binades: float64 accumulation rounded per output (torch's rule) is
    reproduced exactly, while naive fp32 accumulation is not."""
    rng = np.random.default_rng(0)
    pdf = (rng.random((4, 20000)) * 2.0 ** rng.integers(-40, 1, (4, 20000))).astype(np.float32)
    expected = np.cumsum(pdf.astype(np.float64), axis=0).astype(np.float32)
    ours = np.asarray(jax.jit(ouro.exit_cdf)(jnp.asarray(pdf)))
    np.testing.assert_array_equal(ours, expected)
    assert (np.cumsum(pdf, axis=0, dtype=np.float32) != expected).any()


@pytest.mark.parametrize("tag", DTYPES)
def test_incremental_exit_state_equals_batch_rule(refs, tag):
    dt, num_loops, hidden_size = DTYPES[tag], 4, 8
    rng = np.random.default_rng(1)
    # Gates from every regime: ordinary, saturating (bias +8, bf16 λ == 1), knife-edge zeros.
    gates = np.concatenate([rng.normal(0, 3, (num_loops, 300)), 8 + rng.normal(0, 2, (num_loops, 300)),
                            np.zeros((num_loops, 4))], axis=1)
    ref_gates = [refs[tag, m][f"p{k}_gate_logits"] for m in ("A", "sat") for k in PROMPTS]
    gate = jnp.asarray(np.concatenate([gates, *ref_gates], axis=1)).astype(dt)
    hidden = jnp.asarray(rng.normal(size=(num_loops, gate.shape[1], hidden_size))).astype(dt)

    @jax.jit
    def both(gate, hidden, threshold):
        def body(state, depth):
            return ouro.exit_update(state, gate[depth], hidden[depth], depth, num_loops, threshold), None
        init = ouro.exit_init(gate.shape[1], hidden_size, num_loops, dt)
        state, _ = jax.lax.scan(body, init, jnp.arange(num_loops))
        cdf = ouro.exit_cdf(ouro.exit_pdf(gate))
        exit_loop = ouro.threshold_exit(cdf, threshold)
        return state, exit_loop, ouro.select_loop(hidden, exit_loop), cdf

    seen = {}
    for threshold in (1.0, 0.5, 0.9, 0.0):
        state, exit_loop, selected, cdf = both(gate, hidden, jnp.float32(threshold))
        seen[threshold] = set(np.asarray(exit_loop).tolist())
        np.testing.assert_array_equal(state.exit_loop, exit_loop)
        np.testing.assert_array_equal(state.hidden, selected)
        np.testing.assert_array_equal(state.cdf_hi.astype(dt), cdf[-1])
        assert bool(state.exited.all())
    # The data exercises every exit loop at threshold 0.5, and several at 1.0 (saturation).
    assert seen[0.5] == {0, 1, 2, 3} and len(seen[1.0]) > 1 and seen[0.0] == {0}


def test_incremental_exit_state_with_per_token_loop_counts():
    """The engine's fused loop: rows with fewer loops (num_loops [N]) stop updating after their
    last loop; each row then equals the batch rule over its own loops."""
    dt, max_loops, hidden_size = jnp.bfloat16, 4, 4
    rng = np.random.default_rng(3)
    num_tokens = 400
    gate = jnp.asarray(rng.normal(2, 3, (max_loops, num_tokens))).astype(dt)
    hidden = jnp.asarray(rng.normal(size=(max_loops, num_tokens, hidden_size))).astype(dt)
    row_loops = jnp.asarray(rng.integers(1, max_loops + 1, num_tokens), jnp.int32)

    @jax.jit
    def fused(gate, hidden, row_loops):
        def body(depth, state):
            new = ouro.exit_update(state, gate[depth], hidden[depth], depth, row_loops, 0.9)
            live = depth < row_loops
            return jax.tree.map(lambda a, b: jnp.where(live.reshape(-1, *[1] * (a.ndim - 1)), a, b),
                                new, state)
        return jax.lax.fori_loop(0, max_loops, body, ouro.exit_init(num_tokens, hidden_size, max_loops, dt))

    @jax.jit
    def batch_rule(gate, hidden):  # over every token, for the first n = len(gate) loops
        exit_loop = ouro.threshold_exit(ouro.exit_cdf(ouro.exit_pdf(gate)), 0.9)
        return exit_loop, ouro.select_loop(hidden, exit_loop)

    state = fused(gate, hidden, row_loops)
    for n in range(1, max_loops + 1):
        rows = np.asarray(row_loops) == n
        exit_loop, selected = batch_rule(gate[:n], hidden[:n])
        exit_loop = np.asarray(exit_loop)[rows]
        np.testing.assert_array_equal(state.exit_loop[rows], exit_loop)
        np.testing.assert_array_equal(state.hidden[rows], np.asarray(selected)[rows])
        assert (exit_loop < n - 1).any() or n == 1


# ---------------------------------------------------------------- Model A-sat (gate bias 8)

@pytest.mark.parametrize("tag", DTYPES)
@pytest.mark.parametrize("k", PROMPTS)
def test_saturated_gate_exit_steps(runs, refs, tag, k):
    ref = refs[tag, "sat"]
    t = len(ref[f"p{k}_input_ids"])
    out = runs(tag, "sat", k)
    np.testing.assert_array_equal(out.exit_loop[:t], ref[f"p{k}_exit_steps_thr1p0"])
    assert_close(out.gate_logits[:, :t], ref[f"p{k}_gate_logits"], tag, "sat gate_logits")
    assert_close(out.logits[:t], ref[f"p{k}_exit_logits_thr1p0"], tag, "sat exit logits")
    # Generated rows: row i is predicted at position t-1+i.
    np.testing.assert_array_equal(out.exit_loop[t - 1:t + 11], ref[f"p{k}_greedy_exit_steps"])


def test_saturated_gate_exits_at_loop0_in_bf16_only(runs, refs):
    def prompt_exits(tag):
        lengths = [len(refs[tag, "sat"][f"p{k}_input_ids"]) for k in PROMPTS]
        return np.concatenate([np.asarray(runs(tag, "sat", k).exit_loop)[:t]
                               for k, t in zip(PROMPTS, lengths)])

    bf16, fp32 = prompt_exits("bf16"), prompt_exits("fp32")
    assert (bf16 == 0).sum() > len(bf16) // 2
    assert (fp32 != 0).all() and (fp32 < 3).any()  # fp32 exits early too, never at loop 0


# ----------------------------------------------------------------------- greedy generation

@pytest.mark.parametrize("model", ("A", "sat"))
@pytest.mark.parametrize("tag", DTYPES)
@pytest.mark.parametrize("k", PROMPTS)
def test_teacher_forced_greedy_rows(runs, refs, tag, model, k):
    """The reference's greedy rows vs our forward over prompt + its tokens: logits rows close,
    argmax equal wherever the reference's margin is decisive (margin_is_safe), exit steps exact."""
    ref = refs[tag, model]
    t, tokens = len(ref[f"p{k}_input_ids"]), ref[f"p{k}_greedy_tokens"]
    out = runs(tag, model, k)
    rows = np.asarray(out.logits[t - 1:t - 1 + len(tokens)])
    assert_close(rows, ref[f"p{k}_greedy_logits"], tag, "greedy logits rows")
    safe = [margin_is_safe(r, m, DTYPES[tag])
            for r, m in zip(ref[f"p{k}_greedy_logits"], ref[f"p{k}_greedy_margin"])]
    if tag == "fp32":
        assert all(safe)
    assert sum(safe) >= len(tokens) // 2
    np.testing.assert_array_equal(rows.argmax(-1)[safe], tokens[safe])
    np.testing.assert_array_equal(out.exit_loop[t - 1:t - 1 + len(tokens)], ref[f"p{k}_greedy_exit_steps"])


@pytest.mark.parametrize("model", ("A", "sat"))
@pytest.mark.parametrize("tag", DTYPES)
def test_greedy_by_full_recomputation(cfg, models, refs, tag, model):
    """fp32: every token equals the reference's. bf16: the tokens before the first position whose
    reference margin is not decisive (a near-tie may legitimately flip, and the runs diverge)."""
    ref = refs[tag, model]
    for k in PROMPTS:
        tokens = ref[f"p{k}_greedy_tokens"]
        safe = [margin_is_safe(r, m, DTYPES[tag])
                for r, m in zip(ref[f"p{k}_greedy_logits"], ref[f"p{k}_greedy_margin"])]
        num_checked = safe.index(False) if False in safe else len(tokens)
        if tag == "fp32":
            assert num_checked == len(tokens)
        ours = ouro.greedy_nocache(models[tag, model], cfg, ref[f"p{k}_input_ids"], max(num_checked, 1),
                                   padded_len=PAD_LEN)
        np.testing.assert_array_equal(ours[:num_checked], tokens[:num_checked])


# --------------------------------------------------------------- params tree and conversion

def test_params_tree_matches_specs(cfg, models):
    specs = ouro.param_specs(cfg, jnp.float32)
    shapes = lambda tree: jax.tree.map(lambda a: (a.shape, a.dtype), tree)
    assert shapes(models["fp32", "A"]) == shapes(specs)
    assert len(ouro_keys.hf_tensor_shapes(cfg)) == 27
    init = ouro.init_params(cfg, jax.random.key(0), jnp.bfloat16)
    assert shapes(init) == shapes(ouro.param_specs(cfg, jnp.bfloat16))
    again = ouro.init_params(cfg, jax.random.key(0), jnp.bfloat16)
    other = ouro.init_params(cfg, jax.random.key(1), jnp.bfloat16)
    assert (np.asarray(init["layers"][1]["wqkv"]) == np.asarray(again["layers"][1]["wqkv"])).all()
    assert not (np.asarray(init["embed"]) == np.asarray(other["embed"])).all()
    std = float(jnp.std(init["layers"][0]["w_down"].astype(jnp.float32)))
    assert std == pytest.approx(ouro.INIT_STD, rel=0.1)
    assert (np.asarray(init["norm"]) == 1).all()


def test_gqa_tied_forward_against_numpy_reference():
    """GQA (2 query heads per kv head) and tied embeddings, which Model A lacks: the HF tensors
    go through to_params and the forward, and match an independent float64 reference."""
    cfg = OuroConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=8, rope_theta=100.0, total_ut_steps=3,
                     tie_word_embeddings=True)
    shapes = ouro_keys.hf_tensor_shapes(cfg)
    assert "lm_head.weight" not in shapes
    rng = np.random.default_rng(2)
    hf = {name: (1 + 0.2 * rng.normal(size=shape) if "norm" in name else 0.3 * rng.normal(size=shape))
          .astype(np.float32) for name, shape in shapes.items()}
    params = jax.tree.map(jnp.asarray, ouro_keys.to_params(cfg, hf))
    np.testing.assert_array_equal(params["lm_head"], hf["model.embed_tokens.weight"].T)
    ids = rng.integers(0, cfg.vocab_size, 11)
    out = ouro.forward(params, cfg, ids)
    hidden, gates = numpy_reference(hf, cfg, ids, cfg.total_ut_steps)
    assert_close(out.loop_hidden, hidden, "fp32", "gqa hidden")
    assert_close(out.gate_logits, gates, "fp32", "gqa gate")
    assert_close(out.loop_logits, hidden @ hf["model.embed_tokens.weight"].T.astype(np.float64), "fp32",
                 "gqa logits")
    two = ouro.forward(params, cfg, ids, loops=2)
    assert two.loop_hidden.shape == (2, 11, cfg.hidden_size)
    np.testing.assert_allclose(two.loop_hidden, out.loop_hidden[:2], atol=1e-6)


def test_forward_rejects_bad_arguments(cfg, models):
    params = models["fp32", "A"]
    for kwargs, message in (({"loops": 0}, "loops must be a positive"),
                            ({"exit_step": 4}, "exit_step 4 is outside"),
                            ({"exit_step": 1, "weighted": True}, "exclusive")):
        with pytest.raises(ValueError, match=message):
            ouro.forward(params, cfg, padded([5, 6]), **kwargs)
    with pytest.raises(ValueError, match="non-empty 1-D"):
        ouro.forward(params, cfg, np.zeros((2, 3), np.int32))
