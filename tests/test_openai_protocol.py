"""OpenAI request parsing (loopjax/openai_protocol.py) as a client sees it: every refused
request is HTTP 400 with OpenAI's error JSON, a one-line message and `param` naming the
field; chat needs a template and text needs a tokenizer."""

from __future__ import annotations

import dataclasses
import json
import re
import types

import httpx
import openai
import pytest
from fake_engine import FakeEngine
from server_helpers import CHATML, MODEL_NAME, LiveServer, word_tokenizer

from loopjax.chat import render_chat
from loopjax.openai_protocol import APIError, RequestParser
from loopjax.sampling_params import SamplingParams
from loopjax.server import create_app


@pytest.mark.parametrize("body, status, param, words", [
    ({"model": "gpt-4", "prompt": [1, 2]}, 404, "model", "'gpt-4' does not exist here"),  # vLLM's 404
    ({"prompt": [5, 6], "max_tokens": -3}, 400, "max_tokens", "max_tokens"),
    ({"prompt": [5, 6], "temperature": 7.5}, 400, "temperature", "temperature"),
    ({"prompt": [5] * 600}, 400, "prompt", "too long"),
    ({"prompt": [5] * 500, "max_tokens": 100}, 400, "max_tokens",
     "max_tokens=100 does not fit: the prompt has 500 tokens of this server's maximum context length of "
     "512 tokens"),  # OpenAI's and vLLM's words, which clients look for
    ({"prompt": [5, 999]}, 400, "prompt", "token ids"),
    ({"prompt": []}, 400, "prompt", "prompt"),
    ({"prompt": [1.5, 2]}, 400, "prompt", "integer token ids"),
    ({"prompt": [5, True]}, 400, "prompt", "integer token ids"),  # JSON true is no token id
    ({"prompt": [-1, 5]}, 400, "prompt", "outside [0,"),
    ({"prompt": [[3], 7]}, 400, "prompt", "prompt must be"),
    ({"prompt": [5], "frobnicate": 1}, 400, "frobnicate", "frobnicate"),
    ({"prompt": [5], "logprobs": 3}, 400, "logprobs", "max_logprobs"),
    ({"prompt": [5], "echo": True, "exit_trace": [1]}, 400, "echo", "exit_trace is not supported with it"),
    ({"prompt": [5], "prompt_logprobs": 21}, 400, "prompt_logprobs", "must be in [0, 20], got 21"),
    ({"prompt": [5], "prompt_logprobs": -1}, 400, "prompt_logprobs", "must be in [0, 20], got -1"),
    ({"prompt": [5], "prompt_logprobs": True}, 400, "prompt_logprobs",
     "prompt_logprobs must be an integer [0, 20], got True"),
    ({"prompt": [5], "prompt_logprobs": 0, "exit_trace": [1]}, 400, "prompt_logprobs",
     "prompt_logprobs scores prompts at a fixed depth or with Ouro's exit gate; "
     "exit_trace is not supported with it"),
    ({"prompt": [5], "exit_min_loops": 2}, 400, "exit_min_loops",  # Ouro's exit would ignore it
     "exit_min_loops and exit_check_every pace the checks of an exit_criterion (Huginn)"),
    ({"prompt": [5], "exit_in_prefill": False}, 400, "exit_in_prefill",  # a field, as vLLM-style extras
     "exit_in_prefill=False keeps an exit_criterion (Huginn) out of the prompt"),
    ({"prompt": [5], "exit_trace": [1, 5]}, 400, "exit_trace", "exit_trace entry 5 exceeds the depth 4"),
    ({"prompt": [5], "logit_bias": {"\u00b2": 1}}, 400, "logit_bias",  # "²" is a digit, not an int
     "logit_bias keys must be token ids (non-negative integers), got '\u00b2'"),
    ({"prompt": [5], "suffix": "the end"}, 400, "suffix", "not supported"),
    ({"prompt": [5], "stream": "yes"}, 400, "stream", "stream must be true or false, got 'yes'"),
    ({"prompt": [5], "stream": True, "stream_options": "yes"}, 400, "stream_options",
     "stream_options must be an object, got 'yes'"),  # was a 500 (AttributeError)
    ({"prompt": [5], "stream_options": {"include_usage": True}}, 400, "stream_options",
     "stream_options is only allowed with stream: true"),  # was ignored
    ({"prompt": [5], "stream": True, "stream_options": []}, 400, "stream_options",
     "stream_options must be an object, got []"),  # an empty one was taken as none
    ({"prompt": [5], "stream": True, "stream_options": {"include_usage": "no"}}, 400, "stream_options",
     "stream_options.include_usage must be true or false, got 'no'"),  # was read as true
    ({"prompt": [5], "echo": "false"}, 400, "echo", "echo must be true or false, got 'false'"),  # echoed
    ({"prompt": [5], "stream": True, "stream_options": {"continuous_usage_stats": 1}}, 400, "stream_options",
     "stream_options.continuous_usage_stats must be true or false, got 1"),  # was ignored
    ({"prompt": [5], "skip_special_tokens": "false"}, 400, "skip_special_tokens",
     "skip_special_tokens must be true or false, got 'false'"),  # was an unknown field
    ({"prompt": [5], "n": 0}, 400, "n", "n must be >= 1, got 0"),
    ({"prompt": [5], "n": 1000}, 400, "n", "n must be in [1, 16] (this server's max_n), got 1000"),
    ({"prompt": [5], "n": "x"}, 400, "n", "n must be an integer >= 1, got 'x'"),
    ({"prompt": [5], "n": 2, "best_of": 3}, 400, "best_of", "best_of must equal n (2)"),
    ({"prompt": [5], "prompt_logprobs": 3}, 400, "prompt_logprobs",  # was not capped by max_logprobs
     "prompt_logprobs must be at most 2 (this server's max_logprobs), got 3"),
    ({"prompt": [5], "use_beam_search": True}, 400, "use_beam_search",  # vLLM's: was "unknown request field"
     "use_beam_search is not supported by this server (beam search)"),
    ({"prompt": [5], "cache_salt": ""}, 400, "cache_salt",  # vLLM's; any salt was refused
     "cache_salt must be a non-empty string (or None), got ''"),
    ({"prompt": [5], "request_id": 7}, 400, "request_id", "request_id must be a non-empty string, got 7"),
    ({"prompt": [5], "user": 7}, 400, "user", "user must be a string, got 7"),  # was ignored
    ({"prompt": [5], "return_tokens_as_token_ids": "yes"}, 400, "return_tokens_as_token_ids",
     "return_tokens_as_token_ids must be true or false, got 'yes'"),
    ({"prompt": [5], "truncate_prompt_tokens": -2}, 400, "truncate_prompt_tokens",
     "truncate_prompt_tokens must be an integer >= 1, or -1 (what the context holds), got -2"),
])
def test_bad_requests_get_400(server, body, status, param, words):
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL_NAME, **body}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"] and err["type"] == "invalid_request_error"
    assert "\n" not in err["message"]


