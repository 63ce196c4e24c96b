"""Streaming with server-sent events: chunks reassemble to the full answer (completions and
chat, usage in the last chunk), and the incremental detokenizer behind them (characters
split over tokens, stop strings trimmed and never streamed)."""

from __future__ import annotations

import json
import types

import httpx
import pytest
from fake_engine import FakeEngine
from server_helpers import CHATML, MODEL_NAME, LiveServer, word_tokenizer

from loopjax.sampling_params import SamplingParams
from loopjax.server import create_app


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

    def stream(stop, min_tokens=0, include=False, stop_id=None):
        """The choice's deltas as the engine's outputs arrive; stop_id: the last token is a stop
        token (the engine's finish_reason 'stop' and stop_reason)."""
        params = SamplingParams(stop=stop, min_tokens=min_tokens, max_tokens=64,
                                include_stop_str_in_output=include)
        choice, deltas = Choice(0, tok, params), []
        for n in range(1, len(ids) + 1):
            done = n == len(ids)
            out = types.SimpleNamespace(token_ids=ids[:n], new_token_ids=ids[n - 1:n], exit_loops=[1] * n,
                                        logprobs=None, top_logprobs=None, metrics={}, finished=done,
                                        finish_reason=None if not done else "stop" if stop_id else "length",
                                        stop_reason=stop_id if done else None)
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
    # vLLM's stop_reason, and include_stop_str_in_output keeping the stop string or stop token
    assert (choice.stop_reason, choice.fields(0, chat=False)["stop_reason"]) == ("l", "l")
    deltas, choice = stream(("ld ✓",), include=True)
    assert "".join(deltas) == choice.text == "héllo wörld ✓" and choice.stop_reason == "ld ✓"
    assert stream(())[1].stop_reason is None
    for include, want in ((False, text[:-1]), (True, text)):  # the last token ("e") is a stop token
        deltas, choice = stream((), include=include, stop_id=ids[-1])
        assert "".join(deltas) == choice.text == want
        assert (choice.finish_reason, choice.stop_reason) == ("stop", ids[-1])


def test_streams_hold_back_only_what_may_begin_a_stop_string():
    """A delta holds back the longest end of the text that begins some stop string, not one
    end per stop string added up: with stops "ab" and "cb", "ca" holds back "a" only ("c" was
    held back too, though "ca" begins neither)."""
    from loopjax.openai_choice import Choice

    tok = _byte_tokenizer()
    ids, choice = tok.encode("caxy").ids, Choice(0, tok, SamplingParams(stop=("ab", "cb"), max_tokens=8))
    deltas = []
    for n in range(1, len(ids) + 1):
        done = n == len(ids)
        out = types.SimpleNamespace(token_ids=ids[:n], new_token_ids=ids[n - 1:n], exit_loops=[1] * n,
                                    logprobs=None, top_logprobs=None, metrics={}, finished=done,
                                    finish_reason="length" if done else None, stop_reason=None)
        deltas.append(choice.update(out)[0])
    assert deltas == ["", "c", "ax", "y"] and choice.text == "caxy"


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
                                finish_reason="length", stop_reason=None)
    choice = Choice(0, tok, SamplingParams())
    choice.update(out)
    lp = choice.fields(0, chat=False)["logprobs"]
    assert lp["tokens"] == ["a", " h"] and "".join(lp["tokens"]) == choice.text == "a h"
    assert lp["top_logprobs"] == [{"a": -1.0}, {" h": -2.0}]
    content = choice.fields(0, chat=True)["logprobs"]["content"]
    assert [(e["token"], e["bytes"]) for e in content] == [("a", [97]), (" h", [32, 104])]
    assert content[1]["top_logprobs"] == [{"token": " h", "logprob": -2.0, "bytes": [32, 104]}]
    answer = {"text": choice.text, "logprobs": lp}
    choice.echo(answer, types.SimpleNamespace(token_ids=ids, token_logprobs=[-0.5], top_logprobs=[[]]), 0,
                ("a h", [0, 1]))
    assert answer["logprobs"]["tokens"][:2] == ["a", " h"]


