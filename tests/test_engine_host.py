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
from fake_device import FakeDevice

import loopjax
from loopjax.engine import Engine, EngineConfig
from loopjax.sampling_params import SamplingParams

MODELS = {"ouro": "tests/data/ouro", "huginn": "tests/data/huginn/huginn_shape_242"}


@pytest.fixture(scope="module")
def models():
    return {family: loopjax.load(path) for family, path in MODELS.items()}


class _Letters:  # a tokenizer: token t is one letter, so stop strings match often
    def decode(self, ids, skip_special_tokens=True):
        return "".join("abcdefgh"[t % 8] for t in ids)


def _engine(model, config: EngineConfig) -> Engine:
    model = dataclasses.replace(model, tokenizer=_Letters())
    engine = Engine(model, dataclasses.replace(config, warmup=False, verbose=False))
    cfg = model.cfg
    engine.runner = FakeDevice(engine.runner.max_rows, config.page_size, cfg.vocab_size,
                               huginn=cfg.family == "huginn")
    return engine


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


def check_engine(engine) -> None:
    """After a step: the pool's invariants hold, and each token / carry slot is held once or free."""
    engine.scheduler.block_manager.check(engine.scheduler.requests.values())
    for kind, free in (("token_slot", engine._free_token_slots), ("carry_slot", engine._free_carry)):
        held = [getattr(x, kind) for x in engine._extra.values() if getattr(x, kind) is not None]
        assert sorted(held + free) == list(range(engine.runner.max_rows)), kind


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
    content alone, without the decoder's spaces, in the engine's (offline) text."""
    config = EngineConfig(page_size=4, max_num_rows=2, max_context_len=32, max_prefill_tokens=8,
                          prefill_token_buckets=(1, 2, 4, 8), max_prefill_rows=1, max_loops=8)
    engine = _engine(models["ouro"], dataclasses.replace(config, async_scheduling=False))
    engine.model = dataclasses.replace(engine.model, tokenizer=_Spaced())
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
    joined = dataclasses.replace(params, spaces_between_special_tokens=False)
    out = _run(engine, [(0, "spaced", [1, 2, 3], params, {}), (0, "joined", [1, 2, 3], joined, {})])
    letters = _Letters().decode(out["spaced"].token_ids)
    assert (out["spaced"].text, out["joined"].text) == (" ".join(letters), letters)


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
    engine._eos = (ids[4],)  # the same token as the model's EOS: it stops with no stop_reason
    eos = _run(engine, [(0, "eos", [1, 2, 3], dataclasses.replace(params, ignore_eos=False), {})])["eos"]
    assert (eos.token_ids, eos.finish_reason, eos.stop_reason) == (ids[:j + 1], "stop", None)