def test_tokenize_and_detokenize(server, client, served_model):
    """/tokenize gives the ids the completions see (text, ids, chat messages: the chat's
    usage counts the same tokens), at any length; /detokenize inverts it; bad bodies are 400
    naming the field."""
    def post(path, body):
        return httpx.post(server.url + path, json={"model": MODEL_NAME, **body}, timeout=30)

    text = "hello world the loop model"
    r = post("/tokenize", {"prompt": text})
    assert r.status_code == 200, r.text
    got = r.json()
    ids = served_model.tokenizer.encode(text, add_special_tokens=False).ids
    assert got == {"count": 5, "max_model_len": 512, "tokens": ids, "token_strs": None}
    assert 0 not in ids  # no <unk>
    strs = post("/tokenize", {"prompt": text, "return_token_strs": True}).json()["token_strs"]  # vLLM's
    assert strs == text.split()
    assert post("/detokenize", {"tokens": ids}).json() == {"prompt": text}
    assert post("/tokenize", {"prompt": [7] * 600}).json()["count"] == 600  # longer than the context
    messages = [{"role": "system", "content": "be the loop"}, {"role": "user", "content": "hello"}]
    chat_ids = post("/tokenize", {"messages": messages}).json()["tokens"]
    assert chat_ids[0] == 1 and chat_ids[-2:] == [1, served_model.tokenizer.token_to_id("assistant")]
    used = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1).usage
    assert used.prompt_tokens == len(chat_ids)
    assert post("/detokenize", {"tokens": chat_ids}).json()["prompt"].startswith("<|im_start|>")
    for path, body, param, words in [
        ("/tokenize", {}, "prompt", "either prompt or messages"),
        ("/tokenize", {"prompt": "hi", "messages": messages}, "prompt", "either prompt or messages"),
        ("/tokenize", {"prompt": ["hello", "world"]}, "prompt", "one text or one list"),
        ("/tokenize", {"prompt": [5, 999]}, "prompt", "token ids outside"),
        ("/tokenize", {"messages": [{"role": 5, "content": "x"}]}, "messages", "role"),
        ("/detokenize", {"tokens": "hello"}, "tokens", "list of integer token ids"),
        ("/detokenize", {"tokens": [5, 999]}, "tokens", "token ids outside"),
        ("/detokenize", {"tokens": [5, 1.5]}, "tokens", "integer token ids"),
        ("/tokenize", {"model": "gpt-4", "prompt": "hi"}, "model", "gpt-4"),
    ]:
        r = post(path, body)
        err = r.json()["error"]
        assert r.status_code == (404 if param == "model" else 400), (path, body, err)
        assert err["param"] == param and words in err["message"], (path, body, err)
    assert post("/detokenize", {"tokens": []}).json() == {"prompt": ""}


def test_malformed_json_and_chat_errors(server, client):
    r = httpx.post(server.url + "/v1/completions", content=b"{not json",
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"content": "x"}])
    with pytest.raises(openai.NotFoundError, match="gpt-4"):  # vLLM's 404
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    # ... and the server keeps serving.
    assert client.completions.create(model=MODEL_NAME, prompt=[5, 6], max_tokens=2).usage.total_tokens >= 3
    assert httpx.get(server.url + "/health", timeout=10).json() == {"status": "ok"}


def test_body_that_is_not_a_json_object_is_400(server, client):
    for raw, expect in ((b"[1, 2]", "the request body must be a JSON object, got list"),
                        (b'"hello"', "the request body must be a JSON object, got str"),
                        (b'{"prompt": "\xff"}', "malformed JSON body: 'utf-8' codec can't decode"),
                        (b'{"prompt": ' + b"[" * 10**5 + b"]" * 10**5 + b"}",  # was a 500 (RecursionError)
                         "malformed JSON body: nested too deeply")):
        r = httpx.post(server.url + "/v1/completions", content=raw,
                       headers={"content-type": "application/json"}, timeout=30)
        message = r.json()["error"]["message"]
        assert r.status_code == 400 and message.startswith(expect) and "\n" not in message, message
    # ... and the server keeps serving.
    assert client.completions.create(model=MODEL_NAME, prompt=[5, 6], max_tokens=2).usage.prompt_tokens == 2


def test_a_lone_surrogate_escape_is_400_naming_its_field():
    """JSON's unpaired \\ud800 escape parses to a str no tokenizer takes: it was a 500 (TypeError
    from the tokenizer, the connection closed after it); a 400 naming the field now. A pair (an
    escaped emoji) is text."""
    parser = RequestParser(MODEL_NAME)
    for raw, param in ((rb'{"prompt": "hi \ud800"}', "prompt"), (rb'{"stop": ["\uDC00"]}', "stop"),
                       (rb'{"messages": [{"role": "user", "content": "\udfff x"}]}', "messages"),
                       (rb'{"\ud800": 1}', None)):
        with pytest.raises(APIError) as refused:
            parser.body(raw)
        assert (refused.value.status, refused.value.param) == (400, param), raw
        assert "lone UTF-16 surrogate" in refused.value.message, refused.value.message
    assert parser.body(rb'{"prompt": "\ud83d\ude00 \\ud800"}')["prompt"] == "\U0001f600 \\ud800"


@pytest.mark.parametrize("extra, param, message", [
    ({"messages": [{"role": "user", "content": "hello " * 600}]}, "messages",
     "messages is too long: 605 tokens for this server's maximum context length of 512 tokens"),
    ({"logprobs": True, "top_logprobs": 3}, "top_logprobs",
     "top_logprobs must be at most 2 (this server's max_logprobs), got 3"),
    ({"logprobs": True, "top_logprobs": 1, "temperature": -1}, "temperature", "temperature"),
    ({"logprobs": 3}, "logprobs", "logprobs must be true or false on /v1/chat/completions (top_logprobs is "
     "the count), got 3"),  # was taken as top-3
    ({"logprobs": "true"}, "logprobs", "logprobs must be true or false"),
    ({"prompt_logprobs": 3}, "prompt_logprobs",  # was not capped
     "prompt_logprobs must be at most 2 (this server's max_logprobs), got 3"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages",
     "messages[0] must have a role"),  # content parts whose text is not text: was a 500 (TypeError)
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                                {"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages", "messages[0] has a content part of type 'image_url'; this model takes text only"),
    # ... it was dropped: the model answered without the image it was asked about
    ({"messages": [{"role": "user", "content": ["hello", 5]}]}, "messages", "messages[0] must have a role"),
    ({"prompt_logprobs": 21}, "prompt_logprobs", "prompt_logprobs must be in [0, 20], got 21"),
])
def test_bad_chat_requests_get_400(server, extra, param, message):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hello"}], **extra}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"] and "\n" not in err["message"]