def test_completions_top_logprobs_hold_the_token_itself():
    """Completions' top_logprobs at a position hold its own token after the top ones when it is
    not among them (OpenAI's "up to logprobs + 1 elements", vLLM's; it was left out), echoed
    prompt tokens too; logprobs=0 gives the token alone. Chat's top_logprobs are the top ones."""
    from loopjax.openai_choice import Choice

    tok = word_tokenizer(32)
    out = types.SimpleNamespace(token_ids=[5, 6], new_token_ids=[5, 6], exit_loops=[1, 1],
                                logprobs=[-1.0, -3.0], top_logprobs=[[(5, -1.0)], [(7, -0.5)]], metrics={},
                                finished=True, finish_reason="length", stop_reason=None)
    choice = Choice(0, tok, SamplingParams(logprobs=1))
    choice.update(out)
    lp = choice.fields(0, chat=False)["logprobs"]
    assert lp["top_logprobs"] == [{"user": -1.0}, {"system": -0.5, "assistant": -3.0}]
    assert [len(e["top_logprobs"]) for e in choice.fields(0, chat=True)["logprobs"]["content"]] == [1, 1]
    answer = {"text": choice.text, "logprobs": lp}
    scored = types.SimpleNamespace(token_ids=[3, 4], token_logprobs=[-2.0], top_logprobs=[[(8, -0.1)]])
    choice.echo(answer, scored, 1, ("hello world", [0, 6]))
    assert answer["logprobs"]["top_logprobs"][:2] == [None, {"the": -0.1, "world": -2.0}]
    named = Choice(0, tok, SamplingParams(logprobs=1), ids_as_names=True)  # vLLM's return_tokens_as_token_ids
    named.update(out)
    assert named.fields(0, chat=False)["logprobs"]["top_logprobs"] == [
        {"token_id:5": -1.0}, {"token_id:7": -0.5, "token_id:6": -3.0}]
    entry = named.fields(0, chat=True)["logprobs"]["content"][0]
    assert (entry["token"], entry["bytes"]) == ("token_id:5", list(b"token_id:5"))
    out.top_logprobs = [[], []]  # logprobs=0
    choice = Choice(0, tok, SamplingParams(logprobs=0))
    choice.update(out)
    assert choice.fields(0, chat=False)["logprobs"]["top_logprobs"] == [{"user": -1.0}, {"assistant": -3.0}]
    # -inf (NaN) log-probabilities are vLLM's -9999.0: JSON holds no -inf (a full answer was a 500)
    inf = float("-inf")
    out.logprobs, out.top_logprobs = [inf, -3.0], [[(5, inf)], [(7, float("nan"))]]
    choice = Choice(0, tok, SamplingParams(logprobs=1))
    choice.update(out)
    answer = {"text": choice.text, "logprobs": choice.fields(0, chat=False)["logprobs"]}
    scored = types.SimpleNamespace(token_ids=[3, 4], token_logprobs=[inf], ranks=[9],
                                   top_logprobs=[[(8, inf)]])
    choice.echo(answer, scored, 1, ("hello world", [0, 6]))
    assert answer["logprobs"]["token_logprobs"] == [None, -9999.0, -9999.0, -3.0]
    assert answer["logprobs"]["top_logprobs"][1:3] == [{"the": -9999.0, "world": -9999.0}, {"user": -9999.0}]
    chat = choice.fields(0, chat=True)["logprobs"]["content"]
    assert [(e["logprob"], e["top_logprobs"][0]["logprob"]) for e in chat] == [(-9999.0, -9999.0),
                                                                               (-3.0, -9999.0)]
    from loopjax.openai_choice import prompt_logprobs
    assert prompt_logprobs(scored, 1, tok)[1]["4"]["logprob"] == -9999.0
    json.dumps([answer, chat], allow_nan=False)  # JSON, as a full answer's JSONResponse writes it


def test_text_offsets_place_each_token_in_the_text():
    """Completions' text_offset (null before) is where each token's text begins in the choice's
    text: a special token skipped and the first bytes of a split character add nothing (vLLM
    sums the lengths of the tokens' names: 1 for each U+FFFD, 3 for "<s>"); the streamed chunks'
    offsets are the full answer's, and echo's prompt shifts them."""
    from loopjax.openai_choice import Choice

    tok = _byte_tokenizer()
    tok.add_special_tokens(["<s>"])
    ids = tok.encode("aé").ids + tok.encode("<s>").ids + tok.encode(" b").ids
    assert len(ids) == 6 and tok.id_to_token(ids[3]) == "<s>"

    def offsets(skip: bool, echoed=None):
        choice, chunks = Choice(0, tok, SamplingParams(skip_special_tokens=skip)), []
        for n in range(1, len(ids) + 1):
            done = n == len(ids)
            out = types.SimpleNamespace(token_ids=ids[:n], new_token_ids=ids[n - 1:n], exit_loops=[1] * n,
                                        logprobs=[-1.0] * n, top_logprobs=[[]] * n, metrics={},
                                        finished=done, finish_reason="length" if done else None,
                                        stop_reason=None)
            choice.update(out)
            chunks += choice.fields(n - 1, chat=False)["logprobs"]["text_offset"]
        answer = {"text": choice.text, "logprobs": choice.fields(0, chat=False)["logprobs"]}
        assert answer["logprobs"]["text_offset"] == chunks
        if echoed is not None:
            scored = types.SimpleNamespace(token_ids=[7, 8], token_logprobs=[-0.5], top_logprobs=[[]])
            choice.echo(answer, scored, 0, echoed)
        return answer["text"], answer["logprobs"]["text_offset"]

    assert offsets(True) == ("aé b", [0, 1, 1, 2, 2, 3])
    assert offsets(False) == ("aé<s> b", [0, 1, 1, 2, 5, 6])
    assert offsets(True, ("xy", [0, 1])) == ("xyaé b", [0, 1, 2, 3, 3, 4, 4, 5])


