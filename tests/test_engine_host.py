"""The Engine's host side over random workloads on a fake device (tests/fake_device.py): token
and carry slots, token histories, inputs on the device, Huginn s0 rows, stop strings, aborts,
preemption, the prefix cache and groups of n samples, with and without async scheduling. The
golden models give the shapes only: no step runs on JAX."""

from __future__ import annotations

import dataclasses
import random
import types

import numpy as np
import pytest
from fake_device import engine_on_fake_device

import loopjax
from loopjax.engine import Engine, EngineConfig
from loopjax.request import StepFailedError
from loopjax.sampling_params import SamplingParams

MODELS = {"ouro": "tests/data/ouro", "huginn": "tests/data/huginn/huginn_shape_242"}


@pytest.fixture(scope="module")
def models():
    return {family: loopjax.load(path) for family, path in MODELS.items()}


class _Letters:  # a tokenizer: token t is one letter, so stop strings match often
    def decode(self, ids, skip_special_tokens=True):
        return "".join("abcdefgh"[t % 8] for t in ids)

    def encode(self, text, add_special_tokens=True):
        return types.SimpleNamespace(ids=["abcdefgh".index(c) for c in text])


def _engine(model, config: EngineConfig) -> Engine:
    return engine_on_fake_device(model, config, _Letters())


def _workload(rng, family, ctx, fused, vocab, hidden):
    """[(arrival step, id, prompt, params, add_request keywords)]; a group of n samples shares
    the prompt and arrives at once, half the prompts share a prefix."""
    common, items = [rng.randrange(vocab) for _ in range(ctx)], []
    for g in range(rng.randint(2, 7)):
        n = rng.randint(1, ctx - 1)
        prompt = common[:n] if rng.random() < 0.5 else [rng.randrange(vocab) for _ in range(n)]
        kw = dict(max_tokens=rng.randint(1, 16), ignore_eos=rng.random() < 0.5,
                  loops=rng.choice([None, 1, 8]), temperature=rng.choice([0.0, 0.8]),
                  seed=rng.randrange(100), n=rng.choice([1, 1, 2, 3]),
                  logprobs=rng.choice([None, None, 1]), repetition_penalty=rng.choice([1.0, 1.0, 1.2]),
                  stop_token_ids=tuple(rng.randrange(vocab) for _ in range(rng.choice([0, 0, 3]))),
                  stop=rng.choice([(), (), ("".join(rng.choices("abcdefgh", k=2)),)]))
        kw["min_tokens"] = rng.randint(0, kw["max_tokens"])
        extra = {}
        if family == "huginn":
            warm = fused and rng.random() < 0.4
            mode = rng.choice([None, "zero", "seeded", "explicit", "explicit"])
            if mode == "explicit":  # warm start gives the prompt's states only
                shape = (n + (0 if warm else kw["max_tokens"] - 1), hidden)
                extra["initial_state"] = np.random.default_rng(g).standard_normal(shape).astype(np.float32)
            elif mode is not None:
                extra["initial_state"] = mode
            extra["warm_start"] = warm
            if fused and rng.random() < 0.2:
                kw.update(exit_criterion="kl", exit_mode=rng.choice(["skip", "select"]))
        at = rng.randint(0, 15)
        for i, params in enumerate(SamplingParams(**kw).fan_out()):
            items.append((at, f"g{g}s{i}", prompt, params, extra))
    return items


def check_engine(engine, settled: bool = True) -> None:
    """After a step: the pool's invariants hold, and each token / carry slot is held once or free;
    settled (no schedule() raised since the last plan): no waiting request holds one."""
    engine.scheduler.block_manager.check(engine.scheduler.requests.values())
    for kind, free in (("token_slot", engine._free_token_slots), ("carry_slot", engine._free_carry)):
        held = [getattr(x, kind) for x in engine._extra.values() if getattr(x, kind) is not None]
        assert sorted(held + free) == list(range(engine.runner.max_rows)), kind
    for request in engine.scheduler.waiting if settled else ():  # a preempted one gave them back
        extra = engine._extra[request.request_id]
        assert (extra.token_slot, extra.carry_slot) == (None, None), request.request_id


def _run(engine, items, rng=None, abort_rate=0.0):
    """Step to the end (aborting live requests at random); the slots and pages are checked
    after every step. Returns {id: final RequestOutput}."""
    arrivals, finals, step = {}, {}, 0
    for at, rid, prompt, params, extra in items:
        arrivals.setdefault(at, []).append((rid, prompt, params, extra))
    while engine.has_unfinished() or arrivals:
        for rid, prompt, params, extra in arrivals.pop(step, []):
            engine.add_request(prompt, params, rid, **extra)
        if abort_rate and engine.scheduler.requests and rng.random() < abort_rate:
            assert engine.abort(rng.choice(sorted(engine.scheduler.requests)))
        for out in engine.step():
            assert out.request_id not in finals
            if out.finished:
                finals[out.request_id] = out
        check_engine(engine)
        step += 1
    stats = engine.stats()
    assert stats["pages_free"] == stats["pages_total"] and not engine._extra
    return finals


@pytest.mark.parametrize("seed", range(20))
def test_random_workloads_give_each_request_its_tokens_alone(models, seed):
    """Every finished request has the tokens, exit loops, logprobs, text and finish reason it
    has alone in a big pool (an aborted one: a prefix of them), except a warm-start request
    that was preempted (docs/semantics.md); every page and slot comes back."""
    rng = random.Random(seed)
    model, config, engine, items = random_scenario(models, rng)
    finals = _run(engine, items, rng, abort_rate=rng.choice([0.0, 0.1]))
    check_alone(model, config, items, finals)


