"""/v1/completions and /v1/chat/completions on the live server (tests/conftest.py), answers
in full: greedy tokens equal `loopjax.generate`'s, echo and prompt_logprobs (loopjax.score's),
text and batched prompts, the chat template, logprobs, per-request loop and exit settings, 16
requests at once."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import openai
import pytest
from server_helpers import CHATML, MODEL_NAME, REF_ENGINE, wait_idle

from loopjax.chat import render_chat
from loopjax.scoring import score  # bound at import: count_scores counts the server's calls only


def test_completion_greedy_equals_generate(client, served_model):
    from loopjax.llm import generate

    prompts = [[5, 9, 13, 17, 21], [7, 3, 100, 42]]
    ref = generate(served_model, prompts, max_new_tokens=8, engine_options=dict(REF_ENGINE))
    for prompt, expect in zip(prompts, ref):
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0)
        choice = r.choices[0]
        assert choice.token_ids == list(expect.token_ids)
        # NOTE: decoded after the prompt's words, as vLLM's: the first one too follows a space
        assert choice.text == expect.text == " " + served_model.tokenizer.decode(list(expect.token_ids))
        assert r.usage.prompt_tokens == len(prompt)
        assert r.usage.completion_tokens == len(expect.token_ids)
        assert choice.finish_reason in ("length", "stop")
        assert len(choice.exit_loops) == len(choice.token_ids)


def test_echo_scores_the_prompt_as_lm_eval_asks(client, served_model, server):
    """lm-eval's loglikelihood request (echo, logprobs=1, max_tokens=1, greedy): the prompt's
    tokens and log-probabilities (loopjax.score, the identity path) come before the generated
    token's, which are the request's without echo; each top entry says whether the scored token
    is the greedy one. The engine's logprob of the generated token is the identity path's."""
    tok = served_model.tokenizer
    prompt = "hello world the loop model user"
    ids = tok.encode(prompt, add_special_tokens=False).ids
    kw = dict(model=MODEL_NAME, prompt=prompt, max_tokens=1, temperature=0, logprobs=1)
    plain = client.completions.create(**kw).choices[0]
    echoed = client.completions.create(**kw, echo=True).choices[0]
    assert echoed.text == tok.decode(ids) + plain.text and echoed.token_ids == plain.token_ids
    lp = echoed.logprobs
    assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in ids] + plain.logprobs.tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = score(served_model, ids, top_k=1)[0]
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(ref.token_logprobs, abs=1e-6)
    assert lp.token_logprobs[len(ids):] == plain.logprobs.token_logprobs
    assert lp.top_logprobs[len(ids):] == plain.logprobs.top_logprobs
    for t in range(1, len(ids)):  # lm-eval's is_greedy: the most likely entry is the scored token
        top = lp.top_logprobs[t]  # the top 1 and (OpenAI's logprobs + 1) the scored token itself
        assert top[lp.tokens[t]] == lp.token_logprobs[t] and len(top) == 1 + (not ref.greedy[t - 1])
        assert (max(top, key=top.get) == lp.tokens[t]) == ref.greedy[t - 1]
    # max_tokens 0 (OpenAI's legacy scoring request, vLLM's): the prompt's part alone, nothing generated
    requests = server.aengine.metrics.requests.value
    only = client.completions.create(**dict(kw, max_tokens=0), echo=True, n=2)
    for c in only.choices:
        assert (c.text, c.finish_reason, c.token_ids) == (tok.decode(ids), "length", [])
        assert c.logprobs.tokens == lp.tokens[:len(ids)]
        assert c.logprobs.top_logprobs == lp.top_logprobs[:len(ids)]
    assert only.usage.completion_tokens == 0 and server.aengine.metrics.requests.value == requests
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={**kw, "max_tokens": 0, "echo": True, "stream": True}) as stream:
        chunks = [json.loads(line.removeprefix("data: ")) for line in stream.iter_lines()
                  if line.startswith("data: {")]
    assert [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in chunks] == [
        (tok.decode(ids), "length")]
    with pytest.raises(openai.BadRequestError, match="max_tokens must be >= 1, got 0"):  # echo's alone
        client.completions.create(**dict(kw, max_tokens=0))
    generated = score(served_model, ids + plain.token_ids)[0].token_logprobs[-1]
    assert plain.logprobs.token_logprobs[0] == pytest.approx(generated, abs=1e-4)
    # A one-token prompt has no log-probability of its own.
    one = client.completions.create(**dict(kw, prompt=ids[:1]), echo=True).choices[0].logprobs
    assert one.token_logprobs[0] is None and len(one.token_logprobs) == 2 and one.top_logprobs[0] is None
    # Prompts as ids, n samples each: every choice echoes its own prompt; no logprobs asked.
    r = client.completions.create(model=MODEL_NAME, prompt=[ids[:3], ids[2:]], n=2, max_tokens=2,
                                  temperature=0.8, seed=5, echo=True)
    assert all(c.text.startswith(tok.decode(p)) for c, p in zip(r.choices, [ids[:3]] * 2 + [ids[2:]] * 2,
                                                                  strict=True))
    assert all(c.logprobs is None and len(c.token_ids) == 2 for c in r.choices)
    assert r.choices[0].text == tok.decode(ids[:3]) + client.completions.create(
        model=MODEL_NAME, prompt=ids[:3], max_tokens=2, temperature=0.8, seed=5).choices[0].text


def test_echo_gives_the_prompt_as_sent_and_text_offsets_place_each_token(server, client, served_model):
    """echo puts the prompt before the completion as vLLM does: a text prompt as sent, special
    tokens and spaces kept (it was decoded, special tokens skipped), token ids decoded with
    their special tokens. logprobs' text_offset (null before) is where each token's text begins
    in the choice's text, the echoed prompt's included; streamed chunks carry the same."""
    tok = served_model.tokenizer
    prompt = "hello  <|im_start|>world the"
    body = dict(model=MODEL_NAME, prompt=prompt, max_tokens=3, temperature=0, logprobs=0, echo=True,
                ignore_eos=True, logit_bias={"0": -100, "1": -100, "2": -100})  # no special token generated
    full = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    text, lp = full["text"], full["logprobs"]
    ids = tok.encode(prompt).ids
    assert text.startswith(prompt) and len(lp["text_offset"]) == len(lp["tokens"]) == len(ids) + 3
    starts = [start for start, _ in tok.encode(prompt).offsets]
    assert lp["text_offset"][:len(ids)] == starts == [0, 7, 19, 25]
    assert lp["text_offset"][len(ids)] == len(prompt)
    ends = lp["text_offset"][1:] + [len(text)]
    pieces = [text[a:b].strip() for a, b in zip(lp["text_offset"], ends, strict=True)]
    assert pieces == [t.strip() for t in lp["tokens"]]  # (the word tokenizer's decoder adds spaces)
    chunks = _streamed(server, "/v1/completions", body)
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == text
    streamed = [o for c in chunks for ch in c["choices"] for o in ch["logprobs"]["text_offset"]]
    assert streamed == lp["text_offset"]
    as_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=1, echo=True).choices[0]
    assert as_ids.text.startswith(tok.decode(ids, skip_special_tokens=False))
    assert "<|im_start|>" in as_ids.text
    # truncate_prompt_tokens: echo gives the part of the prompt that ran (the decode of its ids)
    cut = httpx.post(server.url + "/v1/completions", json={**body, "truncate_prompt_tokens": 2},
                     timeout=60).json()["choices"][0]
    assert cut["text"].startswith(tok.decode(ids[-2:], skip_special_tokens=False))
    assert cut["logprobs"]["tokens"][:2] == lp["tokens"][len(ids) - 2:len(ids)]
    assert cut["logprobs"]["text_offset"][:3] == [0, len("world"), len("world the")]


@pytest.fixture
def count_scores(monkeypatch):
    """(prompts, top_k) of each `loopjax.score` call the server makes (echo, prompt_logprobs)."""
    import loopjax.scoring

    calls, real = [], loopjax.scoring.score

    def counted(model, sequences, **kw):
        calls.append(([list(s) for s in sequences], kw["top_k"]))
        return real(model, sequences, **kw)

    monkeypatch.setattr(loopjax.scoring, "score", counted)
    return calls


def check_prompt_logprobs(got, ids, k, model):
    """vLLM's prompt_logprobs of `ids`: null, then per token {id: {logprob, rank, decoded_token}}
    holding the prompt token (loopjax.score's log p and rank, exactly) and the k most likely."""
    want, = score(model, ids, top_k=k)
    everything, = score(model, ids, top_k=model.cfg.vocab_size)  # every token's log p, most likely first
    assert len(got) == len(ids) and got[0] is None
    name = lambda t: model.tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
    for t, position in enumerate(got[1:]):
        token, top = ids[t + 1], want.top_logprobs[t]
        # vLLM's rank: its place among the top k when listed there, else of all V (ties last)
        listed = next((r for r, (u, _) in enumerate(top, 1) if u == token), want.ranks[t])
        assert position[str(token)] == {"logprob": want.token_logprobs[t], "rank": listed,
                                        "decoded_token": name(token)}
        lps = [v for _, v in everything.top_logprobs[t]]
        assert want.ranks[t] == sum(v >= want.token_logprobs[t] for v in lps)  # its rank of all V
        assert set(position) == {str(token)} | {str(u) for u, _ in top}
        for rank, (u, v) in enumerate(top, 1):
            if u != token:
                assert position[str(u)] == {"logprob": v, "rank": rank, "decoded_token": name(u)}
    return want


def test_prompt_logprobs_in_vllms_shape(client, served_model, count_scores):
    """prompt_logprobs=k (vLLM's extra field): each choice carries its prompt's, loopjax.score's
    numbers; the choices of a prompt share one scoring; with echo the prompt is scored once (top
    max(logprobs, k)), each field keeping its own top; chat puts it at the top (vLLM's place)."""
    tok = served_model.tokenizer
    ids = tok.encode("hello world the loop model user w7 w42", add_special_tokens=False).ids
    ids[4] = score(served_model, ids[:5], top_k=1)[0].top_logprobs[3][0][0]  # a greedy token: rank 1
    r = client.completions.create(model=MODEL_NAME, prompt=[ids, ids[:3]], n=2, max_tokens=2, temperature=0.8,
                                  seed=1, extra_body={"prompt_logprobs": 2})  # the server's max_logprobs
    assert count_scores == [([ids, ids[:3]], 2)]  # one call, one sequence per prompt
    want = check_prompt_logprobs(r.choices[0].prompt_logprobs, ids, 2, served_model)
    assert want.ranks[3] == 1 and len(r.choices[0].prompt_logprobs[4]) == 2  # a prompt token in the top 2
    assert any(rank > 2 for rank in want.ranks)  # ... and one outside it (3 entries)
    assert r.choices[1].prompt_logprobs == r.choices[0].prompt_logprobs
    assert r.choices[2].prompt_logprobs == r.choices[3].prompt_logprobs
    check_prompt_logprobs(r.choices[2].prompt_logprobs, ids[:3], 2, served_model)
    assert r.choices[0].logprobs is None and len(r.choices[0].token_ids) == 2
    # with echo: one scoring with the larger top; echo keeps logprobs' 1, prompt_logprobs its 2
    count_scores.clear()
    kw = dict(model=MODEL_NAME, prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True)
    both = client.completions.create(**kw, extra_body={"prompt_logprobs": 2}).choices[0]
    assert count_scores == [([ids], 2)]
    check_prompt_logprobs(both.prompt_logprobs, ids, 2, served_model)
    echoed = client.completions.create(**kw).choices[0]
    assert both.logprobs == echoed.logprobs
    check_prompt_logprobs(echoed.prompt_logprobs, ids, 1, served_model)  # vLLM's echo: top logprobs'
    assert client.completions.create(**{**kw, "logprobs": None}).choices[0].prompt_logprobs is None  # vLLM's
    # prompt_logprobs=0: the prompt token alone
    zero = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=1,
                                     extra_body={"prompt_logprobs": 0}).choices[0].prompt_logprobs
    assert [list(p) for p in zero[1:]] == [[str(t)] for t in ids[1:]]
    # chat: the rendered prompt's, once at the top of the response
    messages = [{"role": "user", "content": "hello loop"}]
    chat_ids = tok.encode(render_chat(CHATML, messages), add_special_tokens=False).ids
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2,
                                       extra_body={"prompt_logprobs": 1})
    check_prompt_logprobs(r.prompt_logprobs, chat_ids, 1, served_model)
    assert r.usage.prompt_tokens == len(chat_ids) and not hasattr(r.choices[0], "prompt_logprobs")


