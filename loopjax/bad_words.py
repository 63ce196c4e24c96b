"""`bad_words` (vLLM's SamplingParams field): word sequences the output may not contain.

A word is banned as token-id sequences (`token_sequences`, once per request): its text as given
(leading spaces stripped) and with one leading space, the form it takes inside a text, where
that tokenizes differently; special tokens are not added. The output never ends with a whole
sequence: the last token of a sequence is not sampled where the output ends with the rest of
it. Only output tokens count (a prompt ending with a word's beginning bans nothing), as in vLLM.

Each step the host lists a row's bans (`step_bans`): pairs (token, after) where `after` < 0
bans `token` outright, and `after` >= 0 bans it only if the row's last output token is
`after`. The device checks that last token (sampling.py): with async scheduling it was sampled
by a step still in flight and only the device has it. Everything before it the host has:
at most one token is pending, the plan's `input_on_device` (not Request.num_pending_tokens,
which by then counts the token the plan itself samples).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

# Sequences a request may ban (a word gives one or two): a static width of the sampler's table.
MAX_BAD_WORD_SEQUENCES = 56


def token_sequences(words: Sequence[str], encode: Callable[[str], list[int]],
                    vocab_size: int) -> tuple[tuple[int, ...], ...]:
    """The token-id sequences of `words` (module note), in order and without repeats; a
    one-line ValueError for an empty word, an id outside the vocabulary or too many sequences."""
    sequences: dict[tuple[int, ...], None] = {}
    for word in words:
        text = word.lstrip()
        if not text:
            raise ValueError(f"bad_words: {word!r} holds no word")
        for form in (text, " " + text):
            ids = tuple(encode(form))
            if not ids:
                raise ValueError(f"bad_words: {word!r} encodes to no tokens")
            if max(ids) >= vocab_size:
                raise ValueError(f"bad_words: {word!r} encodes to token id {max(ids)}, outside the "
                                 f"vocabulary of {vocab_size}")
            sequences[ids] = None
    if len(sequences) > MAX_BAD_WORD_SEQUENCES:
        raise ValueError(f"bad_words gives {len(sequences)} token sequences (each word as it is and "
                         f"after a space); at most {MAX_BAD_WORD_SEQUENCES}")
    return tuple(sequences)


def request_sequences(model, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """`token_sequences` of a request's words with the model's tokenizer (no special tokens)."""
    if not words:
        return ()
    return token_sequences(words, lambda text: model.tokenize(text, add_special_tokens=False),
                           model.cfg.vocab_size)


def step_bans(sequences: Sequence[tuple[int, ...]], outputs: Sequence[int],
              pending: bool) -> tuple[tuple[int, int], ...]:
    """(token, after) pairs (module note) for the token a row samples next. outputs: the output
    tokens the host has; pending: one more was sampled by a step in flight, so the output's
    last token is on the device only."""
    if not sequences:
        return ()  # NOTE: every emitting row of every step asks
    bans: dict[tuple[int, int], None] = {}
    for *prefix, last in sequences:
        after = prefix.pop() if pending and prefix else -1  # checked on the device
        if len(prefix) > len(outputs) or (prefix and list(outputs[len(outputs) - len(prefix):]) != prefix):
            continue
        bans[(last, after)] = None
    return tuple(bans)