def _byte_tokenizer():
    """Byte-level BPE without merges: "é" spans two tokens (its first decodes to U+FFFD)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok



def sse_chunks(url: str, body: dict) -> list[dict]:
    """The JSON events of a stream (the [DONE] last, dropped)."""
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=30) as stream:
        events = [line.removeprefix("data: ") for line in stream.iter_lines() if line]
    assert events[-1] == "[DONE]", events
    return [json.loads(e) for e in events[:-1]]


@pytest.fixture(scope="module")
def fake_chat_server():
    """A live server of the fake engine (one token a step: previous + 1) with the word tokenizer
    and ChatML: chat without compiling anything."""
    model = types.SimpleNamespace(tokenizer=word_tokenizer(256), chat_template=CHATML,
                                  cfg=types.SimpleNamespace(vocab_size=256, max_context_len=512))
    with LiveServer(create_app(FakeEngine(), MODEL_NAME, model=model)) as live:
        yield live


def test_include_usage_puts_null_usage_on_every_other_chunk(fake_chat_server):
    """stream_options.include_usage: every chunk carries "usage": null but the last, which has
    no choices and the usage (OpenAI's; the other chunks had no usage field); without it no
    chunk has the field."""
    chat = [{"role": "user", "content": "hi"}]
    for path, body, count, tokens in (("/v1/completions", {"prompt": [4], "n": 2}, 6, 6),  # a chunk a token
                                      ("/v1/chat/completions", {"messages": chat}, 4, 3)):  # and the role's
        body = {**body, "max_tokens": 3}
        chunks = sse_chunks(fake_chat_server.url + path, {**body, "stream_options": {"include_usage": True}})
        assert len(chunks) == count + 1 and all("usage" in c and c["usage"] is None for c in chunks[:-1])
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == tokens
        assert not any("usage" in c for c in sse_chunks(fake_chat_server.url + path, body))
    # vLLM's include_usage defaults to true within stream_options (an empty one had no usage);
    # an empty one without stream is no 400 there (a full answer)
    chunks = sse_chunks(fake_chat_server.url + "/v1/completions", {"prompt": [4], "stream_options": {}})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 16
    off = sse_chunks(fake_chat_server.url + "/v1/completions",
                     {"prompt": [4], "stream_options": {"include_usage": False}})
    assert not any("usage" in c for c in off)
    full = httpx.post(fake_chat_server.url + "/v1/completions", timeout=30,
                      json={"prompt": [4], "max_tokens": 2, "stream_options": {}})
    assert full.status_code == 200 and full.json()["usage"]["completion_tokens"] == 2, full.text
    # vLLM's continuous_usage_stats: each chunk carries its choice's usage so far
    continuous = {"include_usage": True, "continuous_usage_stats": True}
    chunks = sse_chunks(fake_chat_server.url + "/v1/completions",
                        {"prompt": [[4], [5, 6]], "max_tokens": 2, "stream_options": continuous})
    seen = {}
    for c in chunks[:-1]:
        i = c["choices"][0]["index"]
        seen[i] = seen.get(i, 0) + 1
        used = c["usage"]
        assert (used["prompt_tokens"], used["completion_tokens"], used["total_tokens"]) == (
            1 + i, seen[i], 1 + i + seen[i]), c
    assert chunks[-1]["usage"]["prompt_tokens"] == 3 and chunks[-1]["usage"]["completion_tokens"] == 4


def test_chat_echo_puts_the_last_message_first(fake_chat_server):
    """Chat's echo (vLLM's; it was refused): the last message's content before each choice's
    text when its role is the answer's: an assistant message continued (continue_final_message),
    or with no generation prompt the last message, whose role the answer then takes; a user
    message under a generation prompt is not echoed. Streamed as vLLM's: every choice's role
    chunk (content ""), then, when there is text, a chunk of it per choice (it was in the role chunk)."""
    url = fake_chat_server.url + "/v1/chat/completions"
    talk = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "the loop"}]
    for body, role, echoed in (
            ({"messages": talk, "continue_final_message": True}, "assistant", "the loop"),
            ({"messages": talk[:1], "add_generation_prompt": False}, "user", "hello"),
            ({"messages": talk[:1]}, "assistant", "")):
        body = {**body, "max_tokens": 2, "n": 2}
        plain = httpx.post(url, json=body, timeout=30).json()["choices"][0]["message"]
        r = httpx.post(url, json={**body, "echo": True}, timeout=30)
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:  # vLLM's message fields of no tool call and no reasoning parser
            assert choice["message"] == {"role": role, "content": echoed + plain["content"], "tool_calls": [],
                                         "reasoning_content": None, "reasoning": None, "refusal": None,
                                         "annotations": None, "audio": None, "function_call": None}, body
        assert r.json()["prompt_logprobs"] is None  # vLLM's, where not asked
        chunks = sse_chunks(url, {**body, "echo": True})
        opening = [(c["choices"][0]["index"], c["choices"][0]["delta"]) for c in chunks
                   if not c["choices"][0]["token_ids"]]  # the chunks of no tokens
        assert opening == [(i, {"role": role, "content": ""}) for i in (0, 1)] + (
            [(i, {"content": echoed}) for i in (0, 1)] if echoed else []), body
        assert chunks[0]["choices"][0]["logprobs"] is None
        text = "".join(c["choices"][0]["delta"]["content"] for c in chunks if c["choices"][0]["index"] == 1)
        assert text == echoed + plain["content"] and plain["role"] == role


def test_request_id_names_the_response(fake_chat_server):
    """vLLM's request_id field is the response's id after its prefix (it was refused as an
    unknown field), streamed chunks' too; its X-Request-Id header wins (it was ignored)."""
    url = fake_chat_server.url + "/v1/completions"
    body = {"prompt": [4], "max_tokens": 2, "request_id": "job-7"}
    answer = httpx.post(url, json=body, timeout=30).json()
    assert answer["id"] == "cmpl-job-7" and answer["choices"][0]["prompt_logprobs"] is None  # vLLM's
    assert {c["id"] for c in sse_chunks(url, body)} == {"cmpl-job-7"}
    headed = httpx.post(url, json=body, headers={"X-Request-Id": "trace-1"}, timeout=30)
    assert headed.json()["id"] == "cmpl-trace-1"  # vLLM's header wins over the field
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "request_id": "job-8"}
    assert httpx.post(fake_chat_server.url + "/v1/chat/completions", json=chat, timeout=30).json()["id"] == (
        "chatcmpl-job-8")