def test_truncate_prompt_tokens_keeps_the_last_tokens_before_the_length_check():
    """vLLM's truncate_prompt_tokens: each prompt (or rendered chat) keeps its last k tokens, so
    a prompt past the context is served; /tokenize is not cut; a bad value is a 400 naming it."""
    parser = RequestParser(MODEL_NAME, vocab_size=256, max_context=16)
    long_prompt = list(range(1, 40))
    body = {"prompt": [long_prompt, [7, 8]], "truncate_prompt_tokens": 5}
    assert parser.prompts(body, False) == [long_prompt[-5:], [7, 8]]
    assert SamplingParams.from_openai(body).truncate_prompt_tokens == 5
    with pytest.raises(APIError, match="prompt is too long: 39 tokens"):
        parser.prompts({"prompt": long_prompt}, False)
    assert parser.tokenize({"prompt": long_prompt, "truncate_prompt_tokens": 5}) == long_prompt
    for bad in (0, 2.5, "5", True, -2, -1.0):
        with pytest.raises(APIError, match=r"^truncate_prompt_tokens must be") as err:
            parser.prompts({"prompt": [1, 2], "truncate_prompt_tokens": bad}, False)
        assert err.value.param == "truncate_prompt_tokens" and err.value.status == 400
    assert parser.prompts({"prompt": [1, 2], "truncate_prompt_tokens": 16}, False) == [[1, 2]]
    with pytest.raises(APIError, match=r"^truncate_prompt_tokens=17 exceeds this server's maximum context "
                                       r"length of 16 tokens$"):
        parser.prompts({"prompt": [1, 2], "truncate_prompt_tokens": 17}, False)  # vLLM's 400: it was served


def test_truncate_prompt_tokens_minus_one_keeps_what_the_context_holds():
    """vLLM's truncate_prompt_tokens=-1 (it was refused): each prompt keeps the last tokens the
    context holds with room for the max_tokens asked (for one token when none is); the engine
    and echo get that count."""
    parser = RequestParser(MODEL_NAME, vocab_size=256, max_context=16)
    long_prompt = list(range(1, 40))
    body = {"prompt": [long_prompt, [7, 8]], "truncate_prompt_tokens": -1}
    prompts = parser.prompts(body, False)
    assert prompts == [long_prompt[-15:], [7, 8]] and body["truncate_prompt_tokens"] == 15
    params = parser.sampling(body, False, prompts)
    assert (params.truncate_prompt_tokens, params.max_tokens) == (15, 1)
    for asked in ({"max_tokens": 4}, {"max_completion_tokens": 4}):
        assert parser.prompts({"prompt": long_prompt, "truncate_prompt_tokens": -1, **asked}, False) == [
            long_prompt[-12:]]
    chat = RequestParser(MODEL_NAME, tokenizer=word_tokenizer(256), chat_template=CHATML, max_context=16)
    messages = [{"role": "user", "content": "hello " * 30}]
    assert len(chat.prompts({"messages": messages, "truncate_prompt_tokens": -1}, True)[0]) == 15
    unbounded = {"prompt": long_prompt, "truncate_prompt_tokens": -1}  # no context known: no cut
    assert RequestParser(MODEL_NAME).prompts(unbounded, False) == [long_prompt]
    assert SamplingParams.from_openai(unbounded).truncate_prompt_tokens is None


def test_null_max_tokens_is_the_default():
    """An explicit null max_tokens (or max_completion_tokens) is the endpoint's default, as
    current vLLM's (its normalize_null_max_tokens): completions' 16 (it was the room the longest
    prompt leaves, as older vLLM's), chat's the room."""
    parser = RequestParser(MODEL_NAME, max_context=64)
    prompts = [[5] * 10, [5] * 4]
    for field in ("max_tokens", "max_completion_tokens"):
        assert parser.sampling({field: None}, False, prompts).max_tokens == 16
        assert parser.sampling({field: None}, True, prompts[:1]).max_tokens == 54
    assert parser.sampling({}, False, prompts).max_tokens == 16
    assert parser.sampling({}, True, prompts).max_tokens == 54
    assert parser.sampling({"max_tokens": None, "max_completion_tokens": 5}, False, prompts).max_tokens == 5
    # both given: max_completion_tokens wins, as vLLM's (a 400 when they differed)
    assert parser.sampling({"max_tokens": 3, "max_completion_tokens": 5}, True, prompts).max_tokens == 5
    with pytest.raises(APIError, match="^max_completion_tokens=60 does not fit") as err:
        parser.sampling({"max_tokens": 3, "max_completion_tokens": 60}, True, prompts)
    assert err.value.param == "max_completion_tokens"
    # max_completion_tokens 0 asks nothing (vLLM's `max_completion_tokens or max_tokens`; it was a 400)
    zero = parser.body(b'{"max_tokens": 3, "max_completion_tokens": 0}')
    assert parser.sampling(zero, True, prompts).max_tokens == 3
    assert parser.sampling(parser.body(b'{"max_completion_tokens": 0}'), False, prompts).max_tokens == 16


def test_vllms_fields_at_their_defaults_are_served():
    """vLLM's extra fields for what loopjax does not do are served at the values that ask for
    nothing, as clients send them by default (they were "unknown request field" 400s)."""
    parser = RequestParser(MODEL_NAME, max_context=64)
    defaults = {"use_beam_search": False, "length_penalty": 1.0, "priority": 0,
                "return_tokens_as_token_ids": False, "include_reasoning": True, "mm_processor_kwargs": {},
                "vllm_xargs": {}, "documents": [], "request_id": "mine", "kv_transfer_params": None,
                # OpenAI's newer fields (vLLM ignores them; they were "unknown request field")
                "modalities": ["text"], "verbosity": "medium", "prompt_cache_key": "k",
                "safety_identifier": "s"}
    assert parser.sampling(parser.body(json.dumps(defaults).encode()), True, [[5]]).max_tokens == 63
    assert parser.sampling({"length_penalty": 1}, False, [[5]]).max_tokens == 16  # JSON's 1 is 1.0
    assert parser.sampling({"priority": 0.0}, False, [[5]]).max_tokens == 16  # vLLM's int: 0.0 is 0
    # ... of their type: these compared equal to the defaults and were taken as them
    for field, value in (("priority", False), ("use_beam_search", 0), ("parallel_tool_calls", 1),
                         ("priority", 0.5), ("modalities", ["text", "audio"]), ("prediction", {"a": 1})):
        with pytest.raises(APIError, match=rf"^{field} is not supported by this server") as err:
            parser.sampling({field: value}, False, [[5]])
        assert err.value.param == field