def test_min_tokens_and_stop_token_ids_pass_through(client):
    kw = dict(model=MODEL_NAME, prompt=[5, 9, 13, 17, 21], max_tokens=8, temperature=0,
              extra_body={"ignore_eos": True})
    first = client.completions.create(**kw).choices[0].token_ids[0]
    stop = dict(kw, extra_body={"ignore_eos": True, "stop_token_ids": [first]})
    assert client.completions.create(**stop).choices[0].token_ids == [first]
    held = client.completions.create(**dict(stop, extra_body={**stop["extra_body"], "min_tokens": 5}))
    assert len(held.choices[0].token_ids) >= 5 and first not in held.choices[0].token_ids[:5]


def test_skip_special_tokens(client, served_model):
    """vLLM's skip_special_tokens=false keeps special tokens in the text (answer, stream, chat;
    it was always true); an EOS ending the output adds no text, as in vLLM; vLLM's
    spaces_between_special_tokens=false joins consecutive special tokens without spaces."""
    tok, keep = served_model.tokenizer, {"skip_special_tokens": False}
    kw = dict(model=MODEL_NAME, prompt=[5, 9, 13], max_tokens=3, temperature=0, logit_bias={"1": 100})
    skipped = client.completions.create(**kw).choices[0]
    kept = client.completions.create(**kw, extra_body=keep).choices[0]
    assert skipped.token_ids == kept.token_ids == [1, 1, 1]  # <|im_start|>, a special token
    assert skipped.text == "" and kept.text == " " + tok.decode([1, 1, 1], skip_special_tokens=False)
    chunks = list(client.completions.create(**kw, stream=True, extra_body=keep))
    assert "".join(ch.text for c in chunks for ch in c.choices) == kept.text
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hello"}],
                                          max_tokens=3, temperature=0, logit_bias={"1": 100}, extra_body=keep)
    assert chat.choices[0].message.content == kept.text
    eos = client.completions.create(**dict(kw, logit_bias={"2": 100}), extra_body=keep).choices[0]
    assert (eos.token_ids, eos.finish_reason, eos.text) == ([2], "stop", "")
    unspaced = client.completions.create(**kw, extra_body={**keep, "spaces_between_special_tokens": False})
    # vLLM's field: no space between them (the first one follows the prompt's text as spaced)
    assert unspaced.choices[0].text == " " + "<|im_start|>" * 3 != kept.text