def random_scenario(models, rng):
    """(model, config, engine on the fake device, workload) of a random Ouro or Huginn setup:
    page sizes, contexts, tight or big pools, prefix cache, async scheduling, fused or not."""
    family = rng.choice(["ouro", "huginn"])
    model = models[family]
    page_size, ctx, fused = rng.choice([1, 2, 4]), rng.randint(6, 24), rng.random() < 0.7
    shared = family == "ouro" and fused and rng.random() < 0.4  # Ouro's decode pages
    config = EngineConfig(page_size=page_size, max_num_rows=rng.choice([1, 3, 4, 4]), max_context_len=ctx,
                          max_prefill_tokens=rng.choice([1, 3, 8, 32]),
                          prefill_token_buckets=(1, 2, 4, 8, 16, 32), max_prefill_rows=rng.choice([1, 2]),
                          fused_decode=fused, max_loops=8, max_logprobs=2,
                          kv_layout="shared" if shared else "per_loop")
    min_pages = -(-ctx // page_size)
    engine = _engine(model, dataclasses.replace(
        config, num_pages=rng.choice([200, *[rng.randint(min_pages, min_pages + 2)] * 3]),
        enable_prefix_caching=rng.random() < 0.6, async_scheduling=rng.random() < 0.7))
    items = _workload(rng, family, ctx, fused, model.cfg.vocab_size, getattr(model.cfg, "hidden_size", 0))
    return model, config, engine, items


def check_alone(model, config, items, finals) -> None:
    """Each request's final output is what it gets alone in a big pool (an aborted one: a
    prefix of its tokens), except a preempted warm-start request's (docs/semantics.md)."""
    assert set(finals) == {rid for _, rid, *_ in items}
    alone = _engine(model, dataclasses.replace(config, num_pages=200, async_scheduling=False))
    for _, rid, prompt, params, extra in items:
        expected, out = _run(alone, [(0, rid, prompt, params, extra)])[rid], finals[rid]
        if extra.get("warm_start") and out.metrics["num_preemptions"]:
            continue  # its decoded tokens were recomputed from the prompt's s0 rule
        n = len(out.token_ids) if out.finish_reason == "abort" else len(expected.token_ids)
        assert (out.token_ids, out.exit_loops) == (expected.token_ids[:n], expected.exit_loops[:n]), rid
        if out.finish_reason != "abort":
            assert (out.finish_reason, out.text, out.logprobs) == (expected.finish_reason, expected.text,
                                                                   expected.logprobs), rid


def test_stop_string_in_the_last_token_trims_the_text(models):
    """A stop string completed by the max_tokens-th token (the step that finishes the request by
    length) still trims the text and makes the reason "stop", as the server's Choice does."""
    config = EngineConfig(page_size=4, max_num_rows=2, max_context_len=32, max_prefill_tokens=8,
                          prefill_token_buckets=(1, 2, 4, 8), max_prefill_rows=1, max_loops=8)
    engine = _engine(models["ouro"], dataclasses.replace(config, async_scheduling=False))
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
    full = _run(engine, [(0, "full", [1, 2, 3], params, {})])["full"]
    stop = full.text[-2:]
    assert full.finish_reason == "length" and full.text.find(stop) == len(full.text) - 2
    out = _run(engine, [(0, "cut", [1, 2, 3], dataclasses.replace(params, stop=(stop,)), {})])["cut"]
    assert (out.text, out.finish_reason, out.token_ids) == (full.text[:-2], "stop", full.token_ids)


@pytest.mark.parametrize("request_id", [7, None.__class__, b"r", ("r",)])
def test_a_request_id_that_is_not_a_str_is_refused_in_one_line(models, request_id):
    engine = _engine(models["ouro"], EngineConfig(page_size=4, max_num_rows=2, max_context_len=32,
                                                  max_prefill_tokens=8, prefill_token_buckets=(8,)))
    with pytest.raises(ValueError, match=r"^request_id must be a str .*got (int|type|bytes|tuple)$"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), request_id)
    assert not engine.has_unfinished() and not engine._extra
    assert engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), None)  # None: a fresh id


def _llm(model, **config):
    """An LLM over the fake device (no compile)."""
    from loopjax.generation_defaults import sampling_defaults

    llm = object.__new__(loopjax.LLM)
    llm.model = dataclasses.replace(model, tokenizer=_Letters())
    llm.sampling_defaults = sampling_defaults(model.generation_config)  # as LLM.__init__'s
    llm.engine = _engine(model, EngineConfig(**{**dict(page_size=4, max_num_rows=2, max_context_len=32,
                                                       max_prefill_tokens=8, prefill_token_buckets=(8,)),
                                                **config}))
    return llm