def test_vllms_extension_fields_and_reasoning_effort_are_served_as_vllms():
    """vllm_xargs and kv_transfer_params (refused by name) are accepted as a vLLM server without
    plugins or KV connectors takes them (no effect), of vLLM's types; reasoning_effort (refused)
    is chat's template variable, with enable_thinking false for "none" unless chat_template_kwargs
    sets it, as vLLM's; functions (vLLM drops it: the model would answer without the functions)
    stays refused."""
    parser = RequestParser(MODEL_NAME, tokenizer=word_tokenizer(256), chat_template=CHATML, max_context=64)
    sent = {"vllm_xargs": {"a": 1, "b": ["x", 2.5]}, "kv_transfer_params": {"do_remote_prefill": False},
            # vLLM's newer fields of no effect here (they were "unknown request field")
            "ec_transfer_params": {}, "session_id": "s", "stream_interval": 4, "return_token_offsets": True,
            "truncation_side": "left", "watermarking": False, "return_prompt_text": False}
    assert parser.sampling(parser.body(json.dumps(sent).encode()), False, [[5]]).max_tokens == 16
    for field, value, words in (("vllm_xargs", [1], "vllm_xargs must be an object of strings, numbers"),
                                ("vllm_xargs", {"a": {"b": 1}}, "vllm_xargs must be an object"),
                                ("kv_transfer_params", "x", "kv_transfer_params must be an object, got 'x'"),
                                ("stream_interval", 0, "stream_interval must be an integer >= 1, got 0"),
                                ("session_id", 5, "session_id must be a string, got 5")):
        with pytest.raises(APIError, match=f"^{words}") as err:
            parser.body(json.dumps({field: value}).encode())
        assert err.value.param == field
    talk = [{"role": "user", "content": "hi"}]
    assert parser._template({"messages": talk, "reasoning_effort": "none"})[1] == {
        "reasoning_effort": "none", "enable_thinking": False}
    assert parser._template({"reasoning_effort": "high"})[1]["enable_thinking"] is True
    kept = {"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}}
    assert parser._template(kept)[1] == {"reasoning_effort": "none", "enable_thinking": True}
    assert parser.sampling({"reasoning_effort": "low"}, True, [[5]]).max_tokens == 63
    with pytest.raises(APIError, match=r"^reasoning_effort must be one of none, minimal, low") as err:
        parser.prompts({"messages": talk, "reasoning_effort": "extreme"}, chat=True)
    assert err.value.param == "reasoning_effort"
    with pytest.raises(APIError, match=r"^reasoning_effort applies to /v1/chat/completions only$"):
        parser.prompts({"prompt": [5], "reasoning_effort": "low"}, chat=False)
    for field, value in (("functions", [{"name": "f"}]), ("truncation_side", "right"), ("watermarking", True),
                         ("logprob_token_ids", [5])):
        with pytest.raises(APIError, match=rf"^{field} is not supported by this server \("):
            parser.sampling({field: value}, True, [[5]])


def test_chat_logprobs_is_a_switch():
    """Chat's logprobs is true / false (0 / 1 too, as vLLM's pydantic reads them) and
    top_logprobs the count; top_logprobs 0 needs no logprobs (vLLM's); completions' logprobs is
    the count (true / false: 1 / 0, as vLLM's pydantic reads them)."""
    parser = RequestParser(MODEL_NAME, max_context=64, max_logprobs=5)
    for body, want in (({"logprobs": 1}, 0), ({"logprobs": 0}, None),
                       ({"logprobs": True, "top_logprobs": 2}, 2),
                       ({"logprobs": 1, "top_logprobs": 2}, 2), ({"top_logprobs": 0}, None),
                       ({"logprobs": False, "top_logprobs": 0}, None)):
        assert parser.sampling(body, True, [[5]]).logprobs == want, body
    assert parser.sampling({"logprobs": 3}, False, [[5]]).logprobs == 3
    # completions' true / false are vLLM's pydantic 1 / 0 (true was a 400)
    assert [parser.sampling({"logprobs": v}, False, [[5]]).logprobs for v in (True, False)] == [1, 0]
    for bad in ({"logprobs": 2}, {"logprobs": 1.0}, {"logprobs": False, "top_logprobs": 1}):
        with pytest.raises(APIError, match="logprobs") as err:
            parser.sampling(bad, True, [[5]])
        assert err.value.status == 400 and err.value.param in ("logprobs", "top_logprobs")


def test_default_max_tokens_is_cut_to_the_context():
    """Only a max_tokens the request sets is refused when it does not fit; the default (16 for
    completions) is cut to the room left after the longest prompt."""
    parser = RequestParser(MODEL_NAME, max_context=512)
    long_prompt = [[5] * 505, [5] * 10]
    assert parser.sampling({"prompt": long_prompt}, False, long_prompt).max_tokens == 7
    assert parser.sampling({"prompt": [[5] * 10]}, False, [[5] * 10]).max_tokens == 16
    with pytest.raises(APIError, match="max_completion_tokens=8 does not fit"):
        parser.sampling({"max_completion_tokens": 8}, True, long_prompt[:1])
    # chat's default max_tokens is the room left: a min_tokens past it names the room, not a
    # max_tokens the client never sent
    with pytest.raises(APIError, match=r"^min_tokens=8 does not fit: the prompt leaves 7 tokens of this "
                                       r"server's maximum context length of 512 tokens$"):
        parser.sampling({"min_tokens": 8}, True, long_prompt[:1])
    assert parser.sampling({"min_tokens": 7}, True, long_prompt[:1]).max_tokens == 7


def test_chat_without_template_is_400():
    bare = types.SimpleNamespace(tokenizer=None, chat_template=None,
                                 cfg=types.SimpleNamespace(vocab_size=256, max_context_len=512))
    with LiveServer(create_app(FakeEngine(), MODEL_NAME, model=bare)) as live:
        r = httpx.post(live.url + "/v1/chat/completions", timeout=30,
                       json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]
        r = httpx.post(live.url + "/v1/completions", timeout=30, json={"model": MODEL_NAME, "prompt": "hi"})
        assert r.status_code == 400 and "no tokenizer" in r.json()["error"]["message"]
        r = httpx.post(live.url + "/v1/completions", timeout=30, json={"prompt": [4, 5], "max_tokens": 3})
        assert r.json()["choices"][0]["token_ids"] == [6, 7, 8]  # the fake engine counts up
        r = httpx.post(live.url + "/v1/completions", timeout=30, json={"prompt": [4, 5], "stop": ["x"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text
        assert "stop strings need a tokenizer" in r.json()["error"]["message"]
        r = httpx.post(live.url + "/v1/completions", timeout=30, json={"prompt": [4, 5], "echo": True})
        assert r.status_code == 400 and "echo is not supported by this server" in r.json()["error"]["message"]
        r = httpx.post(live.url + "/v1/completions", timeout=30, json={"prompt": [4], "prompt_logprobs": 0})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "prompt_logprobs", r.text
        assert err["message"] == ("prompt_logprobs is not supported by this server (its prompts cannot be "
                                  "scored)")
        r = httpx.post(live.url + "/detokenize", timeout=30, json={"tokens": [4, 5]})
        assert r.status_code == 400 and "no tokenizer" in r.json()["error"]["message"]
        r = httpx.post(live.url + "/tokenize", timeout=30, json={"prompt": [4, 5]})
        assert r.json() == {"count": 2, "max_model_len": 512, "tokens": [4, 5], "token_strs": None}
        r = httpx.post(live.url + "/tokenize", timeout=30, json={"prompt": [4, 5], "return_token_strs": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "return_token_strs", r.text
    # vLLM's --chat-template: the server's own template serves a checkpoint that has none
    tok = word_tokenizer(256)
    untemplated = types.SimpleNamespace(**{**vars(bare), "tokenizer": tok})
    app = create_app(FakeEngine(), MODEL_NAME, model=untemplated, chat_template="{{ messages[0].content }}")
    with LiveServer(app) as live:
        talk = {"messages": [{"role": "user", "content": "loop"}]}
        r = httpx.post(live.url + "/tokenize", timeout=30, json=talk)
        assert r.json()["tokens"] == tok.encode("loop", add_special_tokens=False).ids, r.text


def test_a_chat_template_that_raises_is_400(caplog):
    """Whatever the checkpoint's template raises while rendering (its raise_exception, a Jinja
    error, or a Python error of its own code such as a TypeError) is a 400 naming messages and
    the cause, on chat and /tokenize (a TypeError or ZeroDivisionError was a 500). As vLLM's
    start-up warm-up, a template that fails on a one-message probe is one warning at start (it
    was silent until a request came); the server serves on."""
    from server_helpers import word_tokenizer

    model = types.SimpleNamespace(tokenizer=word_tokenizer(256), chat_template=None,
                                  cfg=types.SimpleNamespace(vocab_size=256, max_context_len=512))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    for template, cause in (("{{ raise_exception('no system role') }}", "no system role"),
                            ("{{ messages[0]['content'] + 1 }}", "TypeError: can only concatenate str"),
                            ("{{ 1 / (messages | length - 2) }}", "ZeroDivisionError: division by zero"),
                            ("{{ messages[1].content.nope() }}", "no attribute 'nope'")):
        model.chat_template = template
        caplog.clear()
        with caplog.at_level("WARNING", "loopjax.server"):
            app = create_app(FakeEngine(), MODEL_NAME, model=model)
        warned = [r.getMessage() for r in caplog.records if "probe conversation" in r.getMessage()]
        # NOTE: the probe has one message: 1 / (1 - 2) renders
        assert len(warned) == (template != "{{ 1 / (messages | length - 2) }}"), (template, warned)
        assert all("messages: the chat template" in w and "\n" not in w for w in warned)
        with LiveServer(app) as live:
            for path in ("/v1/chat/completions", "/tokenize"):
                r = httpx.post(live.url + path, timeout=30, json={"model": MODEL_NAME, "messages": messages})
                err = r.json()["error"]
                assert r.status_code == 400 and err["param"] == "messages", (template, path, r.text)
                assert err["message"].startswith("messages: the chat template") and cause in err["message"]


def test_chat_template_renders_as_transformers_does():
    """HF's apply_chat_template environment: the loopcontrols extension ({% break %},
    {% continue %}), a tojson that keeps non-ASCII and <, > as they are, strftime_now, its
    {% generation %} blocks (rendered as their body; they were a 400 "unknown tag") and its
    tools and documents variables (None; they were undefined, so `tools is none` was false)."""
    messages = [{"role": "system", "content": "<é>"}, {"role": "user", "content": "hi"},
                {"role": "user", "content": "again"}]
    skip_system = ("{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
                   "{{ m.content }};{% if loop.index == 2 %}{% break %}{% endif %}{% endfor %}")
    assert render_chat(skip_system, messages) == "hi;"
    assert render_chat("{{ messages[0].content | tojson }}", messages) == '"<é>"'
    assert render_chat("{{ strftime_now('%Y') | length }}", messages) == "4"
    marked = "{% for m in messages %}{% generation %}{{ m.content }};{% endgeneration %}{% endfor %}"
    assert render_chat(marked, messages) == "<é>;hi;again;"
    assert render_chat("{{ tools is none }} {{ documents is none }}", messages) == "True True"


def test_chat_special_tokens_follow_special_tokens_map_json(tmp_path):
    """transformers reads the special tokens from special_tokens_map.json too (over
    tokenizer_config.json's); a template's {{ bos_token }} rendered '' when only the map named it.
    Templates get every named special token and additional_special_tokens, as transformers'
    special_tokens_map (they got bos_token and eos_token only: {{ pad_token }} rendered '')."""
    from types import SimpleNamespace

    from loopjax.chat import special_tokens

    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "</s>", "pad_token": {"content": "<pad>"}, "additional_special_tokens": ["<a>"]}))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>", "unk_token": "<unk>"}))
    found = special_tokens(SimpleNamespace(path=str(tmp_path)))
    assert found == {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
                     "additional_special_tokens": ["<a>"]}
    messages = [{"role": "user", "content": "hi"}]
    template = ("{{ bos_token }}|{{ pad_token }}|{{ unk_token }}|{{ additional_special_tokens[0] }}|"
                "{{ eos_token }}")
    assert render_chat(template, messages, special=found) == "<s>|<pad>|<unk>|<a>|</s>"
    kwargs = {"pad_token": "P"}  # a chat_template_kwargs variable wins, as transformers' kwargs
    assert render_chat(template, messages, special=found, template_kwargs=kwargs) == "<s>|P|<unk>|<a>|</s>"
    (tmp_path / "special_tokens_map.json").unlink()
    assert special_tokens(SimpleNamespace(path=str(tmp_path)))["eos_token"] == "</s>"
    assert render_chat("[{{ bos_token + eos_token }}]", messages, special={}) == "[]"  # '' where unset


def bos_tokenizer():
    """The word tokenizer with a post-processor that puts <|im_start|> (id 1) before a text, as
    a Llama-style tokenizer adds its BOS."""
    from server_helpers import word_tokenizer
    from tokenizers import processors

    tok = word_tokenizer(256)
    tok.post_processor = processors.TemplateProcessing(single="<|im_start|> $A",
                                                       special_tokens=[("<|im_start|>", 1)])
    return tok


def test_text_prompts_get_the_tokenizers_special_tokens_chat_text_does_not():
    """A text prompt is encoded as vLLM and HF's tokenizer(text) encode it: the tokenizer's own
    BOS first; chat messages rendered by the template get none (the template writes them);
    vLLM's add_special_tokens field overrides either (it was always off: a Llama-style
    tokenizer's BOS was missing from every text prompt)."""
    tok = bos_tokenizer()
    plain = tok.encode("hello world", add_special_tokens=False).ids
    parser = RequestParser(MODEL_NAME, tokenizer=tok, chat_template="{{ messages[0]['content'] }}")
    messages = [{"role": "user", "content": "hello world"}]
    assert parser.prompts({"prompt": "hello world"}, chat=False) == [[1] + plain]
    assert parser.prompts({"prompt": ["hello", "world"]}, chat=False)[1][0] == 1
    assert parser.tokenize({"prompt": "hello world"}) == [1] + plain
    assert parser.prompts({"messages": messages}, chat=True) == [plain]
    assert parser.tokenize({"messages": messages}) == plain
    assert parser.prompts({"prompt": "hello world", "add_special_tokens": False}, chat=False) == [plain]
    assert parser.prompts({"messages": messages, "add_special_tokens": True}, chat=True) == [[1] + plain]
    with pytest.raises(APIError, match="add_special_tokens must be true or false"):
        parser.prompts({"prompt": "hi", "add_special_tokens": "no"}, chat=False)
    assert parser.sampling({"prompt": "hi", "add_special_tokens": True}, False, [[1, 4]]).max_tokens == 16


def test_chat_content_parts_are_joined_by_newlines():
    """A message's text content parts are its content one per line, as vLLM joins them (they
    were joined with nothing: "hello" + "world" made one word)."""
    parser = RequestParser(MODEL_NAME, tokenizer=word_tokenizer(256),
                           chat_template="{{ messages[0]['content'] }}")
    parts = [{"type": "text", "text": "hello"}, {"type": "input_text", "text": "world"}]
    as_parts = parser.tokenize({"messages": [{"role": "user", "content": parts}]})
    assert as_parts == parser.tokenize({"messages": [{"role": "user", "content": "hello\nworld"}]})
    assert as_parts == [3, 4] != parser.tokenize({"messages": [{"role": "user", "content": "helloworld"}]})
    # ... plain strings among them too (vLLM's; they were refused)
    assert parser.tokenize({"messages": [{"role": "user", "content": ["hello", parts[1]]}]}) == as_parts
    # ... and a text part of null or no text is skipped, as vLLM's (a null one was refused)
    skipped = [parts[0], {"type": "text", "text": None}, {"type": "text"}, parts[1]]
    assert parser.tokenize({"messages": [{"role": "user", "content": skipped}]}) == as_parts


def test_chat_template_kwargs_and_add_generation_prompt():
    """vLLM's chat request fields: chat_template_kwargs are more template variables (e.g. a
    thinking switch), add_generation_prompt false leaves the assistant's turn unopened; bad
    values, the renderer's own names, or either field on completions are 400s naming it."""
    from server_helpers import word_tokenizer

    template = ("{% for m in messages %}{{ m.content }} {% endfor %}{% if think %}loop {% endif %}"
                "{% if add_generation_prompt %}world{% endif %}")
    tok = word_tokenizer(256)
    parser = RequestParser(MODEL_NAME, tokenizer=tok, chat_template=template)
    body = {"messages": [{"role": "user", "content": "hello"}]}
    ids = lambda text: tok.encode(text, add_special_tokens=False).ids  # noqa: E731
    assert parser.prompts(body, chat=True) == [ids("hello world")]
    thinking = {**body, "chat_template_kwargs": {"think": True}}
    assert parser.prompts(thinking, chat=True) == [ids("hello loop world")]
    assert parser.prompts({**body, "add_generation_prompt": False}, chat=True) == [ids("hello")]
    # no context known: until done
    assert parser.sampling({**body, "chat_template_kwargs": {"think": True}}, True, [[4]]).max_tokens is None
    for bad, param, message in (
            ({"chat_template_kwargs": ["think"]}, "chat_template_kwargs", "must be an object of template"),
            ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "may not set messages"),
            ({"add_generation_prompt": "yes"}, "add_generation_prompt", "must be true or false")):
        with pytest.raises(APIError, match=message) as err:
            parser.prompts({**body, **bad}, chat=True)
        assert err.value.param == param and err.value.status == 400
    with pytest.raises(APIError, match="^add_generation_prompt applies to /v1/chat/completions only$"):
        parser.prompts({"prompt": "hello", "add_generation_prompt": False}, chat=False)
    # continue_final_message: the last message left open (its turn's closing text cut off)
    chatml = parser.__class__(MODEL_NAME, tokenizer=tok, chat_template=(
        "{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|>{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}"))
    talk = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "the loop "}]
    cont = chatml.prompts({"messages": talk, "continue_final_message": True}, chat=True)[0]
    assert cont == ids("<|im_start|>user hello<|im_end|><|im_start|>assistant the loop")
    # an empty final message: the whole rendered text, its turn closed (transformers', vLLM's; was a 400)
    empty = [talk[0], {"role": "assistant", "content": ""}]
    assert chatml.prompts({"messages": empty, "continue_final_message": True}, chat=True)[0] == ids(
        "<|im_start|>user hello<|im_end|><|im_start|>assistant <|im_end|>")
    with pytest.raises(APIError, match="exclude each other") as err:
        chatml.prompts({"messages": talk, "continue_final_message": True, "add_generation_prompt": True},
                       chat=True)
    assert err.value.param == "continue_final_message"
    with pytest.raises(APIError, match="continue_final_message needs the final message's text"):
        parser.__class__(MODEL_NAME, tokenizer=tok, chat_template="{{ messages[0].content }}").prompts(
            {"messages": talk, "continue_final_message": True}, chat=True)