def test_penalties_and_logit_bias_pass_through(client, served_model):
    """OpenAI's presence / frequency penalties and logit_bias (JSON keys: token ids as strings)
    and vLLM's repetition_penalty reach the engine: the tokens of `loopjax.generate` with them."""
    from loopjax.llm import generate

    prompt = [5, 9, 13, 17, 21]
    kw = dict(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    banned = client.completions.create(**kw).choices[0].token_ids[0]
    body = dict(kw, presence_penalty=0.5, frequency_penalty=0.3, logit_bias={str(banned): -100},
                extra_body={"ignore_eos": True, "repetition_penalty": 1.3})
    choice = client.completions.create(**body).choices[0]
    expect = generate(served_model, [prompt], max_new_tokens=8, ignore_eos=True, presence_penalty=0.5,
                      frequency_penalty=0.3, logit_bias={banned: -100.0}, repetition_penalty=1.3,
                      engine_options=dict(REF_ENGINE))[0]
    assert choice.token_ids == list(expect.token_ids) and banned not in choice.token_ids
    with pytest.raises(openai.BadRequestError, match="presence_penalty must be in"):
        client.completions.create(**dict(kw, presence_penalty=2.5))


def test_bad_words_never_complete_in_the_output(client, served_model, monkeypatch):
    """vLLM's bad_words: the output never holds a banned word sequence and is the plain greedy
    output up to where that held it. The word before the banned one was sampled by a step in
    flight (async scheduling), so the device checks it: the spy sees such bans."""
    from loopjax import bad_words

    seen, step_bans = [], bad_words.step_bans
    spy = lambda *a: seen.append(step_bans(*a)) or seen[-1]  # noqa: E731
    monkeypatch.setattr(bad_words, "step_bans", spy)
    kw = dict(model=MODEL_NAME, prompt=[5, 9, 13, 17, 21], max_tokens=8, temperature=0)
    plain = client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].token_ids
    for length in (1, 2, 3):
        banned = plain[3 - length + 1:4]  # ends at plain[3]
        start = next(i for i in range(len(plain)) if plain[i:i + length] == banned)
        got = client.completions.create(**kw, extra_body={
            "ignore_eos": True, "bad_words": [served_model.detokenize(banned)]}).choices[0].token_ids
        end = start + length - 1  # where the plain output first completes the sequence
        assert got[:end] == plain[:end] and got[end] != plain[end], (length, plain, got)
        assert all(got[i:i + length] != banned for i in range(len(got)))
    assert any(after >= 0 for bans in seen for _, after in bans)
    with pytest.raises(openai.BadRequestError, match="every bad_words entry must be a non-empty string"):
        client.completions.create(**kw, extra_body={"bad_words": [""]})


