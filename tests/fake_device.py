"""A fake device for Engine tests: the Runner's dispatch / read over plain Python state, so a
test runs the Engine's host side (token and carry slots, token histories, inputs on the device,
Huginn s0 rows, stop strings, aborts, preemption) over many random workloads, no compile.

- The fake model's next token is a hash of what a real one's depends on: the row's context,
  each position's s0 (Huginn: its explicit state, (seed, position), zero, or the warm state
  carried from the previous token), a drawing row's seed and token index, and the token
  history of a row that processes logits (penalties, logit_bias); stop ids are suppressed
  before min_tokens. Exit loops: the row's depth, or (exit rule) a hash of its context.
- KV: a slot (physical page, plane, offset) holds (position, tokens up to it, s0 chain); a
  step reads its row's context back through its page list and fails on a slot that holds
  another request's or another prefix's KV.
- Device state as the Engine's contract has it (docs/design.md "The engine loop"): last-token
  slots (an emitting row writes its own, the others the spare last one), token histories
  (started by a prefill row's reset, counted by full-sampler steps), the per-loop carry (loops
  in order) and the warm state (written by a row's last loop, read by a warm decode row).
  It asserts the protocol: distinct token and carry slots in a step, an input on the device
  only from a slot a step wrote, explicit states covering their row's tokens.
"""

from __future__ import annotations

import hashlib

import numpy as np

from loopjax.batch import INIT_EXPLICIT, INIT_SEEDED, INIT_WARM, INIT_ZERO, StepResult


def _hash(*items) -> int:
    return int.from_bytes(hashlib.blake2b(repr(items).encode(), digest_size=4).digest(), "little")


