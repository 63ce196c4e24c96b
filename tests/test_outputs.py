"""What a step reports, at O(new tokens) per step: RequestOutput's Snapshots of the request's
append-only lists, and the incremental detokenizer behind stop strings and streamed text."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from loopjax.detokenizer import IncrementalDetokenizer
from loopjax.request import Snapshot
from loopjax.request_extra import RequestExtra, update_text


def test_snapshot_keeps_its_length_after_appends():
    items = [3, 1, 4]
    snap = Snapshot(items)
    items += [1, 5]
    assert len(snap) == 3 and list(snap) == [3, 1, 4] and snap == [3, 1, 4] and snap == (3, 1, 4)
    assert snap != [3, 1, 4, 1] and snap != [3, 1, 5] and snap != "abc"
    assert snap[-1] == 4 and snap[1:] == [1, 4] and snap[::-1] == [4, 1, 3] and snap[:10] == [3, 1, 4]
    with pytest.raises(IndexError):
        snap[3]
    assert repr(snap) == "[3, 1, 4]" and json.dumps(snap[:]) == "[3, 1, 4]"
    assert [9] + snap == [9, 3, 1, 4] and snap + (9,) == [3, 1, 4, 9] and snap + snap == [3, 1, 4] * 2
    assert Snapshot(items) == Snapshot(list(items)) and not Snapshot([])


def byte_tokenizer():
    """Byte-level BPE without merges: one token per byte, so a multi-byte character spans
    tokens (its first tokens decode to U+FFFD)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


class CountingTokenizer:
    """A tokenizer that counts the token ids it is asked to decode."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


TEXT = "loop naïve → 環境 done. " * 40


def test_incremental_text_equals_the_whole_decode_at_linear_cost():
    tok = byte_tokenizer()
    ids = tok.encode(TEXT).ids
    counting = CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting)
    texts = []
    for n in range(1, len(ids) + 1):
        assert not detok.update(ids[:n], final=n == len(ids))
        texts.append(detok.text)
        assert not detok.text.endswith("\ufffd")  # a split character waits for its bytes
    assert detok.text == tok.decode(ids) == TEXT
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert counting.decoded <= 8 * len(ids)  # each id decoded a few times, not once per step


def test_stop_string_spanning_tokens_trims_the_text():
    tok = byte_tokenizer()
    ids = tok.encode("abc 環境 xyz").ids
    detok = IncrementalDetokenizer(tok, stop=("xy", "境 "))
    stops = [detok.update(ids[:n]) for n in range(1, len(ids) + 1)]
    assert stops.index(True) == len(tok.encode("abc 環境 ").ids) - 1  # at the stop's last byte
    assert detok.text == "abc 環" and detok.stopped
    assert not any(stops[stops.index(True) + 1:])  # reported once


@pytest.mark.parametrize("min_tokens, text", [(0, "ab "), (5, "ab "), (7, "ab STOP cd "),
                                              (13, "ab STOP cd "), (15, "ab STOP cd STOP ef")])
def test_stop_strings_end_past_min_tokens(min_tokens, text):
    """A stop string ends the text only where it ends past the first min_tokens tokens' text
    (vLLM's rule: the token completing it comes after them, as an EOS does; one that started
    before counts), one token per update or all in one. A stop string that token min_tokens
    completed ended the text there (min_tokens=7: "ab ")."""
    tok = byte_tokenizer()
    ids = tok.encode("ab STOP cd STOP ef").ids  # one token a character
    step, whole = (IncrementalDetokenizer(tok, stop=("STOP",), min_tokens=min_tokens) for _ in range(2))
    stops = [step.update(ids[:n], final=n == len(ids)) for n in range(1, len(ids) + 1)]
    whole.update(ids, final=True)
    assert step.text == whole.text == text and stops.count(True) == step.stopped == whole.stopped


@pytest.mark.parametrize("stop", [("cd", "bc"), ("bc", "cd"), ("abcd", "bc"), ("bc", "abcd"), ("c", "bc")])
def test_overlapping_stop_strings_cut_where_the_first_one_ends(stop):
    """Stop strings matched in one update: the first to end wins (of those ending at one
    character, the longest), as one character a step would have stopped; not the list order."""
    tok = byte_tokenizer()
    ids = tok.encode("abcd").ids
    whole, step = IncrementalDetokenizer(tok, stop), IncrementalDetokenizer(tok, stop)
    assert whole.update(ids) and any(step.update(ids[:n]) for n in range(1, len(ids) + 1))
    assert whole.text == step.text == "a"


def test_special_tokens_kept_or_skipped_and_spaced_or_not():
    """skip_special_tokens=False keeps special tokens in the text; spaces_between_special_tokens
    False gives an added token right after another its content alone (vLLM's rule: no space a
    decoder puts between tokens), step by step as in one update."""
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "hello": 3}, "<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()  # joins tokens with spaces
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    ids = [1, 1, 3, 2, 2]

    def text(**kw):
        step, whole = IncrementalDetokenizer(tok, **kw), IncrementalDetokenizer(tok, **kw)
        for n in range(1, len(ids) + 1):
            step.update(ids[:n], final=n == len(ids))
        whole.update(ids, final=True)
        assert step.text == whole.text and step.offsets == whole.offsets
        return step.text

    assert text() == "hello" == tok.decode(ids)
    assert text(skip_special_tokens=False) == tok.decode(ids, skip_special_tokens=False)
    assert text(skip_special_tokens=False) == "<|im_start|> <|im_start|> hello <|im_end|> <|im_end|>"
    unspaced = "<|im_start|><|im_start|> hello <|im_end|><|im_end|>"
    assert text(skip_special_tokens=False, spaces_between_special_tokens=False) == unspaced
    # skipped special tokens turn the rule off (vLLM's): an added token after a skipped one kept
    # its content alone, "hello<tool>", as if it followed an added token in the text
    tok.add_tokens(["<tool>"])
    ids = [3, 2, 4]
    assert text(spaces_between_special_tokens=False) == "hello <tool>" == tok.decode(ids)


def metaspace_tokenizer():
    """A SentencePiece-style word tokenizer: "▁" marks a word's leading space, which the
    decoder drops at the start of a text."""
    vocab = {"<unk>": 0, "▁hello": 1, "▁world": 2, "▁loop": 3, "▁again": 4}
    tok = Tokenizer(models.WordLevel(vocab, "<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return tok


def text_model(tok):
    """What update_text reads of a Model: its tokenizer (and detokenize)."""
    from types import SimpleNamespace

    return SimpleNamespace(tokenizer=tok,
                           detokenize=lambda ids, skip: tok.decode(ids, skip_special_tokens=skip))


def finished_request(prompt, output, reason, **params):
    from types import SimpleNamespace

    from loopjax.sampling_params import SamplingParams

    return SimpleNamespace(sampling_params=SamplingParams(**params), prompt_token_ids=prompt,
                           output_token_ids=output, is_finished=reason is not None, finish_reason=reason)


@pytest.mark.parametrize("stop", [(), ("zz",)])
def test_first_output_token_is_decoded_after_the_prompts_tail(stop):
    """The output is decoded with the prompt's tail as its left context (vLLM primes its
    detokenizer with it), so a SentencePiece first token keeps its word's space: " world" after
    "hello", as vLLM's text; it was decoded alone ("world"), with or without stop strings, in
    the engine and in the server's streamed choice."""
    from types import SimpleNamespace

    from loopjax.openai_choice import Choice
    tok = metaspace_tokenizer()
    model = text_model(tok)
    for prompt in ([1], [1, 3, 4, 3, 1]):  # a short prompt is its own context; a long one's tail
        extra = RequestExtra()
        update_text(extra, finished_request(prompt, [2, 3], "length", stop=stop), model)
        assert extra.text == " world loop"
    choice = Choice(0, tok, finished_request([1], [], None, stop=stop).sampling_params, prompt=[1])
    out = SimpleNamespace(token_ids=[2], new_token_ids=[2], exit_loops=[1], logprobs=None, top_logprobs=None,
                          metrics={}, finished=False, finish_reason=None)
    assert choice.update(out) == (" world", 1)