def test_any_role_and_null_content_render_as_vllms():
    """vLLM's messages: any role (its custom roles; OpenAI's deprecated "function" was refused)
    goes to the template; null or absent content (an assistant's tool-call turn) is ""."""
    parser = RequestParser(MODEL_NAME, tokenizer=word_tokenizer(256), chat_template=CHATML)
    said = parser.tokenize({"messages": [{"role": "function", "name": "f", "content": "hello"},
                                         {"role": "assistant", "content": None}, {"role": "model"}]})
    assert parser.tokenizer.decode(said, skip_special_tokens=False).split() == [
        "<|im_start|>", "<unk>", "hello", "<|im_end|>",  # "function" is no word of the tokenizer
        "<|im_start|>", "assistant", "<|im_end|>",
        "<|im_start|>", "model", "<|im_end|>", "<|im_start|>", "assistant"]
    for bad in ({"role": 5, "content": "x"}, {"content": "x"}, {"role": "user", "content": 5}):
        with pytest.raises(APIError, match=r"^messages\[0\] must have a role \(a string\)"):
            parser.tokenize({"messages": [bad]})
    # LLM.chat's rendering (encode_chat) takes the same messages through the same check
    from loopjax.chat import encode_chat

    tok = parser.tokenizer

    def tokenize(text, add_special_tokens):
        return tok.encode(text, add_special_tokens=add_special_tokens).ids
    model = types.SimpleNamespace(tokenizer=tok, chat_template=CHATML, path=None, tokenize=tokenize)
    bare = [{"role": "user"}, {"role": "assistant", "content": None}]
    assert encode_chat(model, bare) == parser.tokenize({"messages": bare})
    with pytest.raises(ValueError, match=r"^messages\[0\] must have a role \(a string\)"):
        encode_chat(model, [{"content": "x"}])


