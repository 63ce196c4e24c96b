"""Huginn identity against the PyTorch reference's goldens (tests/data/huginn, README there):
the (1,2,1) top-level model and the (2,4,2) huginn_shape_242 set, fp32, logits atol 1e-4.

Compiles are shared: per folder one forward at 32 loops (every stored loop count n <= 32 is
row n-1 of its loop_logits, the same computation as a forward at n loops), one at 0 loops,
one at mean_recurrence, and one fixed-length generation buffer.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from loopjax.config import PRESETS, read_hf_config
from loopjax.convert.huginn_keys import (
    IGNORED_HF_KEYS,
    hf_tensor_shapes,
    optional_hf_tensor_shapes,
    to_params,
)
from loopjax.layers import DenseCausal, rms_norm, rope_angles
from loopjax.models import huginn

DATA = os.path.join(os.path.dirname(__file__), "data", "huginn")
FOLDERS = {"121": DATA, "242": os.path.join(DATA, "huginn_shape_242")}
ATOL = 1e-4
STORED_LOOPS = (1, 2, 3, 4, 8, 16, 32)


@pytest.fixture(scope="module", params=sorted(FOLDERS))
def golden(request):
    folder = FOLDERS[request.param]
    cfg = read_hf_config(folder)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    params = jax.tree.map(jnp.asarray, to_params(cfg, tensors))
    data = {name: load_file(os.path.join(folder, f"{name}.safetensors"))
            for name in ("inputs", "forward", "generate")}
    return cfg, tensors, params, data


@pytest.fixture(scope="module")
def runs(golden):
    """Forward at 32 loops and at 0 loops for both prompt rows, random and zero state."""
    cfg, _, params, data = golden
    inputs = data["inputs"]
    out = {"full": [], "none": [], "zero": []}
    for row in range(inputs["prompt_ids"].shape[0]):
        ids, s0 = inputs["prompt_ids"][row], inputs["init_state"][row]
        out["full"].append(huginn.forward(params, cfg, ids, loops=32, initial_state=s0))
        out["none"].append(huginn.forward(params, cfg, ids, loops=0, initial_state=s0))
        out["zero"].append(huginn.forward(params, cfg, ids, loops=32, initial_state="zero"))
    return out


def close(actual, expected, atol=ATOL):
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=0, atol=atol)


# ---------------------------------------------------------------- forward

def test_logits_and_latents_every_stored_loop_count(golden, runs):
    cfg, _, params, data = golden
    fw = data["forward"]
    for row, out in enumerate(runs["full"]):
        assert out.loop_logits.shape == (32, 12, cfg.vocab_size)
        assert out.loop_logits.dtype == jnp.float32
        for n in STORED_LOOPS:
            close(out.loop_logits[n - 1], fw[f"logits_steps{n}"][row])
            latent = rms_norm(out.loop_hidden[n - 1], params["ln_f"], cfg.norm_eps)
            close(latent, fw[f"latent_states_steps{n}"][row])
        close(out.logits, fw["logits_steps32"][row])
        close(out.latents, fw["latent_states_steps32"][row])


def test_zero_loops_sends_initial_state_to_coda(golden, runs):
    fw = golden[3]["forward"]
    for row, out in enumerate(runs["none"]):
        assert out.loop_logits.shape[0] == 0 and out.loop_hidden.shape[0] == 0
        close(out.logits, fw["logits_steps0"][row])
        close(out.latents, fw["latent_states_steps0"][row])


def test_per_loop_raw_states_match_trajectory(golden, runs):
    traj = golden[3]["forward"]["trajectory_raw"]
    for row, out in enumerate(runs["full"]):
        close(out.loop_hidden, traj[1:, row])


def test_zero_state_logits(golden, runs):
    fw = golden[3]["forward"]
    for row, out in enumerate(runs["zero"]):
        for n in (1, 4, 32):
            close(out.loop_logits[n - 1], fw[f"logits_zero_state_steps{n}"][row])


def test_default_loops_is_mean_recurrence(golden):
    cfg, _, params, data = golden
    ids, s0 = data["inputs"]["prompt_ids"][0], data["inputs"]["init_state"][0]
    out = huginn.forward(params, cfg, ids, initial_state=s0)
    assert out.loop_logits.shape[0] == cfg.mean_recurrence
    close(out.logits, data["forward"][f"logits_steps{cfg.mean_recurrence}"][0])


def test_embed_and_prelude_output(golden):
    cfg, _, params, data = golden
    fw, ids = data["forward"], data["inputs"]["prompt_ids"]

    @jax.jit
    def embed_prelude(params, ids):
        cos, sin = rope_angles(jnp.arange(ids.shape[0]), cfg.head_dim, cfg.rope_base)
        x = huginn.embed(params, cfg, ids)
        return x, huginn.prelude(params, cfg, x, cos, sin, DenseCausal(), None)[0]

    for row in range(ids.shape[0]):
        x, e = embed_prelude(params, ids[row])
        close(x, fw["embed_scaled"][row], atol=1e-6)
        close(e, fw["prelude_out"][row])


def test_attention_backend_sees_cache_layer_ids_and_depth(golden):
    """Prelude i -> i, core j -> P + j at the loop's depth, coda i -> P + R + i at depth 0."""
    cfg, _, params, _ = golden
    calls = []

    class Recording(DenseCausal):
        def __call__(self, kv, layer_id, depth, q, k, v):
            calls.append((layer_id, int(depth)))
            return super().__call__(kv, layer_id, depth, q, k, v)

    attn, n = Recording(), 3
    cos, sin = rope_angles(jnp.arange(n), cfg.head_dim, cfg.rope_base)
    x = huginn.embed(params, cfg, jnp.arange(n))
    e, _ = huginn.prelude(params, cfg, x, cos, sin, attn, None)
    s, _ = huginn.core_loop(params, cfg, huginn.zero_state(cfg, n), e, cos, sin, attn, None, 5)
    huginn.coda(params, cfg, s, cos, sin, attn, None)
    p, r, c = cfg.num_prelude_layers, cfg.num_core_layers, cfg.num_coda_layers
    assert calls == ([(i, 0) for i in range(p)] + [(p + j, 5) for j in range(r)]
                     + [(p + r + i, 0) for i in range(c)])


