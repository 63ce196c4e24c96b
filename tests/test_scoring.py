"""`loopjax.score`: next-token log-probabilities from the identity path, equal to the
reference's (golden logits, Ouro and Huginn), the same padded as unpadded, greedy flags and
ranks, the continuation sum, and one clear error per bad input."""

import os

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import loopjax
from loopjax.scoring import MIN_BUCKET, _next_token_logprobs, bucket_len

DATA = os.path.join(os.path.dirname(__file__), "data")
OURO = os.path.join(DATA, "ouro")
HUGINN = os.path.join(DATA, "huginn", "huginn_shape_242")


def reference_scores(logits, ids):
    """numpy: log_softmax(logits[t]) at ids[t + 1], and whether it is the argmax."""
    logits = np.asarray(logits, np.float64)[:-1]
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    nxt = np.asarray(ids)[1:]
    return log_probs[np.arange(len(nxt)), nxt], logits.argmax(-1) == nxt


@pytest.fixture(scope="module")
def ouro():
    return loopjax.load(OURO), np.load(os.path.join(OURO, "reference_fp32.npz"))


def test_ouro_scores_are_the_reference_logits(ouro):
    model, ref = ouro
    sequences = [ref[f"p{k}_input_ids"].tolist() for k in range(3)]  # 5, 12, 17 tokens
    outs = loopjax.score(model, sequences, top_k=3)
    for k, (seq, out) in enumerate(zip(sequences, outs, strict=True)):
        want, greedy = reference_scores(ref[f"p{k}_logits"], seq)
        assert out.token_ids == seq and len(out.token_logprobs) == len(seq) - 1
        np.testing.assert_allclose(out.token_logprobs, want, atol=2e-5, rtol=0)
        assert out.greedy == greedy.tolist()
        logits = ref[f"p{k}_logits"][:-1]
        top_ids = np.argsort(-logits, axis=-1)[:, :3]  # the reference's 3 most likely, in order
        assert [[i for i, _ in top] for top in out.top_logprobs] == top_ids.tolist()
        for t, top in enumerate(out.top_logprobs):
            if out.greedy[t]:  # the scored token is the top one, with its own log-probability
                assert top[0] == (seq[t + 1], pytest.approx(out.token_logprobs[t], abs=1e-6))
        assert out.logprob(2) == pytest.approx(float(want[1:].sum()), abs=1e-4)  # x[2:] given x[:2]
        assert out.logprob(1, 3) == pytest.approx(float(want[:2].sum()), abs=1e-5)
        # `end` as in the slice x[start:end]: negative counts from the end, 0 is empty
        assert out.logprob(2, -1) == pytest.approx(float(want[1:-1].sum()), abs=1e-4)
        assert out.logprob(3, 0) == out.logprob(3, 2) == out.logprob(len(seq) + 1) == 0.0
    # the threshold reaches the exit rule: the reference's threshold-0.5 logits (one sequence,
    # given as a numpy array)
    half, = loopjax.score(model, ref["p1_input_ids"], exit_threshold=0.5)
    want, _ = reference_scores(ref["p1_exit_logits_thr0p5"], sequences[1])
    np.testing.assert_allclose(half.token_logprobs, want, atol=2e-5, rtol=0)
    # the reference's other rules: use_weighted_exit (its training loss's logits), exit_at_step
    weighted, = loopjax.score(model, sequences[1], exit_weighted=True)
    want, _ = reference_scores(ref["p1_weighted_logits"], sequences[1])
    np.testing.assert_allclose(weighted.token_logprobs, want, atol=2e-5, rtol=0)
    stepped, = loopjax.score(model, sequences[1], exit_step=1)
    want, _ = reference_scores(ref["p1_step_logits"][1], sequences[1])
    np.testing.assert_allclose(stepped.token_logprobs, want, atol=2e-5, rtol=0)


def test_ranks_count_the_log_probs_at_or_above_the_scored_token(ouro):
    """ScoreOutput.ranks: the number of log-probs >= the scored token's, its own included
    (vLLM's batched_count_greater_than rule), over every token of the vocabulary; 1 where greedy."""
    model, ref = ouro
    seq = ref["p2_input_ids"].tolist()  # 17 tokens: a 32-token bucket
    out, = loopjax.score(model, seq, top_k=np.int64(2))  # a numpy integer is an integer (it was refused)
    everything, = loopjax.score(model, seq, top_k=model.cfg.vocab_size)
    want = [sum(v >= lp for _, v in top) for lp, top in zip(out.token_logprobs, everything.top_logprobs)]
    assert out.ranks == want and max(out.ranks) > 2  # some token outside the top 2
    assert all(r == 1 for r, greedy in zip(out.ranks, out.greedy, strict=True) if greedy)
    for t, top in enumerate(out.top_logprobs):  # within the top k, the rank is the position
        ids = [i for i, _ in top]
        assert (out.ranks[t] == ids.index(seq[t + 1]) + 1) if seq[t + 1] in ids else (out.ranks[t] > 2)
    assert loopjax.score(model, [5], top_k=2)[0].ranks == []


def test_a_tied_token_ranks_last_of_its_tie_as_vllm_ranks_it():
    """Tied log-probs: a token ranks after every token tied with it (vLLM counts the log-probs
    >= its own; it was 1 + those strictly above, so all three ties ranked 1)."""
    logits = jnp.asarray([[0.0, 2.0, 2.0, 2.0, 1.0, -1.0, 0.5, 0.0]] * 2 + [[0.0] * 8], jnp.float32)
    ids = jnp.asarray([0, 2, 5], jnp.int32)  # position 0 scores token 2 (tied), position 1 token 5
    _, greedy, ranks, _ = _next_token_logprobs(logits, ids, 0)
    assert np.asarray(ranks).tolist() == [3, 8] and not np.asarray(greedy)[0]