def test_llm_initial_state_of_one_prompt_is_that_prompts_and_a_list_takes_one_per_prompt(models):
    """One prompt: initial_state (an array or the same nested lists) is its states, whatever
    its length; a list of prompts: one entry per prompt, an array refused in one line."""
    model = models["huginn"]
    llm, hidden = _llm(model), model.cfg.hidden_size
    states = [np.random.default_rng(k).standard_normal((5, hidden)).astype(np.float32) for k in range(2)]
    prompts, kw = [[1, 2, 3], [4, 5, 6]], dict(max_tokens=3, ignore_eos=True)
    each = [llm.generate(p, initial_state=s, **kw)[0].token_ids for p, s in zip(prompts, states)]
    nested = [llm.generate(p, initial_state=s.tolist(), **kw)[0].token_ids for p, s in zip(prompts, states)]
    both = [o.token_ids for o in llm.generate(prompts, initial_state=states, **kw)]
    as_lists = [o.token_ids for o in llm.generate(prompts, initial_state=[s.tolist() for s in states], **kw)]
    assert each == nested == both == as_lists and each[0] != each[1]
    one_row = [[0.5] * hidden]  # a one-position prompt, one token: the nested list is ONE state
    assert llm.generate([7], initial_state=one_row, max_tokens=1)[0].token_ids
    with pytest.raises(ValueError, match=r"^initial_state: one ndarray for a list of 2 prompts; give a list"):
        llm.generate(prompts, initial_state=states[0], **kw)
    with pytest.raises(ValueError, match=r"^initial_state: 5 entries for 2 prompts"):
        llm.generate(prompts, initial_state=states[0].tolist(), **kw)
    assert [o.token_ids for o in llm.generate(prompts, initial_state="zero", **kw)] == \
        [llm.generate(p, initial_state="zero", **kw)[0].token_ids for p in prompts]
    stats = llm.engine.stats()
    assert stats["pages_free"] == stats["pages_total"] and not llm.engine.has_unfinished()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_read_that_fails_aborts_the_running_requests_and_the_engine_serves_on(models, async_scheduling):
    """Runner.read raising (a device error) is one line; the running requests are aborted
    (reported by the next step, their pages and slots back), the prefix cache forgotten (its
    KV went with the device state) and a fresh state made: the waiting request and a new one
    with a cached prompt get the tokens a fresh engine gives them."""
    config = EngineConfig(page_size=4, max_num_rows=2, max_context_len=32, max_prefill_tokens=8,
                          prefill_token_buckets=(8,), max_prefill_rows=2, enable_prefix_caching=True,
                          async_scheduling=async_scheduling, max_logprobs=2)
    engine = _engine(models["ouro"], config)
    prompts = {"a": list(range(1, 10)), "b": list(range(20, 26)), "c": [7, 8, 9]}
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8, seed=3, logprobs=1)
    for rid, prompt in prompts.items():
        engine.add_request(prompt, params, rid)
    outs = engine.step() + engine.step()
    assert {o.request_id for o in outs} == {"a", "b"} and not any(o.finished for o in outs)
    read = engine.runner.read

    def broken(pending):
        engine.runner.read = read  # the next read works
        raise RuntimeError("INTERNAL: an illegal memory access\nstack of the device error")
    engine.runner.read = broken
    with pytest.raises(StepFailedError, match=r"^a step failed on the device \(RuntimeError: INTERNAL: an "
                                              r"illegal memory access\); 2 running requests "
                                              r"aborted, the KV pool made anew$") as failed:
        engine.step()
    assert sorted(failed.value.request_ids) == ["a", "b"] and failed.value.recovered
    aborted = [o for o in engine.step() if o.finished]
    assert {(o.request_id, o.finish_reason) for o in aborted} == {("a", "abort"), ("b", "abort")}
    engine.add_request(prompts["a"], params, "a again")  # its pages were cached: gone now
    finals = _run(engine, [])
    fresh = _run(_engine(models["ouro"], config), [(0, "c", prompts["c"], params, {}),
                                                   (0, "a again", prompts["a"], params, {})])
    assert {rid: (o.token_ids, o.logprobs) for rid, o in finals.items()} == \
        {rid: (o.token_ids, o.logprobs) for rid, o in fresh.items()}
    assert sorted(engine._free_token_slots) == list(range(engine.runner.max_rows))


def test_llm_generate_after_a_failed_read_raises_one_line_and_the_next_call_runs(models):
    llm = _llm(models["ouro"], max_num_rows=1)
    kw = dict(max_tokens=4, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate([[1, 2, 3], [4, 5]], **kw)]
    read = llm.engine.runner.read

    def broken(pending):
        llm.engine.runner.read = read
        raise RuntimeError("INTERNAL: device lost")
    llm.engine.runner.read = broken
    with pytest.raises(RuntimeError, match=r"^a step failed on the device \(RuntimeError: INTERNAL: device "
                                           r"lost\); 1 running request aborted"):
        llm.generate([[1, 2, 3], [4, 5]], **kw)
    assert not llm.engine.has_unfinished() and not llm.engine._extra
    assert [o.token_ids for o in llm.generate([[1, 2, 3], [4, 5]], **kw)] == expected
    stats = llm.engine.stats()
    assert stats["pages_free"] == stats["pages_total"]


def test_llm_names_the_empty_text_prompt_it_refuses(models):
    llm = _llm(models["ouro"])
    assert llm.generate(["ab", "c"], max_tokens=1, ignore_eos=True)[1].prompt_token_ids == [2]
    with pytest.raises(ValueError, match="^prompt 1: empty prompt: give at least one token id$"):
        llm.generate(["ab", ""], max_tokens=1)
    assert not llm.engine.has_unfinished()