# ---------------------------------------------------------------- generation

def test_greedy_generation_replays_init_states(golden):
    cfg, _, params, data = golden
    gen = data["generate"]
    prompt = gen["gen_sequence"][0, :12]
    tokens, logits, _ = huginn.generate_greedy_recompute(
        params, cfg, prompt, 8, initial_states=gen["gen_init_states"][0])
    np.testing.assert_array_equal(np.asarray(tokens), gen["gen_tokens"][0])
    close(logits, gen["gen_logits"])


def test_greedy_generation_zero_state(golden):
    cfg, _, params, data = golden
    gen = data["generate"]
    tokens, logits, _ = huginn.generate_greedy_recompute(
        params, cfg, gen["gen_sequence"][0, :12], 8, initial_states="zero")
    np.testing.assert_array_equal(np.asarray(tokens), gen["gen_zero_state_tokens"][0])
    close(logits, gen["gen_zero_state_logits"])


def test_greedy_generation_warm_start(golden):
    cfg, _, params, data = golden
    gen = data["generate"]
    tokens, logits, s0 = huginn.generate_greedy_recompute(
        params, cfg, gen["gen_sequence"][0, :12], 8,
        initial_states=gen["gen_cc_prefill_init_state"][0], warm_start=True)
    np.testing.assert_array_equal(np.asarray(tokens), gen["gen_cc_tokens"][0])
    close(logits, gen["gen_cc_logits"])
    close(s0[12:], gen["gen_cc_warm_states"][0])


# ---------------------------------------------------------------- initial state

TINY = PRESETS["huginn-tiny"]


