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


def test_logprobs_name_tokens_by_their_text():
    """Logprobs tokens (completions, chat, echo) are each token's text, as vLLM's and OpenAI's,
    so they join to the completion and chat's `bytes` are those of the text; they were the
    vocabulary's strings ("Ġh" for " h" under a byte-level BPE, as Ouro's and Huginn's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from loopjax.openai_choice import Choice

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["Ġh"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("Ġ", "h")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    ids = tok.encode("a h").ids
    assert [tok.id_to_token(t) for t in ids] == ["a", "Ġh"]
    out = types.SimpleNamespace(token_ids=ids, new_token_ids=ids, exit_loops=[1, 1], logprobs=[-1.0, -2.0],
                                top_logprobs=[[(ids[0], -1.0)], [(ids[1], -2.0)]], metrics={}, finished=True,
                                finish_reason="length")
    choice = Choice(0, tok, ())
    choice.update(out)
    lp = choice.fields(0, chat=False)["logprobs"]
    assert lp["tokens"] == ["a", " h"] and "".join(lp["tokens"]) == choice.text == "a h"
    assert lp["top_logprobs"] == [{"a": -1.0}, {" h": -2.0}]
    content = choice.fields(0, chat=True)["logprobs"]["content"]
    assert [(e["token"], e["bytes"]) for e in content] == [("a", [97]), (" h", [32, 104])]
    assert content[1]["top_logprobs"] == [{"token": " h", "logprob": -2.0, "bytes": [32, 104]}]
    answer = {"text": choice.text, "logprobs": lp}
    choice.echo(answer, types.SimpleNamespace(token_ids=ids, token_logprobs=[-0.5], top_logprobs=[[]]), 0)
    assert answer["logprobs"]["tokens"][:2] == ["a", " h"]