def test_llm_takes_vllms_prompt_dicts(models):
    """{"prompt_token_ids": ids} and {"prompt": text} (vLLM's TokensPrompt, TextPrompt), one or
    a list; iterated as before, a dict's key names became the prompt text. Other keys, and a
    set of prompts (no order), are refused in one line."""
    llm = _llm(models["ouro"])
    kw = dict(max_tokens=3, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate([[1, 2, 3], "abc"], **kw)]
    assert [o.token_ids for o in llm.generate([{"prompt_token_ids": [1, 2, 3]}, {"prompt": "abc"}],
                                              **kw)] == expected
    one = llm.generate({"prompt_token_ids": [1, 2, 3]}, **kw)
    assert len(one) == 1 and one[0].token_ids == expected[0] and one[0].prompt_token_ids == [1, 2, 3]
    with pytest.raises(ValueError, match=r"^prompt 0: a prompt dict holds one key, 'prompt' \(text\) or "
                                         r"'prompt_token_ids', got \['multi_modal_data', 'prompt'\]$"):
        llm.generate({"prompt": "abc", "multi_modal_data": {}}, **kw)
    with pytest.raises(ValueError, match="^prompts must be a string, token ids or a list of them, got set$"):
        llm.generate({"ab", "cd"}, **kw)
    assert not llm.engine.has_unfinished()


def test_explicit_states_need_cover_only_the_positions_the_context_leaves(models):
    """A max_tokens past the context (cut there, finish 'length') asks explicit Huginn states
    for the positions that can be fed (max_context_len - 1), not prompt + max_tokens - 1."""
    model = models["huginn"]
    engine = _engine(model, EngineConfig(page_size=4, max_num_rows=2, max_context_len=16,
                                         max_prefill_tokens=8, prefill_token_buckets=(8,)))
    states = np.random.default_rng(0).standard_normal((15, model.cfg.hidden_size)).astype(np.float32)
    params = SamplingParams(max_tokens=100, ignore_eos=True, temperature=0.0)
    out = _run(engine, [(0, "long", [1, 2, 3], params, {"initial_state": states})])["long"]
    assert (len(out.token_ids), out.finish_reason) == (13, "length")
    with pytest.raises(ValueError, match=r"^initial_state must have shape \[>= 15, "):
        engine.add_request([1, 2, 3], params, initial_state=states[:14])


def test_max_tokens_none_generates_up_to_the_context(models):
    """max_tokens=None (vLLM's) runs until the context is full (finish 'length'), explicit Huginn
    states covering the positions fed (it was refused: "max_tokens must be an integer >= 1")."""
    model = models["huginn"]
    engine = _engine(model, EngineConfig(page_size=4, max_num_rows=2, max_context_len=16,
                                         max_prefill_tokens=8, prefill_token_buckets=(8,)))
    states = np.random.default_rng(0).standard_normal((15, model.cfg.hidden_size)).astype(np.float32)
    params = SamplingParams(max_tokens=None, ignore_eos=True, temperature=0.0)
    out = _run(engine, [(0, "open", [1, 2, 3], params, {"initial_state": states})])["open"]
    assert (len(out.token_ids), out.finish_reason) == (13, "length")


def test_generated_tokens_carry_vllms_rank_listed_first_among_their_top_logprobs(models):
    """GenerateOutput.ranks (vLLM's Logprob.rank): the device's rank over the vocabulary, or the
    token's place among its top logprobs when listed there (the fake device lists each token
    first and ranks it token % 3 + 1 over the vocabulary)."""
    llm = _llm(models["ouro"])
    plain, = llm.generate([1, 2], max_tokens=4, ignore_eos=True, logprobs=0)
    listed, = llm.generate([1, 2], max_tokens=4, ignore_eos=True, logprobs=1)
    assert plain.ranks == [t % 3 + 1 for t in plain.token_ids] and max(plain.ranks) > 1
    assert listed.token_ids == plain.token_ids and listed.ranks == [1] * 4
    assert llm.generate([1, 2], max_tokens=2)[0].ranks is None


def test_llm_refuses_more_samples_than_its_max_n_in_one_line(models):
    """A huge n was fanned out into that many requests (a hang, then memory): LLM.generate takes
    n up to DEFAULT_MAX_N, the server's default limit, refused in one line before anything is
    queued."""
    llm = _llm(models["ouro"])
    with pytest.raises(ValueError, match=r"^n must be in \[1, 16\] \(LLM's max_n\), got 17$"):
        llm.generate([1, 2], max_tokens=2, n=17, temperature=0.5)
    assert not llm.engine.has_unfinished()
    assert len(llm.generate([1, 2], max_tokens=1, n=16, temperature=0.5)) == 16


@pytest.mark.parametrize("state", [{"s0": 1}, [[1.0, 2.0], [3.0]], object()])
def test_an_initial_state_that_is_no_array_is_one_value_error(models, state):
    engine = _engine(models["huginn"], EngineConfig(page_size=4, max_num_rows=2, max_context_len=16,
                                                    max_prefill_tokens=8, prefill_token_buckets=(8,)))
    with pytest.raises(ValueError, match=r"^initial_state must be 'seeded', 'zero' or an array \[pos"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), initial_state=state)
    assert not engine.has_unfinished()


def test_a_device_that_cannot_take_a_new_state_refuses_every_later_step_in_one_line(models):
    """The state cannot be made anew after a failed read (the device is gone): the error says
    to build a new engine, and the real runner refuses each later step in one line (its plan's
    requests aborted) instead of running on no state."""
    config = EngineConfig(page_size=4, max_num_rows=2, max_context_len=16, max_prefill_tokens=8,
                          prefill_token_buckets=(8,))
    engine = _engine(models["ouro"], config)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=4), "a")
    engine.step()

    def gone(*args):
        raise RuntimeError("INTERNAL: device lost")
    engine.runner.read = engine.runner.reset_state = gone
    with pytest.raises(StepFailedError, match=r"; 1 running request aborted, no new KV pool "
                                              r"\(RuntimeError\): build a new engine$") as failed:
        engine.step()
    assert failed.value.request_ids == ["a"] and not failed.value.recovered
    real = Engine(models["ouro"], dataclasses.replace(config, warmup=False, verbose=False))
    real.runner.state = None  # what a failed Runner.reset_state leaves
    real.add_request([1, 2, 3], SamplingParams(max_tokens=4), "b")
    with pytest.raises(RuntimeError, match="^the device state was lost with a failed step and could not be "
                                           "made anew; build a new engine$"):
        real.step()
    assert [(o.request_id, o.finish_reason) for o in real.step()] == [("b", "abort")]
    assert real.stats()["pages_free"] == real.stats()["pages_total"]