def test_initial_state_is_keyed_by_seed_and_position():
    whole = np.asarray(huginn.initial_state(TINY, 7, jnp.arange(40)))
    chunk = np.asarray(huginn.initial_state(TINY, 7, jnp.arange(13, 21)))
    np.testing.assert_array_equal(chunk, whole[13:21])
    shuffled = np.asarray(huginn.initial_state(TINY, 7, jnp.array([30, 2, 30])))
    np.testing.assert_array_equal(shuffled, whole[[30, 2, 30]])
    # Per-token seeds: each row depends on its own (seed, position) only.
    other = np.asarray(huginn.initial_state(TINY, 8, jnp.arange(40)))
    mixed = np.asarray(huginn.initial_state(TINY, jnp.array([7, 8, 7]), jnp.array([3, 3, 4])))
    np.testing.assert_array_equal(mixed, np.stack([whole[3], other[3], whole[4]]))
    assert not np.array_equal(whole, other)
    assert not np.array_equal(whole[0], whole[1])


def test_initial_state_distribution():
    state = np.asarray(huginn.initial_state(TINY, 0, jnp.arange(512)))
    h = TINY.hidden_size
    bound = 3 * TINY.init_state_std * np.sqrt(h)  # 3 * sqrt(2/5) ~ 1.897, as the reference cuts
    assert state.shape == (512, h) and state.dtype == np.float32
    assert np.abs(state).max() <= bound + 1e-6
    # A normal truncated at 3 sigma has std 0.9866 sigma: sqrt(2/5) * 0.9866 ~ 0.624.
    assert abs(state.std() - 0.9866 * np.sqrt(2 / 5)) < 0.01
    assert abs(state.mean()) < 0.01
    assert huginn.initial_state(TINY, 0, jnp.arange(4), jnp.bfloat16).dtype == jnp.bfloat16


def test_forward_default_state_is_position_keyed(golden):
    cfg, _, params, data = golden
    ids = data["inputs"]["prompt_ids"][0]
    s0 = huginn.initial_state(cfg, 3, jnp.arange(ids.shape[0]))
    implicit = huginn.forward(params, cfg, ids, loops=32, seed=3)
    explicit = huginn.forward(params, cfg, ids, loops=32, initial_state=s0)
    np.testing.assert_array_equal(np.asarray(implicit.logits), np.asarray(explicit.logits))


def test_forward_takes_seeded_by_name_as_score_does(golden):
    """`score(initial_state='seeded')` and the engine's huginn_init name the default s_0, which
    `forward` refused as an "unknown mode" (its message calling the default random)."""
    cfg = golden[0]
    named = huginn.resolve_initial_state(cfg, "seeded", 3, 5, jnp.float32)
    np.testing.assert_array_equal(np.asarray(named),
                                  np.asarray(huginn.resolve_initial_state(cfg, None, 3, 5, jnp.float32)))


def test_forward_rejects_bad_arguments(golden):
    cfg, _, params, data = golden
    ids = data["inputs"]["prompt_ids"][0]
    with pytest.raises(ValueError, match="unknown mode"):
        huginn.forward(params, cfg, ids, initial_state="noise")
    with pytest.raises(ValueError, match="expected shape"):
        huginn.forward(params, cfg, ids, initial_state=np.zeros((3, cfg.hidden_size)))
    for bad in ({"s0": 1}, [["a"] * cfg.hidden_size] * len(ids)):  # numpy's words named no field
        with pytest.raises(ValueError, match=r"^huginn initial_state: expected an array \[12, 64\] of num"):
            huginn.forward(params, cfg, ids, initial_state=bad)
    with pytest.raises(ValueError, match="non-negative"):
        huginn.forward(params, cfg, ids, loops=-1)
    with pytest.raises(ValueError, match="exceed the context"):
        huginn.forward(params, cfg, np.zeros(cfg.max_position_embeddings + 1, np.int32))


# ---------------------------------------------------------------- params and keys