def test_a_requests_chat_template_needs_the_servers_trust():
    """vLLM's chat_template field (it was refused as unsupported): the request's jinja2 template
    (or chat_template_kwargs' chat_template, which wins) renders its messages where the server
    trusts request templates (--trust-request-chat-template), a 400 naming the flag otherwise;
    an empty one is the model's; checked as the model's is, a bad one a 400 naming the field."""
    talk = {"messages": [{"role": "user", "content": "hello"}]}
    own = "{{ messages[0]['content'] }} loop"
    untrusted = RequestParser(MODEL_NAME, tokenizer=word_tokenizer(256), chat_template=CHATML)
    for sent in ({"chat_template": own}, {"chat_template_kwargs": {"chat_template": own}}):
        with pytest.raises(APIError, match=r"^a request's chat_template needs a server started with "
                                           r"--trust-request-chat-template \(as vLLM's\)$") as err:
            untrusted.prompts({**talk, **sent}, True)
        assert err.value.param == "chat_template"
    trusted = RequestParser(MODEL_NAME, tokenizer=word_tokenizer(256), trust_request_chat_template=True)
    tok = trusted.tokenizer
    assert trusted.prompts({**talk, "chat_template": own}, True) == [tok.encode("hello loop").ids]
    wins = {"chat_template": "{{ x }}", "chat_template_kwargs": {"chat_template": own, "x": "model"}}
    assert trusted.tokenize({**talk, **wins}) == tok.encode("hello loop").ids
    modelled = dataclasses.replace(trusted, chat_template=own + " model")
    assert modelled.tokenize({**talk, "chat_template": ""}) == tok.encode("hello loop model").ids
    for template, message in (
            ("{% if %}", r"^chat_template is not a jinja2 template: TemplateSyntaxError: "),
            (5, r"^chat_template must be a string \(a jinja2 chat template\), got 5$"),
            ("{{ raise_exception('no users') }}", r"^messages: the chat template refused them: no users$")):
        with pytest.raises(APIError, match=message) as err:
            trusted.prompts({**talk, "chat_template": template}, True)
        assert err.value.param == "chat_template" and err.value.status == 400
    with pytest.raises(APIError, match=r"^chat_template applies to /v1/chat/completions only$"):
        trusted.prompts({"prompt": "hello", "chat_template": own}, False)


