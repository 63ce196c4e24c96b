"""/v1/completions and /v1/chat/completions on the live server (tests/conftest.py), answers
in full: greedy tokens equal `loopjax.generate`'s, text and batched prompts, the chat
template, logprobs, per-request loop and exit settings, 16 requests at once."""

from __future__ import annotations

import concurrent.futures

import openai
import pytest
from server_helpers import CHATML, MODEL_NAME, REF_ENGINE, wait_idle

from loopjax.openai_protocol import render_chat


def test_completion_greedy_equals_generate(client, served_model):
    from loopjax.llm import generate

    prompts = [[5, 9, 13, 17, 21], [7, 3, 100, 42]]
    ref = generate(served_model, prompts, max_new_tokens=8, engine_options=dict(REF_ENGINE))
    for prompt, expect in zip(prompts, ref):
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0)
        choice = r.choices[0]
        assert choice.token_ids == list(expect.token_ids)
        assert choice.text == served_model.tokenizer.decode(list(expect.token_ids))
        assert r.usage.prompt_tokens == len(prompt)
        assert r.usage.completion_tokens == len(expect.token_ids)
        assert choice.finish_reason in ("length", "stop")
        assert len(choice.exit_loops) == len(choice.token_ids)


def test_echo_scores_the_prompt_as_lm_eval_asks(client, served_model):
    """lm-eval's loglikelihood request (echo, logprobs=1, max_tokens=1, greedy): the prompt's
    tokens and log-probabilities (loopjax.score, the identity path) come before the generated
    token's, which are the request's without echo; each top entry says whether the scored token
    is the greedy one. The engine's logprob of the generated token is the identity path's."""
    from loopjax.scoring import score

    tok = served_model.tokenizer
    prompt = "hello world the loop model user"
    ids = tok.encode(prompt, add_special_tokens=False).ids
    kw = dict(model=MODEL_NAME, prompt=prompt, max_tokens=1, temperature=0, logprobs=1)
    plain = client.completions.create(**kw).choices[0]
    echoed = client.completions.create(**kw, echo=True).choices[0]
    assert echoed.text == tok.decode(ids) + plain.text and echoed.token_ids == plain.token_ids
    lp = echoed.logprobs
    assert lp.tokens == [tok.id_to_token(t) for t in ids] + plain.logprobs.tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = score(served_model, ids, top_k=1)[0]
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(ref.token_logprobs, abs=1e-6)
    assert lp.token_logprobs[len(ids):] == plain.logprobs.token_logprobs
    assert lp.top_logprobs[len(ids):] == plain.logprobs.top_logprobs
    for t in range(1, len(ids)):  # lm-eval's is_greedy: the top entry is the scored token
        (name, top), = lp.top_logprobs[t].items()
        assert (name == lp.tokens[t]) == ref.greedy[t - 1] and top >= lp.token_logprobs[t]
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


def test_min_tokens_and_stop_token_ids_pass_through(client):
    kw = dict(model=MODEL_NAME, prompt=[5, 9, 13, 17, 21], max_tokens=8, temperature=0,
              extra_body={"ignore_eos": True})
    first = client.completions.create(**kw).choices[0].token_ids[0]
    stop = dict(kw, extra_body={"ignore_eos": True, "stop_token_ids": [first]})
    assert client.completions.create(**stop).choices[0].token_ids == [first]
    held = client.completions.create(**dict(stop, extra_body={**stop["extra_body"], "min_tokens": 5}))
    assert len(held.choices[0].token_ids) >= 5 and first not in held.choices[0].token_ids[:5]


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