def test_key_table_and_params_tree(golden):
    cfg, tensors, params, _ = golden
    required, optional = hf_tensor_shapes(cfg), optional_hf_tensor_shapes(cfg)
    assert set(tensors) == set(required) | set(optional) | IGNORED_HF_KEYS
    for name, shape in {**required, **optional}.items():
        assert tensors[name].shape == shape, name
    specs = huginn.param_specs(cfg, jnp.float32)
    assert jax.tree.structure(specs) == jax.tree.structure(params)
    for spec, leaf in zip(jax.tree.leaves(specs), jax.tree.leaves(params)):
        assert spec.shape == leaf.shape and spec.dtype == leaf.dtype
    # Fused projections are transposed, not reordered: gate rows of mlp.fc become columns.
    fc = tensors["transformer.core_block.0.mlp.fc.weight"]
    np.testing.assert_array_equal(np.asarray(params["core"][0]["w_gate_up"]), fc.T)


def test_untied_lm_head_is_refused(golden):
    cfg, tensors, _, _ = golden
    bad = dict(tensors)
    bad["lm_head.weight"] = tensors["lm_head.weight"] + 1.0
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        to_params(cfg, bad)
    del bad["lm_head.weight"], bad["freqs_cis"]  # both optional
    assert to_params(cfg, bad)["embed"].shape == (cfg.vocab_size, cfg.hidden_size)
    del bad["transformer.ln_f.weight"]
    with pytest.raises(ValueError, match="lacks 1 tensor"):
        to_params(cfg, bad)


def test_init_params_matches_specs():
    key = jax.random.key(0)
    params = huginn.init_params(TINY, key, jnp.bfloat16)
    specs = huginn.param_specs(TINY, jnp.bfloat16)
    assert jax.tree.structure(specs) == jax.tree.structure(params)
    for spec, leaf in zip(jax.tree.leaves(specs), jax.tree.leaves(params)):
        assert spec.shape == leaf.shape and spec.dtype == leaf.dtype
    assert np.all(np.asarray(params["core"][0]["norm_1"], np.float32) == 1.0)
    again = huginn.init_params(TINY, key, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(params["core"][1]["wqkv"], np.float32),
                                  np.asarray(again["core"][1]["wqkv"], np.float32))
    assert not np.array_equal(np.asarray(params["core"][0]["wqkv"], np.float32),
                              np.asarray(params["core"][1]["wqkv"], np.float32))


def test_bfloat16_forward_keeps_dtypes_and_tracks_fp32(golden, runs):
    """bf16 params give bf16 activations (no silent promotion) and f32 logits close to fp32's."""
    cfg, _, params, data = golden
    params16 = jax.tree.map(lambda w: w.astype(jnp.bfloat16), params)
    ids, s0 = data["inputs"]["prompt_ids"][0], data["inputs"]["init_state"][0]
    out = huginn.forward(params16, cfg, ids, loops=2, initial_state=s0)
    assert out.loop_hidden.dtype == jnp.bfloat16 and out.latents.dtype == jnp.bfloat16
    assert out.logits.dtype == jnp.float32
    reference = np.asarray(runs["full"][0].loop_logits[1])
    err = np.abs(np.asarray(out.logits) - reference).max()
    assert err < 0.05 * np.abs(reference).max(), err


def test_bfloat16_forward_compiles_without_excess_precision(golden):
    """The identity forward compiles as every model path does (layers.IDENTITY_COMPILER_OPTIONS,
    docs/semantics.md): bf16 rounded where the reference rounds. Huginn's was compiled with XLA's
    defaults, whose excess precision moved its bf16 logits by up to ~0.03 on this CPU."""
    from loopjax.layers import IDENTITY_COMPILER_OPTIONS

    cfg, _, params, data = golden
    params16 = jax.tree.map(lambda w: w.astype(jnp.bfloat16), params)
    ids = jnp.asarray(data["inputs"]["prompt_ids"][0])
    s0 = jnp.asarray(data["inputs"]["init_state"][0], jnp.bfloat16)
    out = huginn.forward(params16, cfg, ids, loops=2, initial_state=s0)
    identity = jax.jit(huginn._forward.__wrapped__, static_argnames=("cfg", "loops", "per_loop_logits"),
                       compiler_options=IDENTITY_COMPILER_OPTIONS)(params16, cfg, ids, s0, 2)
    np.testing.assert_array_equal(np.asarray(out.logits), np.asarray(identity.logits))