@pytest.mark.parametrize("stop", [(), ("zz",)])
def test_an_aborted_outputs_text_ends_at_its_last_whole_character(stop):
    """An aborted request's text leaves out a character whose bytes did not all come (vLLM's
    text is what it streamed); it ended in U+FFFD without stop strings and left it out with
    them. A request finished otherwise still shows it (its last token is final)."""

    tok = byte_tokenizer()
    model = text_model(tok)
    prompt, output = tok.encode("a ").ids, tok.encode("bé").ids[:-1]  # é's last byte missing
    for reason, text in (("abort", "b"), ("length", "b\ufffd")):
        extra = RequestExtra()
        update_text(extra, finished_request(prompt, output, reason, stop=stop), model)
        assert extra.text == text, reason


@pytest.mark.parametrize("stop", [(), ("zz",)])
def test_a_character_the_prompt_leaves_unfinished_is_the_outputs(stop):
    """A prompt ending in a character's first bytes: the output's first token completes it,
    and the character is the output's text (vLLM's detokenizer holds it back while primed with
    the prompt); it was lost (its bytes were counted as the prompt's text)."""
    tok = byte_tokenizer()
    model = text_model(tok)
    e_acute = tok.encode("é").ids
    prompt, output = tok.encode("ab").ids + e_acute[:1], e_acute[1:] + tok.encode("x").ids
    for reason in ("length", "abort"):
        extra = RequestExtra()
        update_text(extra, finished_request(prompt, output, reason, stop=stop), model)
        assert extra.text == "éx", reason