def test_llm_names_the_keywords_given_beside_sampling_params(models):
    llm = _llm(models["ouro"])
    with pytest.raises(ValueError, match=r"^give sampling_params or sampling keyword arguments, not both "
                                         r"\(got max_tokens, temperature beside sampling_params\)$"):
        llm.generate([1, 2], SamplingParams(max_tokens=2), use_tqdm=False, max_tokens=3, temperature=0.5)
    for given in ("greedy", SamplingParams):  # a str's len was taken for a count of params
        with pytest.raises(ValueError, match=r"^sampling_params must be SamplingParams or a list of them "
                                             rf"\(one per prompt\), got {type(given).__name__}$"):
            llm.generate([1, 2], given)


def test_generate_refuses_an_empty_text_before_building_an_engine(models, monkeypatch):
    from loopjax import llm as llm_module

    built = []
    monkeypatch.setattr(llm_module, "LLM", lambda model, **options: built.append(options))
    model = dataclasses.replace(models["ouro"], tokenizer=_Letters())
    with pytest.raises(ValueError, match="^prompt 1: empty prompt: give at least one token id$"):
        loopjax.generate(model, ["ab", ""], max_new_tokens=2)
    assert built == []


def test_generate_refuses_a_prompt_past_its_engines_context_before_building_it(models, monkeypatch):
    from loopjax import llm as llm_module

    built = []
    monkeypatch.setattr(llm_module, "LLM", lambda model, **options: built.append(options))
    with pytest.raises(ValueError, match="^a prompt of 40 tokens leaves no room to generate within the "
                                         "engine's max_context_len=32$"):
        loopjax.generate(models["ouro"], [1] * 40, max_new_tokens=2, engine_options={"max_context_len": 32})
    assert built == []


def test_generate_takes_engine_options_with_lists(models, monkeypatch):
    """EngineConfig takes a list of ints for a tuple field; generate keyed its engine cache by
    the options and raised "unhashable type: 'list'"."""
    from loopjax import llm as llm_module

    built = []

    class NoEngine:
        def __init__(self, model, **options):
            self.model = model
            built.append(options)

        def generate(self, *args, **kwargs):
            return []

    monkeypatch.setattr(llm_module, "LLM", NoEngine)
    monkeypatch.setattr(llm_module, "_CACHE", {})
    for _ in range(2):
        loopjax.generate(models["ouro"], [1, 2], max_new_tokens=2,
                         engine_options={"max_num_rows": 4, "decode_row_buckets": [4]})
    assert len(built) == 1 and built[0]["decode_row_buckets"] == (4,)


class _Specials(_Letters):  # tokens divisible by 4 are special: "<t>", left out when skipped
    def decode(self, ids, skip_special_tokens=True):
        return "".join(("" if skip_special_tokens else f"<{t}>") if t % 4 == 0 else "abcdefgh"[t % 8]
                       for t in ids)


@pytest.mark.parametrize("stop", [(), ("zz",)])  # the text decoded once, or step by step (stop strings)
def test_skip_special_tokens_and_stop_tokens_in_the_text(models, stop):
    """skip_special_tokens=False keeps special tokens in the text (it was always True), and a
    stop token ending the output adds no text, special or not, as in vLLM."""
    config = EngineConfig(page_size=4, max_num_rows=2, max_context_len=32, max_prefill_tokens=8,
                          prefill_token_buckets=(1, 2, 4, 8), max_prefill_rows=1, max_loops=8)
    engine = _engine(models["ouro"], dataclasses.replace(config, async_scheduling=False))
    engine.model = dataclasses.replace(engine.model, tokenizer=_Specials())
    tok, params = _Specials(), SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0, stop=stop)
    keep = dataclasses.replace(params, skip_special_tokens=False)
    out = _run(engine, [(0, "skip", [1, 2, 3], params, {}), (0, "keep", [1, 2, 3], keep, {})])
    ids = out["skip"].token_ids
    assert out["keep"].token_ids == ids and any(t % 4 == 0 for t in ids)
    assert (out["skip"].text, out["keep"].text) == (tok.decode(ids), tok.decode(ids, False))
    k = next(i for i, t in enumerate(ids) if t % 4)  # stopped by a plain token: its letter is left out
    ended = _run(engine, [(0, "end", [1, 2, 3], dataclasses.replace(keep, stop_token_ids=(ids[k],)), {})])
    assert (ended["end"].token_ids, ended["end"].finish_reason) == (ids[:k + 1], "stop")
    assert ended["end"].text == tok.decode(ids[:k], False)


class _Spaced(_Letters):  # every token an added one, decoded with spaces between them
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(super().decode(ids))

    def get_added_tokens_decoder(self):
        return {t: types.SimpleNamespace(content=super(_Spaced, self).decode([t])) for t in range(256)}


