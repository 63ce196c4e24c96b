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