def test_padding_changes_no_score(ouro):
    """Scored in a 16-token bucket, a 12-token sequence gets what its unpadded forward gives
    (Ouro; Huginn with its position-keyed s_0, whose state must not depend on the length)."""
    model, ref = ouro
    seq = ref["p1_input_ids"].tolist()
    assert bucket_len(len(seq), model.cfg.max_context_len) == 16
    want, _ = reference_scores(loopjax.forward(model, seq).logits, seq)
    np.testing.assert_allclose(loopjax.score(model, seq)[0].token_logprobs, want, atol=1e-5, rtol=0)
    huginn = loopjax.load(HUGINN)
    seq = load_file(os.path.join(HUGINN, "inputs.safetensors"))["prompt_ids"][0].tolist()[:9]
    want, _ = reference_scores(loopjax.forward(huginn, seq, loops=2).logits, seq)
    np.testing.assert_allclose(loopjax.score(huginn, seq, loops=2)[0].token_logprobs, want, atol=1e-5, rtol=0)


def test_huginn_zero_state_scores_are_the_reference_logits():
    model = loopjax.load(HUGINN)
    inputs = load_file(os.path.join(HUGINN, "inputs.safetensors"))
    golden = load_file(os.path.join(HUGINN, "forward.safetensors"))
    seq = inputs["prompt_ids"][0].tolist()
    out = loopjax.score(model, seq, loops=4, initial_state="zero")[0]
    want, greedy = reference_scores(golden["logits_zero_state_steps4"][0], seq)
    np.testing.assert_allclose(out.token_logprobs, want, atol=5e-5, rtol=0)
    assert out.greedy == greedy.tolist()
    for name, value in (("exit_step", 1), ("exit_weighted", True)):  # Ouro's gate rules
        with pytest.raises(ValueError, match=f"^{name} is an Ouro argument: Huginn has no exit gate$"):
            loopjax.score(model, seq, **{name: value})


def test_buckets_and_errors(ouro):
    model, _ = ouro
    assert [bucket_len(n, 64) for n in (2, 16, 17, 33, 64)] == [MIN_BUCKET, 16, 32, 64, 64]
    assert bucket_len(5, 8) == 8  # capped at the context
    for args, kwargs, words in [
        (([[3, 4], []],), {}, "sequence 1 is empty"),
        (([],), {}, "sequences is empty"),
        (([[3, 4], [7] * (model.cfg.max_context_len + 1)],), {}, "exceeds the model's context"),
        (([3, 999],), {}, "outside the vocabulary"),
        (("hello world",), {}, "tokenizer"),
        (([3, 4],), {"initial_state": np.zeros((2, 4))}, "use loopjax.forward"),
        # the engine's name of the default s_0 is None here; no hint at an explicit s_0
        (([3, 4],), {"initial_state": "seeded"},
         r"^initial_state must be None \(the position-keyed s_0\) or 'zero' when scoring, got 'seeded'$"),
        (([3, 4],), {"top_k": -1}, r"top_k must be an integer in \[0, 256\]"),
        ((np.array([3.7, 4.2]),), {}, "sequence 0 must be text or a flat list of integer token ids"),
        (([[3, 4], [True, False]],), {}, "sequence 1 must be text or a flat list of integer"),
        (([3.0, 4.0],), {}, "sequence 0 must be text or a flat list of integer"),
        (([3, True],), {}, "sequence 0 must be text or a flat list of integer"),  # numpy: [3, 1]
        (([[3, 4], (5, False)],), {}, "sequence 1 must be text or a flat list of integer"),
        (([3, 4],), {"exit_threshold": 1.5}, r"exit_threshold must be in \[0, 1\], got 1.5"),
        (([3, 4],), {"exit_threshold": float("nan")}, r"exit_threshold must be a number in \[0, 1\]"),
        (([3, 4],), {"exit_step": 1, "exit_weighted": True}, "exit_step and exit_weighted exclude each"),
    ]:
        with pytest.raises(ValueError, match=words) as err:
            loopjax.score(model, *args, **kwargs)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="start must be >= 1"):
        loopjax.score(model, [3, 4])[0].logprob(0)
    assert loopjax.score(model, [3, 4])[0].top_logprobs == [[]]  # top_k 0: none
    one, = loopjax.score(model, [5], top_k=2)  # one token: no prefix, nothing to score
    assert (one.token_ids, one.token_logprobs, one.greedy, one.top_logprobs) == ([5], [], [], [])


def test_jax_array_is_one_sequence(ouro):
    """A 1-D jax array is one sequence, as a numpy one (it was read as one sequence per token)."""
    import jax.numpy as jnp

    model, ref = ouro
    seq = ref["p0_input_ids"].tolist()
    got, = loopjax.score(model, jnp.asarray(seq))
    assert got == loopjax.score(model, seq)[0]


def test_model_given_by_name_or_path(ouro):
    """A checkpoint folder as a str or a path object (as LLM takes it) loads the model."""
    import pathlib

    model, ref = ouro
    seq = ref["p0_input_ids"].tolist()
    want = loopjax.score(model, seq)[0].token_logprobs
    for given in (OURO, pathlib.Path(OURO)):
        assert loopjax.score(given, seq)[0].token_logprobs == want