def test_text_prompt_and_batch_of_prompts(client):
    r = client.completions.create(model=MODEL_NAME, prompt=["hello world", "the loop model"], max_tokens=4,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert all(len(c.token_ids) == 4 for c in r.choices)
    assert r.usage.prompt_tokens == 5


def test_chat_uses_template(client, served_model):
    from loopjax.llm import generate

    messages = [{"role": "system", "content": "the model"}, {"role": "user", "content": "hello world"}]
    ids = served_model.tokenizer.encode(render_chat(CHATML, messages), add_special_tokens=False).ids
    assert ids[:2] == [1, 7] and ids[-2:] == [1, 6]  # <|im_start|>system ... <|im_start|>assistant
    expect = generate(served_model, [ids], max_new_tokens=6, engine_options=dict(REF_ENGINE))[0]
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].token_ids == list(expect.token_ids)
    assert r.usage.prompt_tokens == len(ids)


def test_logprobs_completion_and_chat(client):
    r = client.completions.create(model=MODEL_NAME, prompt=[5, 6, 7], max_tokens=3, temperature=0,
                                  logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and len(top) == 2 and top[token] == pytest.approx(max(top.values()))  # greedy
    # vLLM's return_tokens_as_token_ids (it was an unknown field): tokens named "token_id:ID"
    named = client.completions.create(model=MODEL_NAME, prompt=[5, 6, 7], max_tokens=3, temperature=0,
                                      logprobs=2, extra_body={"ignore_eos": True,
                                                              "return_tokens_as_token_ids": True})
    ids = named.choices[0].token_ids
    assert named.choices[0].logprobs.tokens == [f"token_id:{t}" for t in ids] == [
        max(top, key=top.get) for top in named.choices[0].logprobs.top_logprobs]
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hello"}], max_tokens=3, temperature=0,
        logprobs=True, top_logprobs=1, stream=True, extra_body={"ignore_eos": True}))
    content = [e for c in chunks if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]
    assert len(content) == 3 and all(e.top_logprobs[0].token == e.token for e in content)