def test_echo_asks_prompt_logprobs_as_vllms():
    """vLLM's echo sets prompt_logprobs when the request does not: completions' logprobs (none
    without them), chat's top_logprobs (0 without them; chat's echo asked none); not streamed
    (vLLM's stream sends none); a chat this server cannot score echoes its text alone."""
    parser = RequestParser(MODEL_NAME, max_context=64, max_logprobs=5, echo_state=None)
    for body, chat, want in (({}, True, 0), ({"logprobs": True, "top_logprobs": 2}, True, 2),
                             ({"prompt_logprobs": 1, "logprobs": True, "top_logprobs": 2}, True, 1),
                             ({"stream": True}, True, None), ({"exit_trace": [1]}, True, None),
                             ({"logprobs": 2}, False, 2), ({}, False, None), ({"logprobs": 0}, False, 0)):
        assert parser.sampling({**body, "echo": True}, chat, [[5]]).prompt_logprobs == want, body
        assert parser.sampling(body, chat, [[5]]).prompt_logprobs == body.get("prompt_logprobs"), body
    unscored = dataclasses.replace(parser, echo_state="unsupported")
    assert unscored.sampling({"echo": True, "logprobs": True}, True, [[5]]).prompt_logprobs is None


def test_documents_reach_the_chat_template():
    """vLLM's documents (it was refused unless []) are the template's `documents` variable, as
    RAG templates read them; anything but a list of objects of strings is a 400 naming it;
    include_reasoning false (no reasoning parser here, as vLLM without one) is served."""
    rag = "{% for d in documents %}{{ d.title }} {% endfor %}{{ messages[0]['content'] }}"
    parser = RequestParser(MODEL_NAME, tokenizer=word_tokenizer(256), chat_template=rag)
    talk = {"messages": [{"role": "user", "content": "hello"}]}
    docs = [{"title": "loop", "text": "x"}, {"title": "model"}]
    assert parser.tokenize({**talk, "documents": docs}) == parser.tokenizer.encode("loop model hello").ids
    assert parser.sampling({**talk, "documents": docs, "include_reasoning": False}, True, [[5]]).n == 1
    for bad in ([{"title": 5}], {"title": "x"}, ["x"]):
        with pytest.raises(APIError, match=r"^documents must be a list of objects of strings") as err:
            parser.tokenize({**talk, "documents": bad})
        assert err.value.param == "documents"
    with pytest.raises(APIError, match=r"^documents applies to /v1/chat/completions only$"):
        parser.prompts({"prompt": "hello", "documents": docs}, False)


def test_tool_call_turns_reach_the_template_with_parsed_arguments():
    """An assistant's tool-call turn (null content: it was refused) reaches the template with
    each call's JSON arguments parsed into an object, as vLLM passes them (a template's tojson
    would encode the string twice); arguments that are not JSON are a 400 naming messages."""
    template = ("{% for c in messages[0].tool_calls %}{{ c.function.name }} {{ c.function.arguments.city }}"
                "{% endfor %}")
    parser = RequestParser(MODEL_NAME, tokenizer=word_tokenizer(256), chat_template=template)
    call = {"id": "c1", "type": "function", "function": {"name": "hello", "arguments": '{"city": "world"}'}}
    turn = {"role": "assistant", "content": None, "tool_calls": [call]}
    assert parser.tokenize({"messages": [turn]}) == parser.tokenizer.encode("hello world").ids
    assert call["function"]["arguments"] == '{"city": "world"}'  # the request is not changed
    bad = {**turn, "tool_calls": [{**call, "function": {"name": "f", "arguments": "{city"}}]}
    with pytest.raises(APIError, match=r"^messages\[0\] has tool call arguments that are not JSON: "
                                       r"'\{city'$"):
        parser.tokenize({"messages": [bad]})


def test_more_served_model_names_are_aliases():
    """vLLM's --served-model-name takes several names (one was all): a request may send any,
    /v1/models lists a card for each, responses carry the first; another name is a 404."""
    app = create_app(FakeEngine(), MODEL_NAME, model_aliases=("loop",))
    with LiveServer(app) as live:
        assert [m["id"] for m in httpx.get(live.url + "/v1/models", timeout=10).json()["data"]] == [
            MODEL_NAME, "loop"]
        r = httpx.post(live.url + "/v1/completions", timeout=30, json={"model": "loop", "prompt": [4]})
        assert r.status_code == 200 and r.json()["model"] == MODEL_NAME, r.text
        r = httpx.post(live.url + "/v1/completions", timeout=30, json={"model": "gpt-4", "prompt": [4]})
        assert r.status_code == 404 and r.json()["error"]["message"] == (
            f"model 'gpt-4' does not exist here; this server serves '{MODEL_NAME}', 'loop'")


