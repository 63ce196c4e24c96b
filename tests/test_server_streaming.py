"""Streaming with server-sent events: chunks reassemble to the full answer (completions and
chat, usage in the last chunk), and the incremental detokenizer behind them (characters
split over tokens, stop strings trimmed and never streamed)."""

from __future__ import annotations

import types

from server_helpers import MODEL_NAME


def test_streaming_completion_and_chat(client):
    kw = dict(model=MODEL_NAME, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(prompt=[4, 5, 6, 7], **kw)
    chunks = list(client.completions.create(prompt=[4, 5, 6, 7], stream=True,
                                            stream_options={"include_usage": True}, **kw))
    ids = [t for c in chunks for ch in c.choices for t in ch.token_ids]
    assert ids == full.choices[0].token_ids and len(ids) == 10
    assert "".join(ch.text for c in chunks for ch in c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].usage.submissions >= 1
    assert [ch.finish_reason for c in chunks for ch in c.choices][-1] == "length"
    chat = list(client.chat.completions.create(messages=[{"role": "user", "content": "hello"}],
                                               stream=True, **kw))
    assert chat[0].choices[0].delta.role == "assistant"
    assert sum(len(c.choices[0].token_ids or []) for c in chat) == 10


def test_incremental_text_with_split_characters_and_stop_strings():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from loopjax.openai_choice import Choice

    # Byte-level tokenizer without merges: "é", "ö", "✓" span two or three tokens each.
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = "héllo wörld ✓ done"
    ids = tok.encode(text).ids

    def stream(stop, min_tokens=0):
        choice, deltas = Choice(0, tok, stop, min_tokens), []
        for n in range(1, len(ids) + 1):
            done = n == len(ids)
            out = types.SimpleNamespace(token_ids=ids[:n], new_token_ids=ids[n - 1:n], exit_loops=[1] * n,
                                        logprobs=None, top_logprobs=None, metrics={}, finished=done,
                                        finish_reason="length" if done else None)
            deltas.append(choice.update(out)[0])
            if choice.finish_reason:
                return deltas, choice

    deltas, choice = stream(())
    assert "".join(deltas) == choice.text == text and not any("\ufffd" in d for d in deltas)
    assert choice.finish_reason == "length"
    deltas, choice = stream(("ld ✓",))  # the stop string is trimmed and never streamed
    assert "".join(deltas) == choice.text == "héllo wör" and choice.finish_reason == "stop"
    # min_tokens: no stop string ends the text before that many tokens ("héllo w" holds two "l")
    deltas, choice = stream(("l",), min_tokens=len(tok.encode("héllo w").ids))
    assert "".join(deltas) == choice.text == "héllo wör" and choice.finish_reason == "stop"