def test_per_request_loop_settings(client):
    kw = dict(model=MODEL_NAME, prompt=[5, 6, 7], max_tokens=3, temperature=0)
    shallow = client.completions.create(**kw, extra_body={"loops": 2, "ignore_eos": True})
    assert shallow.choices[0].exit_loops == [2, 2, 2]
    with pytest.raises(openai.BadRequestError, match="loops"):
        client.completions.create(**kw, extra_body={"loops": 0})
    # Exit settings per request: Ouro Q-exit in skip mode (exits early, at most 4 loops) and an
    # exit trace replayed over the decoded tokens (the first token comes from the prompt).
    skip = client.completions.create(**kw, extra_body={"exit_mode": "skip", "exit_threshold": 0.1,
                                                       "ignore_eos": True})
    assert all(1 <= n <= 4 for n in skip.choices[0].exit_loops)
    traced = client.completions.create(**kw, extra_body={"exit_trace": [1, 2, 3], "ignore_eos": True})
    assert traced.choices[0].exit_loops[1:] == [2, 3]


def test_sixteen_concurrent_requests(client, server):
    def one(i):
        r = client.completions.create(model=MODEL_NAME, prompt=[3 + i, 4, 5 + i], max_tokens=6,
                                      temperature=0, extra_body={"ignore_eos": True})
        return r.choices[0].token_ids

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(one, range(16)))
    assert all(len(o) == 6 for o in outs)
    assert outs[0] == one(0)  # batch composition does not change greedy tokens
    wait_idle(server.aengine)