def test_tools_under_tool_choice_none_are_shown_to_the_template():
    """vLLM's tool_choice "none" with tools (it was refused): the template's `tools` variable
    shows them and no call is parsed; tools under another (or no) tool_choice stay refused."""
    parser = RequestParser(MODEL_NAME, tokenizer=word_tokenizer(256), max_context=64,
                           chat_template="{{ tools[0].function.name }} {{ messages[0].content }}")
    tools = [{"type": "function", "function": {"name": "loop", "parameters": {}}}]
    body = {"messages": [{"role": "user", "content": "hello"}], "tools": tools, "tool_choice": "none"}
    assert parser.tokenize(body) == parser.tokenizer.encode("loop hello").ids
    assert parser.sampling(body, True, [[5]]).max_tokens == 63
    for choice in ({}, {"tool_choice": "auto"}):
        with pytest.raises(APIError, match=r"^tools is not supported by this server \(tool calling\)$"):
            parser.sampling({**body, **choice, "tool_choice": choice.get("tool_choice")}, True, [[5]])
    with pytest.raises(APIError, match=r"^tools must be a list of \{type, function") as err:
        parser.tokenize({**body, "tools": [{"type": "function"}]})
    assert err.value.param == "tools"


def test_the_models_generation_config_sets_the_sampling_defaults(caplog):
    """vLLM's --generation-config auto (the default): generation_config.json's temperature, top_p,
    top_k, min_p, repetition_penalty and max_new_tokens are the defaults of requests that leave
    them unset or null (chat's max_tokens, cut to the room; completions' stays 16), only where they
    differ from Hugging Face's defaults, logged at start-up as vLLM logs them; 'vllm': none. The
    server read only the EOS ids there."""
    from loopjax.generation_defaults import sampling_defaults

    config = {"temperature": 0.6, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.0, "min_p": 0.05,
              "max_new_tokens": 40, "do_sample": False, "eos_token_id": 2}
    defaults = sampling_defaults(config)
    assert defaults == {"temperature": 0.6, "top_p": 0.9, "min_p": 0.05, "max_tokens": 40}
    assert sampling_defaults(config, "vllm") == {} == sampling_defaults(None)
    with pytest.raises(ValueError, match=r"^generation_config\.json's sampling defaults are not usable "
                                         r"\(temperature must be in \[0, 2.0\], got 5\); serve with"):
        sampling_defaults({"temperature": 5})
    with pytest.raises(ValueError, match="^generation_config must be one of auto, vllm, got 'hf'$"):
        sampling_defaults(config, "hf")
    # vLLM's override_generation_config: merged over the file's (a null removes one; HF's default
    # values count there), under "vllm" too; keys vLLM does not read and bad values are one line
    assert sampling_defaults(config, override={"temperature": 1.0, "top_p": None, "top_k": 50}) == {
        "temperature": 1.0, "min_p": 0.05, "max_tokens": 40, "top_k": 50}
    assert sampling_defaults(config, "vllm", {"max_new_tokens": 9}) == {"max_tokens": 9}
    with pytest.raises(ValueError, match=r"^override_generation_config key 'max_tokens' is not one vLLM "
                                         r"reads \(the sampling defaults: repetition_penalty, temperature"):
        sampling_defaults(config, override={"max_tokens": 9})
    with pytest.raises(ValueError, match=r"^override_generation_config's sampling defaults are not usable "
                                         r"\(temperature must be in \[0, 2.0\], got 5\)"):
        sampling_defaults(None, override={"temperature": 5})
    parser = RequestParser(MODEL_NAME, max_context=64, sampling_defaults=defaults)
    chat = parser.sampling({"temperature": None, "top_p": 0.5}, True, [[5] * 4])
    assert (chat.temperature, chat.top_p, chat.min_p, chat.top_k, chat.max_tokens) == (0.6, 0.5, 0.05, 0, 40)
    assert parser.sampling({}, True, [[5] * 30]).max_tokens == 34  # cut to the room
    assert parser.sampling({}, False, [[5]]).max_tokens == 16  # completions' default (vLLM's)
    assert parser.sampling({"max_tokens": None}, False, [[5]]).max_tokens == 16  # as unset (vLLM's)
    assert parser.sampling({"max_tokens": 50}, True, [[5]]).max_tokens == 50  # a request's own wins
    # The server: chat's default max_tokens reaches the engine (the fake generates max_tokens tokens)
    model = types.SimpleNamespace(tokenizer=word_tokenizer(256), chat_template=CHATML,
                                  cfg=types.SimpleNamespace(vocab_size=256, max_context_len=512),
                                  generation_config={"max_new_tokens": 3, "temperature": 0.5})
    caplog.set_level("INFO", "loopjax.server")
    with LiveServer(create_app(FakeEngine(), MODEL_NAME, model=model)) as live:
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(live.url + "/v1/chat/completions", json=chat, timeout=30)
        assert len(r.json()["choices"][0]["token_ids"]) == 3
    assert ("Using default chat and completion sampling params from model: {'temperature': 0.5, "
            "'max_tokens': 3}") in caplog.text


def test_numbers_are_read_as_vllms_lax_pydantic_reads_them():
    """vLLM's pydantic (lax mode) takes a whole-number float or a numeric string for an integer
    field and a numeric string for a real one; every float was refused here (`n: 2.0`,
    `max_tokens: 16.0`, from a client whose numbers are all floats). Read as vLLM reads them now,
    at the body, so every later check sees the int (echo with max_tokens 0.0 scores only); 2.5,
    a count sent as true, and logprobs as a string (vLLM's validator refuses it) stay refused."""
    parser = RequestParser(MODEL_NAME, max_context=64, max_logprobs=5, vocab_size=100)

    def params(fields: dict, chat=False):
        return parser.sampling(parser.body(json.dumps(fields).encode()), chat, [[5]])

    got = params({"n": 2.0, "max_tokens": "16", "seed": 1.0, "top_k": 5.0, "logprobs": 2.0,
                  "min_tokens": " 3 ", "temperature": "0.5", "stop_token_ids": [7.0, "8"],
                  "logit_bias": {"9": "-5"}})
    assert (got.n, got.max_tokens, got.seed, got.top_k, got.logprobs, got.min_tokens, got.temperature,
            got.stop_token_ids, got.logit_bias) == (2, 16, 1, 5, 2, 3, 0.5, (7, 8), ((9, -5.0),))
    chat = params({"logprobs": 1.0, "top_logprobs": 3.0, "max_completion_tokens": 4.0}, chat=True)
    assert (chat.logprobs, chat.max_tokens) == (3, 4)
    assert parser.scores_only(parser.body(b'{"echo": true, "max_tokens": 0.0}'), False)
    truncated = parser.body(b'{"prompt": [5, 6], "truncate_prompt_tokens": -1.0}')
    assert parser.prompts(truncated, False) == [[5, 6]] and truncated["truncate_prompt_tokens"] == 63
    for fields, message in (({"n": 2.5}, "n must be an integer >= 1, got 2.5"),
                            ({"max_tokens": True}, "max_tokens must be an integer >= 1, got True"),
                            ({"top_k": "5.5"}, "top_k must be an integer >= -1, got '5.5'"),
                            ({"logprobs": "2"}, "logprobs must be an integer [0, 20], got '2'")):
        with pytest.raises(APIError, match=f"^{re.escape(message)}$") as err:
            params(fields)
        assert err.value.param == next(iter(fields))