def test_return_token_ids_adds_the_prompts_ids(fake_chat_server):
    """vLLM's return_token_ids (it was an unknown field): each completions choice carries its
    prompt's ids, a chat response carries them at the top; streamed, on each choice's first
    chunk only."""
    url = fake_chat_server.url
    body = {"prompt": [[4, 5], [9]], "max_tokens": 2, "n": 2, "return_token_ids": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=30).json()
    assert [c["prompt_token_ids"] for c in r["choices"]] == [[4, 5], [4, 5], [9], [9]]
    chunks = sse_chunks(url + "/v1/completions", body)
    firsts = [c["choices"][0] for c in chunks if "prompt_token_ids" in c["choices"][0]]
    assert sorted((c["index"], c["prompt_token_ids"]) for c in firsts) == [
        (0, [4, 5]), (1, [4, 5]), (2, [9]), (3, [9])] and len(chunks) == 8
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "return_token_ids": True}
    ids = httpx.post(url + "/tokenize", json=chat, timeout=30).json()["tokens"]
    assert httpx.post(url + "/v1/chat/completions", json=chat, timeout=30).json()["prompt_token_ids"] == ids
    streamed = sse_chunks(url + "/v1/chat/completions", chat)
    assert [c.get("prompt_token_ids") for c in streamed] == [ids, None, None]
    plain = httpx.post(url + "/v1/completions", json={**body, "return_token_ids": False}, timeout=30).json()
    assert plain["choices"][0]["prompt_token_ids"] is None  # vLLM's null where not asked
    # vLLM's fields of what loopjax never returns: null in full responses, left out of chunks (vLLM's)
    nulls = {"service_tier": None, "system_fingerprint": None, "kv_transfer_params": None}
    assert plain.items() >= nulls.items() and plain["usage"]["prompt_tokens_details"] is None
    full_chat = httpx.post(url + "/v1/chat/completions", json={**chat, "return_token_ids": False}, timeout=30)
    assert full_chat.json().items() >= (nulls | {"prompt_token_ids": None}).items()
    assert not any(key in c for c in streamed for key in nulls)