def test_stop_strings_end_the_text_on_the_server_side(client, served_model, monkeypatch):
    """A stop string ends the choice before it (answer and stream alike, finish_reason "stop"),
    matched by the server on the text it streams: the engine gets the request without stop
    strings and makes no text of its own (no second detokenization)."""
    import loopjax.request_extra

    made = []
    monkeypatch.setattr(loopjax.request_extra, "IncrementalDetokenizer",
                        lambda *a, **k: made.append(a) or pytest.fail("the engine detokenized"))
    kw = dict(model=MODEL_NAME, prompt=[5, 9, 13], max_tokens=12, temperature=0,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    words = full.split()
    assert full == " " + " ".join(words)  # the first word follows the prompt's (vLLM's decode)
    starts = [1 + len(" ".join(words[:i])) + (i > 0) for i in range(len(words))]
    i = next(i for i, w in enumerate(words) if i >= 2 and full.find(w) == starts[i])  # first seen there
    word, expected = words[i], full[:starts[i]]
    answer = client.completions.create(**kw, stop=[word]).choices[0]
    assert (answer.text, answer.finish_reason) == (expected, "stop")
    chunks = list(client.completions.create(**kw, stop=[word], stream=True))
    assert "".join(ch.text for c in chunks for ch in c.choices) == expected
    assert [ch.finish_reason for c in chunks for ch in c.choices][-1] == "stop" and not made


def _streamed(server, path: str, body: dict) -> list[dict]:
    """The JSON chunks of a streamed request (server-sent events ending in [DONE])."""
    r = httpx.post(server.url + path, json={**body, "stream": True}, timeout=60)
    assert r.status_code == 200, r.text
    data = [event[6:] for event in r.text.split("\n\n") if event.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_echo_and_prompt_logprobs_stream(server, served_model):
    """Streamed, each choice's first chunk of tokens carries the prompt's part before them (echo's
    text and logprobs, prompt_logprobs), as vLLM's echo (it was a chunk of its own, of no tokens),
    then its generation: reassembled, the answer in full (two prompts, n = 2), text offsets
    included; a chat stream's first chunk carries prompt_logprobs at the top."""
    ids = served_model.tokenizer.encode("hello world the loop model", add_special_tokens=False).ids
    body = dict(model=MODEL_NAME, prompt=[ids, ids[:3]], n=2, max_tokens=3, temperature=0, logprobs=1,
                echo=True, prompt_logprobs=2, ignore_eos=True)
    full = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    chunks = _streamed(server, "/v1/completions", body)
    assert len(full["choices"]) == 4
    for choice in full["choices"]:
        mine = [ch for c in chunks for ch in c["choices"] if ch["index"] == choice["index"]]
        first = mine[0]["token_ids"]
        assert first and first == choice["token_ids"][:len(first)]
        assert mine[0]["prompt_logprobs"] == choice["prompt_logprobs"]
        assert len(mine[0]["logprobs"]["tokens"]) == len(body["prompt"][choice["index"] // 2]) + len(first)
        assert mine[0]["text"] and "".join(m["text"] for m in mine) == choice["text"]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [x for m in mine for x in m["logprobs"][key]] == choice["logprobs"][key], key
        assert [t for m in mine for t in m["token_ids"]] == choice["token_ids"]
        assert all("prompt_logprobs" not in m for m in mine[1:])
    chat = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "hello loop"}], max_tokens=2,
                prompt_logprobs=1)
    full = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60).json()
    chunks = _streamed(server, "/v1/chat/completions", chat)
    assert chunks[0]["prompt_logprobs"] == full["prompt_logprobs"] is not None
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("prompt_logprobs" not in c for c in chunks[1:])