class FakeDevice:
    def __init__(self, max_rows: int, page_size: int, vocab_size: int, huginn: bool):
        self.max_rows, self.page_size, self.vocab_size, self.huginn = max_rows, page_size, vocab_size, huginn
        self.reset_state()
        self.submissions = self.compilations = 0
        self.compile_times: dict = {}

    def reset_state(self) -> None:
        """Empty device state (Runner.reset_state): no slot, history, carry or KV survives."""
        slots = self.max_rows + 1  # the last one: padding rows' and non-emitting rows'
        self.last_tokens: list[int | None] = [None] * slots
        self.history: list[list[int] | None] = [None] * slots  # per token slot: prompt + outputs
        self.carry: list[tuple | None] = [None] * slots         # per-loop: (context, loops done)
        self.warm: list[int | None] = [None] * slots
        self.pool: dict[tuple[int, int, int], tuple] = {}

    def dispatch(self, rows, *, decode, loop_begin=0, num_loops=None, series=False, num_rows=0,
                 num_tokens=0) -> StepResult | None:
        self.submissions += 1
        assert len(rows) <= num_rows and sum(len(r.token_ids) for r in rows) <= num_tokens
        for name in ("token_slot", "carry_slot"):
            held = [getattr(r, name) for r in rows if getattr(r, name) is not None]
            assert len(held) == len(set(held)), f"two rows of a step share a {name}"
        full_sampler = not decode or series or not all(r.params.is_plain_greedy for r in rows)
        out = [self._row(r, decode, loop_begin, num_loops, series, full_sampler) for r in rows]
        if series and not any(r.emits for r in rows):
            return None  # a non-final per-loop submission: nothing to read
        tokens = np.array([t for t, _ in out], np.int32)
        logprobs = -tokens.astype(np.float32) / 100
        return StepResult(tokens, np.array([e for _, e in out], np.int32), logprobs,
                          np.stack([tokens, tokens + 1], 1), np.stack([logprobs, logprobs], 1),
                          tokens % 3 + 1)

    def read(self, pending: StepResult | None) -> StepResult | None:
        return pending

    def _row(self, row, decode, loop_begin, num_loops, series, full_sampler) -> tuple[int, int]:
        ids, start = list(row.token_ids), row.start_pos
        if row.input_on_device:
            assert row.token_slot is not None and self.last_tokens[row.token_slot] is not None
            ids[-1] = self.last_tokens[row.token_slot]
        end = start + len(ids)
        context, chain = [], []
        for p in range(start):  # the row's context, read back through its page list
            entry = self.pool.get(self._slot(row, p))
            assert entry is not None and entry[0] == p, f"position {p}: slot holds {entry}"
            assert list(entry[1][:-1]) == context, f"position {p}: KV of another prefix"
            context, chain = list(entry[1]), chain + [entry[2]]
        context += ids
        for p, s0 in zip(range(start, end), self._s0(row, start, end)):
            chain.append(_hash(chain[-1] if chain else None, s0))
            self.pool[self._slot(row, p)] = (p, tuple(context[:p + 1]), chain[-1])
        if series:  # the loop state carried between one-loop submissions
            if loop_begin > 0:
                assert self.carry[row.carry_slot] == (tuple(context), loop_begin), "loops out of order"
            self.carry[row.carry_slot] = (tuple(context), loop_begin + num_loops)
        if row.history is not None:
            assert not decode and row.token_slot is not None, "a history starts in a prefill row"
            prompt, outputs, _, _ = row.history
            self.history[row.token_slot] = list(prompt) + list(outputs)
        last_loop = not series or loop_begin + num_loops >= row.loops
        if row.carry_slot is not None and last_loop:
            self.warm[row.carry_slot] = _hash("warm", chain[-1])
        if not row.emits:
            return -1, -1
        params, index = row.params, row.token_index
        key = [tuple(context), chain[-1]]
        if params.processes_logits:
            assert self.history[row.token_slot] == context, "token history out of step"
            key.append("history")
        if not params.is_greedy:
            key += [params.seed, index]
        token = _hash(*key) % self.vocab_size
        # bad_words: a ban after a token applies where the row's last token (its slot's: a
        # decode row's input) is that token; a prefill row's are all outright
        prev = self.last_tokens[row.token_slot]
        assert decode or all(after < 0 for _, after in row.bans), "a prefill row's ban awaits a token"
        assert not decode or prev == ids[-1], "a decode row's slot holds another token than its input"
        banned = {t for t, after in row.bans if after < 0 or after == prev}
        while token in banned or (index < params.min_tokens and token in params.stop_token_ids):
            token = (token + 1) % self.vocab_size
        self.last_tokens[row.token_slot] = token
        if full_sampler and self.history[row.token_slot] is not None:
            self.history[row.token_slot].append(token)
        exit_loop = row.loops
        if row.exit_skip or row.exit_spec is not None:
            exit_loop = 1 + _hash("exit", tuple(context)) % row.loops
        return token, exit_loop

    def _slot(self, row, position: int) -> tuple[int, int, int]:
        i = position // self.page_size
        plane = -1 if row.page_planes is None else row.page_planes[i]
        return row.pages[i], plane, position % self.page_size

    def _s0(self, row, start: int, end: int) -> list:
        """Each fed token's initial state, as an id (Huginn; Ouro has none)."""
        if not self.huginn:
            return [None] * (end - start)
        if row.init_mode == INIT_EXPLICIT:
            assert row.init_states is not None and len(row.init_states) == end - start, \
                "explicit states do not cover the row's tokens"
            return [state.tobytes() for state in row.init_states]
        if row.init_mode == INIT_SEEDED:
            return [("seeded", row.init_seed, p) for p in range(start, end)]
        if row.init_mode == INIT_ZERO:
            return [("zero",)] * (end - start)
        assert row.init_mode == INIT_WARM and row.decoded and self.warm[row.carry_slot] is not None
        return [self.warm[row.carry_slot]]


def engine_on_fake_device(model, config, tokenizer=None):
    """An Engine of `model`'s shapes (with `tokenizer`, if given) whose runner is a FakeDevice:
    no warm-up, nothing compiles."""
    import dataclasses

    from loopjax.engine import Engine

    if tokenizer is not None:
        model = dataclasses.replace(model, tokenizer=tokenizer)
    engine = Engine(model, dataclasses.replace(config, warmup=False, verbose=False))
    cfg = model.cfg
    engine.runner = FakeDevice(engine.runner.max_rows, config.page_size, cfg.vocab_size,
                               huginn=cfg.family == "huginn")
    return engine