def test_spaces_between_special_tokens_off_joins_added_tokens(models):
    """spaces_between_special_tokens=False (vLLM's field) gives consecutive added tokens their
    content alone, without the decoder's spaces, in the engine's (offline) text; with special
    tokens kept only, as vLLM's rule."""
    config = EngineConfig(page_size=4, max_num_rows=2, max_context_len=32, max_prefill_tokens=8,
                          prefill_token_buckets=(1, 2, 4, 8), max_prefill_rows=1, max_loops=8)
    engine = _engine(models["ouro"], dataclasses.replace(config, async_scheduling=False))
    engine.model = dataclasses.replace(engine.model, tokenizer=_Spaced())
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
    joined = dataclasses.replace(params, spaces_between_special_tokens=False, skip_special_tokens=False)
    out = _run(engine, [(0, "spaced", [1, 2, 3], params, {}), (0, "joined", [1, 2, 3], joined, {})])
    letters = _Letters().decode(out["spaced"].token_ids)
    # NOTE: the first token follows the prompt's, spaced as the decoder spaces them (vLLM's)
    assert (out["spaced"].text, out["joined"].text) == (" " + " ".join(letters), " " + letters)


def test_stop_reason_and_include_stop_str_in_output(models):
    """vLLM's stop_reason (the stop string, or the stop token id; None for an EOS or a length
    finish) and include_stop_str_in_output (the text keeps the stop string or stop token)."""
    config = EngineConfig(page_size=4, max_num_rows=2, max_context_len=32, max_prefill_tokens=8,
                          prefill_token_buckets=(1, 2, 4, 8), max_prefill_rows=1, max_loops=8)
    engine = _engine(models["ouro"], dataclasses.replace(config, async_scheduling=False))
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
    full = _run(engine, [(0, "full", [1, 2, 3], params, {})])["full"]
    assert (full.finish_reason, full.stop_reason) == ("length", None)
    text, ids = full.text, list(full.token_ids)
    stop = text[3:5]
    k = text.find(stop)
    cut = dataclasses.replace(params, stop=(stop,))
    kept = dataclasses.replace(cut, include_stop_str_in_output=True)
    out = _run(engine, [(0, "cut", [1, 2, 3], cut, {}), (0, "kept", [1, 2, 3], kept, {})])
    assert (out["cut"].text, out["cut"].finish_reason, out["cut"].stop_reason) == (text[:k], "stop", stop)
    assert (out["kept"].text, out["kept"].stop_reason) == (text[:k + 2], stop)
    by_id = dataclasses.replace(params, stop_token_ids=(ids[4],))
    j = ids.index(ids[4])
    by_id_kept = dataclasses.replace(by_id, include_stop_str_in_output=True)
    out = _run(engine, [(0, "id", [1, 2, 3], by_id, {}), (0, "id+", [1, 2, 3], by_id_kept, {})])
    assert (out["id"].text, out["id"].finish_reason, out["id"].stop_reason) == (text[:j], "stop", ids[4])
    assert (out["id+"].text, out["id+"].stop_reason) == (text[:j + 1], ids[4])
    engine._eos = engine._primary_eos = (ids[4],)  # the same token as the model's EOS: no stop_reason
    eos = _run(engine, [(0, "eos", [1, 2, 3], dataclasses.replace(params, ignore_eos=False), {})])["eos"]
    assert (eos.token_ids, eos.finish_reason, eos.stop_reason) == (ids[:j + 1], "stop", None)


class _LettersWithEos(_Letters):  # its tokenizer_config.json names "<eos>" (tokenizers' token_to_id)
    def __init__(self, eos: int):
        self.eos = eos

    def token_to_id(self, token):
        return self.eos if token == "<eos>" else None


def test_stop_reason_of_generation_config_eos_ids(models, tmp_path):
    """vLLM's rule: the tokenizer's EOS stops with stop_reason None; generation_config.json's
    other EOS ids (Ouro's <|im_end|>) join the stop ids, so a stop at one gives its id."""
    config = EngineConfig(page_size=4, max_num_rows=2, max_context_len=32, max_prefill_tokens=8,
                          prefill_token_buckets=(1, 2, 4, 8), max_prefill_rows=1, async_scheduling=False)
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
    ids = list(_run(_engine(models["ouro"], config), [(0, "full", [1, 2, 3], params, {})])["full"].token_ids)
    extra, primary = ids[2], next(t for t in ids[3:] if t not in ids[:3])  # first seen at 2 and later
    assert extra not in ids[:2]
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<eos>"}')
    model = dataclasses.replace(models["ouro"], path=str(tmp_path),
                                generation_config={"eos_token_id": [primary, extra]})
    stopping = dataclasses.replace(params, ignore_eos=False)
    for eos, reason in ((primary, extra), (extra, None)):  # the first stop is `extra`: at token 2
        engine = engine_on_fake_device(model, config, _LettersWithEos(eos))
        out = _run(engine, [(0, "r", [1, 2, 3], stopping, {})])["r"]
        assert (out.token_ids, out.finish_reason, out.stop_reason) == (ids[:3], "stop", reason)