def test_a_scoring_error_mid_stream_ends_it_and_frees_the_rows(server, monkeypatch):
    """Streamed echo whose scoring fails: the stream carries the error then [DONE], and the
    request's engine row is aborted at once (not left to run its 400 tokens)."""
    import loopjax.scoring

    def failing(*args, **kw):
        raise ValueError("the scorer refused")

    monkeypatch.setattr(loopjax.scoring, "score", failing)
    before = server.aengine.metrics.aborted.value
    r = httpx.post(server.url + "/v1/completions", timeout=60, json=dict(
        model=MODEL_NAME, prompt=[5, 9, 13], max_tokens=400, echo=True, stream=True, ignore_eos=True))
    events = [e[6:] for e in r.text.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]" and "the scorer refused" in json.loads(events[-2])["error"]["message"]
    assert server.aengine.metrics.aborted.value == before + 1
    wait_idle(server.aengine)


def test_a_scoring_failure_on_the_device_is_a_500(server, monkeypatch):
    """echo whose scoring fails with another error than the scorer's refusal (the device out of
    memory): a one-line 500 in OpenAI's error JSON; streamed, as the last event before [DONE]
    (it was uvicorn's plain-text 500; a stream ended without either)."""
    import loopjax.scoring

    def failing(*args, **kw):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")

    monkeypatch.setattr(loopjax.scoring, "score", failing)
    body = dict(model=MODEL_NAME, prompt=[5, 9, 13], max_tokens=2, echo=True)
    error = {"message": "scoring the prompts failed: RuntimeError: RESOURCE_EXHAUSTED: out of memory",
             "type": "server_error", "param": None, "code": 500}
    r = httpx.post(server.url + "/v1/completions", timeout=60, json=body)
    assert r.status_code == 500 and r.json()["error"] == error, r.text
    r = httpx.post(server.url + "/v1/completions", timeout=60, json=body | {"stream": True})
    events = [e[6:] for e in r.text.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"] == error
    wait_idle(server.aengine)
