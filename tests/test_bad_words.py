"""bad_words (vLLM's SamplingParams field): the token sequences of a word list, the bans of one
step (the host's part), and the sampler's bans that depend on the row's last token (the
device's part). Served end to end: tests/test_server_completions.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loopjax.bad_words import MAX_BAD_WORD_SEQUENCES, step_bans, token_sequences
from loopjax.sampling import SamplingBatch, sample
from loopjax.sampling_params import SamplingParams

# A toy encoder: one id per character, and a leading space its own id (as byte-level BPE
# tokenizers mark a word inside a text differently from one at the start).
ENCODE = {" ": 1} | {c: 2 + i for i, c in enumerate("abcdefghij")}


def encode(text):
    return [ENCODE[c] for c in text]


def test_token_sequences_as_given_and_after_a_space():
    assert token_sequences(["ab", " c"], encode, 64) == ((2, 3), (1, 2, 3), (4,), (1, 4))
    assert token_sequences(["ab", "ab"], encode, 64) == ((2, 3), (1, 2, 3))  # no repeats
    same_with_space = lambda text: encode(text.strip())  # noqa: E731  a word-level tokenizer
    assert token_sequences(["ab"], same_with_space, 64) == ((2, 3),)


@pytest.mark.parametrize("words, vocab, message", [
    (["  "], 64, "holds no word"),
    (["a"], 2, "token id 2, outside the vocabulary of 2"),
    ([c * n for n in range(1, 4) for c in "abcdefghij"], 64, "gives 60 token sequences"),
])
def test_token_sequences_refused(words, vocab, message):
    with pytest.raises(ValueError, match=message):
        token_sequences(words, encode, vocab)
    assert MAX_BAD_WORD_SEQUENCES < 60


SEQUENCES = ((5,), (1, 2), (3, 4, 6))


@pytest.mark.parametrize("outputs, pending, bans", [
    ([], False, ((5, -1),)),  # the first token: single tokens only
    ([9, 3, 4], False, ((5, -1), (6, -1))),  # the host has the whole output: outright bans
    ([1], False, ((5, -1), (2, -1))),
    ([3, 4], False, ((5, -1), (6, -1))),
    ([], True, ((5, -1), (2, 1))),  # the last output token is on the device: 2 banned after a 1
    ([7, 3], True, ((5, -1), (2, 1), (6, 4))),  # ... and 6 after 3 (known) then 4 (on the device)
    ([7, 8], True, ((5, -1), (2, 1))),
])
def test_step_bans(outputs, pending, bans):
    assert step_bans(SEQUENCES, outputs, pending) == bans


@pytest.mark.parametrize("greedy", [False, True])
def test_sampler_bans_where_the_last_token_matches(greedy):
    """A (token, after) ban applies where after < 0 or the row's last token is after, in the
    full and the greedy-only sampler; logprobs stay the model's; min_tokens' stop ids beside."""
    logits = np.zeros((8, 64), np.float32)
    logits[:, 3], logits[:, 5], logits[:, 7] = 30.0, 20.0, 10.0
    params = [SamplingParams(temperature=0.0)] * 4 + [SamplingParams(temperature=0.0, min_tokens=1,
                                                                     stop_token_ids=(5,))]
    bans = [((3, -1),), ((3, 9),), ((3, 9),), ((3, 9), (5, 9)), ((3, -1),)]
    batch = SamplingBatch.from_params(params, 8, [0] * 5, bans)
    prev = jnp.asarray([0, 9, 4, 9, 0, 0, 0, 0], jnp.int32)
    run = jax.jit(sample, static_argnames=("num_top_logprobs", "greedy"))
    x = jnp.asarray(logits)
    tokens, logprobs, *_ = run(x, batch, num_top_logprobs=0, greedy=greedy, prev_tokens=prev)
    assert np.asarray(tokens)[:5].tolist() == [5, 5, 3, 7, 7]
    raw = jax.nn.log_softmax(jnp.asarray(logits[0]))
    np.testing.assert_allclose(np.asarray(logprobs)[0], raw[5], rtol=1e-6)
    unconditional_only, *_ = run(x, batch, num_top_logprobs=0, greedy=greedy)
    assert np.asarray(unconditional_only)[:5].tolist() == [5, 3, 3, 3, 7]  # no last tokens: after-bans off


def test_params_take_a_word_or_a_list_and_need_a_tokenizer():
    from loopjax.config import PRESETS
    from loopjax.sampling_params import check_for_model

    assert SamplingParams(bad_words="no").bad_words == ("no",)
    assert SamplingParams(bad_words=["a b", "c"]).bad_words == ("a b", "c")
    with pytest.raises(ValueError, match="every bad_words entry must be a non-empty string"):
        SamplingParams(bad_words=[3])
    with pytest.raises(ValueError, match="bad_words needs a tokenizer"):
        check_for_model(SamplingParams(bad_words=["no"]), PRESETS["ouro-tiny"], has_tokenizer=False)