def test_generation_config_eos_ids_replace_config_json_ones(models):
    """HF generate stops at generation_config.json's eos_token_id where the file exists (vLLM too,
    besides the tokenizer's EOS); config.json's counts only where there is none. The engine
    stopped at config.json's ids as well."""
    from loopjax.config import eos_token_ids

    cfg = dataclasses.replace(models["ouro"].cfg, eos_token_id=(3, 4))
    assert eos_token_ids(cfg) == eos_token_ids(cfg, None) == (3, 4)
    assert eos_token_ids(cfg, {"eos_token_id": 5}) == (5,) and eos_token_ids(cfg, {}) == ()
    assert eos_token_ids(cfg, {"eos_token_id": [5, 7]}, tokenizer_eos=7) == (7, 5)
    config = EngineConfig(page_size=4, max_num_rows=2, max_context_len=32, max_prefill_tokens=8,
                          prefill_token_buckets=(1, 2, 4, 8), max_prefill_rows=1, async_scheduling=False)
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
    ids = list(_run(_engine(models["ouro"], config), [(0, "full", [1, 2, 3], params, {})])["full"].token_ids)
    first, later = ids[1], next(t for t in ids[2:] if t not in ids[:2])
    assert first not in ids[:1]
    model = dataclasses.replace(models["ouro"], cfg=dataclasses.replace(cfg, eos_token_id=first),
                                generation_config={"eos_token_id": later})
    stopping = dataclasses.replace(params, ignore_eos=False)
    out = _run(_engine(model, config), [(0, "r", [1, 2, 3], stopping, {})])["r"]
    assert (out.token_ids, out.finish_reason) == (ids[:ids.index(later) + 1], "stop")


class _Words:  # a tokenizer of words "t<id>", so that bad words can name any token sequence
    def decode(self, ids, skip_special_tokens=True):
        return "".join(f" t{t}" for t in ids)

    def encode(self, text, add_special_tokens=True):
        return types.SimpleNamespace(ids=[int(word[1:]) for word in text.split()])


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_bad_words_never_complete_on_the_fake_device(models, async_scheduling):
    """bad_words of 1-3 tokens taken from each request's plain output: the output never holds
    them and is the plain output up to where that first completed one (the fake device bans as
    the real one: a ban after a token checks the slot's last token; it asserts that a prefill
    row's bans are all outright and a decode row's slot holds its input). The host's part
    counted a token not yet sampled as pending (this plan's own), so with nothing in flight a
    3-token word was checked one token off and let through."""
    config = EngineConfig(page_size=4, max_num_rows=4, max_context_len=48, max_prefill_tokens=8,
                          prefill_token_buckets=(8,), max_prefill_rows=2, max_loops=8,
                          async_scheduling=async_scheduling)
    engine = engine_on_fake_device(models["ouro"], config, _Words())
    prompts = {f"r{i}": [3 + i, 40 + i, 7, 9 + i] for i in range(6)}
    kw = [dict(temperature=0.0), dict(temperature=0.8, seed=5)]
    params = {rid: SamplingParams(max_tokens=16, ignore_eos=True, **kw[i % 2])
              for i, rid in enumerate(prompts)}
    items = [(0, rid, p, params[rid], {}) for rid, p in prompts.items()]
    plain = {rid: out.token_ids for rid, out in _run(engine, items).items()}
    for length in (1, 2, 3):
        banned = {rid: out[8 - length:8] for rid, out in plain.items()}  # ends at token 7
        words = {rid: dataclasses.replace(params[rid], bad_words=(_Words().decode(seq),))
                 for rid, seq in banned.items()}
        got = _run(engine, [(0, rid, p, words[rid], {}) for rid, p in prompts.items()])
        for rid, out in got.items():
            seq, ids = banned[rid], out.token_ids
            end = next(i for i in range(length - 1, len(ids)) if plain[rid][i - length + 1:i + 1] == seq)
            assert ids[:end] == plain[rid][:end] and ids[end] != plain[rid][end], (length, rid)
            assert all(ids[i:i + length] != seq for i in range(len(ids))), (length, rid)


def test_explicit_states_with_a_truncated_prompt_are_refused(models):
    """truncate_prompt_tokens keeps a prompt's tail, and explicit Huginn states are given per
    position of the prompt as sent: they were applied from the first kept token on (another
    position's state, silently). Refused in one line by the engine, LLM.generate and
    loopjax.generate (before an engine is built); a state mode still truncates."""
    model = models["huginn"]
    llm, hidden = _llm(model), model.cfg.hidden_size
    states = np.zeros((8, hidden), np.float32)
    params = SamplingParams(max_tokens=2, ignore_eos=True, truncate_prompt_tokens=3)
    message = r"^truncate_prompt_tokens cut the prompt from 6 to 3 tokens, and initial_state gives states"
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request([1, 2, 3, 4, 5, 6], params, "r", initial_state=states)
    with pytest.raises(ValueError, match=message):
        llm.generate([1, 2, 3, 4, 5, 6], params, initial_state=states)
    with pytest.raises(ValueError, match=message):
        loopjax.generate(model, [1, 2, 3, 4, 5, 6], max_new_tokens=2, truncate_prompt_tokens=3,
                         initial_state=states)
    one = dataclasses.replace(params, truncate_prompt_tokens=1)  # "1 token", not "1 tokens"
    with pytest.raises(ValueError, match=r"^truncate_prompt_tokens cut the prompt from 6 to 1 token, and"):
        llm.engine.add_request([1, 2, 3, 4, 5, 6], one, "r", initial_state=states)
    assert not llm.engine.has_unfinished()
    assert llm.generate([1, 2, 3, 4, 5, 6], params, initial_state="zero")[0].token_ids
    assert llm.generate([1, 2, 3], params, initial_state=states)[0].token_ids  # nothing cut


def test_the_tokenizers_eos_token_stops_a_request(models, tmp_path):
    """The tokenizer's eos_token (tokenizer_config.json / special_tokens_map.json) ends a
    request as config.json's EOS does: vLLM's primary EOS is the tokenizer's; a checkpoint
    whose tokenizer names another EOS than its config ran past it."""
    import json

    from tokenizers import Tokenizer
    from tokenizers import models as token_models

    config = EngineConfig(page_size=4, max_num_rows=2, max_context_len=32, max_prefill_tokens=8,
                          prefill_token_buckets=(1, 2, 4, 8), max_prefill_rows=1, max_loops=8)
    model = models["ouro"]
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
    ids = _run(_engine(model, config), [(0, "free", [1, 2, 3], params, {})])["free"].token_ids
    k = next(i for i, t in enumerate(ids) if t != model.cfg.eos_token_id and t not in ids[:i])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": f"w{ids[k]}"}))
    tok = Tokenizer(token_models.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w0"))
    engine = engine_on_fake_device(dataclasses.replace(model, path=str(tmp_path)), config, tok)
    out = _run(engine, [(0, "eos", [1, 2, 3], dataclasses.replace(params, ignore_eos=False), {})])["eos"]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (ids[:k + 1], "stop", None)


def test_cache_salt_shares_pages_only_within_one_salt(models):
    """vLLM's cache_salt: a cached prompt's pages serve a later request of the same salt only (one
    of another salt, or none, prefills its own), and its tokens are those of an unsalted run."""
    config = EngineConfig(page_size=4, max_num_rows=2, max_context_len=32, max_prefill_tokens=16,
                          prefill_token_buckets=(16,), max_prefill_rows=2, enable_prefix_caching=True)
    engine = _engine(models["ouro"], config)
    prompt = list(range(1, 11))  # two full pages to share
    tokens, hits = {}, []
    for rid, salt in (("a", "x"), ("other salt", "y"), ("no salt", None), ("same salt", "x")):
        params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0, cache_salt=salt)
        before = engine.stats()["prefix_cache_hit_pages"]
        tokens[rid] = _run(engine, [(0, rid, prompt, params, {})])[rid].token_ids
        hits.append(engine.stats()["prefix_cache_hit_pages"] - before)
    assert hits == [0, 0, 0, 2] and len({tuple(t) for t in tokens.values()}) == 1
    with pytest.raises(ValueError, match="^cache_salt must be a non-empty string"):
        SamplingParams(cache_salt="")


def test_llm_takes_the_models_sampling_defaults_for_what_a_call_leaves_unset(models):
    """vLLM's generation_config "auto": generation_config.json's sampling values (max_new_tokens as
    max_tokens) are get_default_sampling_params() and the defaults of generate's keywords; what a
    call sets wins (it read only the EOS ids there)."""
    model = dataclasses.replace(models["ouro"], generation_config={"temperature": 0.6, "max_new_tokens": 2,
                                                                   "top_k": 50, "eos_token_id": 2})
    llm = _llm(model)
    assert llm.sampling_defaults == {"temperature": 0.6, "max_tokens": 2}  # top_k 50: HF's default, not read
    default = llm.get_default_sampling_params()
    assert (default.temperature, default.max_tokens, default.top_k) == (0.6, 2, 0)
    assert len(llm.generate([1, 2, 3], ignore_eos=True)[0].token_ids) == 2
    assert len(llm.generate([1, 2, 3], ignore_eos=True, max_new_tokens=4)[0].token_ids) == 4


def test_prompt_check_reads_ids_of_any_integer_type_and_refuses_bools():
    """check_prompt_ids (vectorized: a long prompt's check was most of add_request): the ids as
    Python ints whatever their integer type; a bool of either kind anywhere refused; the first
    id outside the vocabulary named."""
    from loopjax.request import check_prompt_ids

    ids = check_prompt_ids([np.int32(4), 5, np.int64(6)], 256)
    assert ids == [4, 5, 6] and all(type(t) is int for t in ids)
    assert check_prompt_ids(np.arange(3, dtype=np.uint16), 256) == [0, 1, 2]
    for bad in ([5] * 1000 + [True], [np.bool_(True), 3], np.ones(2, bool)):
        with pytest.raises(ValueError, match="^prompt_token_ids must be a flat list of integer token ids$"):
            check_prompt_ids(bad, 256)
    with pytest.raises(ValueError, match=r"^token id 300 is outside the vocabulary \[0, 256\)$"):
        check_prompt_ids([1, 300, -1, 400], 256)


def test_unseeded_params_draw_a_seed_per_request_and_stop_at_eos(models):
    """add_request copies a request's params once for both changes: shared unseeded params draw
    an independent seed per request, and the EOS joins the stop ids (once); the caller's params
    stay as given."""
    engine = _engine(models["ouro"], EngineConfig(page_size=4, max_num_rows=2, max_context_len=32,
                                                  max_prefill_tokens=8, prefill_token_buckets=(8,)))
    assert engine._eos
    params = SamplingParams(max_tokens=2, temperature=0.8, stop_token_ids=[engine._eos[0], 5])
    got = [engine.scheduler.get(engine.add_request([1, 2, 3], params)).sampling_params for _ in range(6)]
    assert len({p.seed for p in got}) > 1 and params.seed not in {p.seed for p in got}
    assert all(p.stop_token_ids == tuple(dict.fromkeys((engine._eos[0], 5, *engine._eos))) for p in got)
    assert params.stop_token_ids == (engine._eos[0], 5)
    seeded = engine.scheduler.get(engine.add_request([1, 2, 3], dataclasses.replace(params, seed=9)))
    assert seeded.sampling_params.seed == 9
