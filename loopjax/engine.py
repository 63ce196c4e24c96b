"""Engine: continuous batching over the paged depth-plane KV pool.

`step()` is schedule -> run -> update: the scheduler (pure Python) plans one step, the runner
turns the plan into a StepBatch and dispatches one jitted submission, and the update reads it
back, applies the sampled tokens (stop strings, metrics) and reports a `RequestOutput` per
request that got a token or finished. The host reads back only the sampled tokens and exit
loops of a step, once per submission. With `async_scheduling` (the default) the loop is
pipelined: step() plans and dispatches step n+1 before it reads and applies step n, so the
device works while the host plans; a token not read yet reaches step n+1 on the device
(scheduler.py, "Planning ahead"). Every request that emits holds a token slot (its last
sampled token on the device) from its first emitting step until it finishes or is preempted.

Contracts: `add_request` raises a one-line ValueError for bad input and queues nothing then;
every request's pages return to the pool when it finishes, is aborted or preempted
(scheduler); nothing compiles after start-up with `EngineConfig.strict_compile`. An exception
in `step()` (Ctrl-C while it waits for the device or compiles a step) leaves the engine usable:
a step not yet read stays queued, one whose dispatch raised is dropped and its requests aborted.
One whose update raised reports what it applied and aborts the rest. A read that raises an
Exception (a device error) loses the steps in flight and maybe the donated device state: every
admitted request is aborted (reported by the next step), the prefix cache forgotten and the
state made anew; step() raises one line, waiting and new requests run on (engine_failures.py).
Adaptive requests (exit_mode='skip', a Huginn exit_criterion, exit_trace, warm start) are planned
as fixed-depth rows: the device decides their exits inside the same submission. Engine-side
per-request data (Huginn s0 rule, exit settings, bad_words, slots): request_extra.RequestExtra.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections import deque

import numpy as np

from loopjax import attention_backend, bad_words, kv_cache, tokenizer_files
from loopjax.batch import INIT_EXPLICIT, INIT_WARM, RowInput, StepResult
from loopjax.compilation import compile_totals
from loopjax.config import eos_token_ids
from loopjax.engine_config import OPTION_CHOICES, EngineConfig
from loopjax.engine_failures import EngineFailures
from loopjax.matmul_ops import matmul_ops
from loopjax.pointwise_ops import with_pointwise
from loopjax.request import (
    FINISH_STOP,
    Request,
    RequestOutput,
    check_exit_depth,
    check_prompt_ids,
)
from loopjax.request_extra import (
    RequestExtra,
    cache_salt,
    check_state_truncation,
    record_logprobs,
    request_extra,
    request_output,
    update_text,
)
from loopjax.runner import PendingStep, Runner
from loopjax.sampling import check_suppressible
from loopjax.sampling_params import MAX_LOGPROBS, SamplingParams, check_for_model
from loopjax.scheduler import Scheduler, SchedulerConfig, StepOutput
from loopjax.scheduler import StepKind as PlanKind
from loopjax.step_plan import default_decode_row_buckets


class Engine(EngineFailures):
    def __init__(self, model, config: EngineConfig | None = None):
        config = EngineConfig() if config is None else config
        config.check_family(model.cfg.family)
        self.model, self.config, cfg = model, config, model.cfg
        self.max_loops = config.max_loops or cfg.default_loops
        max_context = config.context_len(cfg.max_context_len)
        if max_context > cfg.max_context_len:
            raise ValueError(f"max_context_len {max_context} exceeds the model's {cfg.max_context_len}")
        if any(n > self.max_loops for n in config.loop_buckets):
            raise ValueError(f"EngineConfig.loop_buckets entry {max(config.loop_buckets)} exceeds "
                             f"max_loops={self.max_loops}")
        if max(config.decode_context_buckets, default=0) > max_context:  # NOTE: it compiled nothing
            raise ValueError(f"EngineConfig.decode_context_buckets entry {max(config.decode_context_buckets)}"
                             f" exceeds max_context_len={max_context}")
        if not 0 <= config.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"max_logprobs must be in [0, {MAX_LOGPROBS}], got {config.max_logprobs}")
        for name, known in OPTION_CHOICES.items():  # NOTE: an unknown matmul failed after the pool
            if (value := getattr(config, name)) not in known:
                raise ValueError(f"EngineConfig.{name} must be one of {', '.join(known)}, got {value!r}")
        layout = kv_cache.make_layout(cfg, config.kv_layout, page_size=config.page_size, dtype=model.dtype,
                                      num_pages=config.num_pages, kv_memory_bytes=config.kv_memory_bytes,
                                      max_loops=self.max_loops, shared_slots=config.shared_kv_slots,
                                      # full contexts, each in whole pages
                                      default_tokens=config.max_num_rows * config.page_size
                                      * -(-max_context // config.page_size), min_tokens=max_context)
        kv_cache.check_holds_context(layout, max_context)
        attention_backend.check_attention_backend(layout, config.attention_backend, cfg)
        if config.verbose:
            print(layout.describe(), flush=True)
        self.layout = layout
        sc = SchedulerConfig(
            page_size=config.page_size, num_pages=layout.num_pages, max_num_rows=config.max_num_rows,
            decode_row_buckets=config.decode_row_buckets or default_decode_row_buckets(max_context),
            max_prefill_tokens=config.max_prefill_tokens,
            prefill_token_buckets=config.prefill_token_buckets,
            max_prefill_rows=config.max_prefill_rows, max_context_len=max_context,
            max_prefill_batches_before_decode=config.max_prefill_batches_before_decode,
            prefill_share_per_loop=config.prefill_share_per_loop,
            num_loops=min(cfg.default_loops, self.max_loops), max_loops=self.max_loops,
            fused_decode=config.fused_decode, enable_prefix_caching=config.enable_prefix_caching,
            decode_page_planes=layout.decode_page_planes)
        self.runner = Runner(model, layout, decode_rows=sc.row_buckets,
                             prefill_buckets=tuple((sc.max_prefill_rows, t) for t in sc.token_buckets),
                             max_pages=sc.max_pages_per_request, max_loops=self.max_loops,
                             backend=config.attention_backend,
                             num_top_logprobs=min(config.max_logprobs, cfg.vocab_size),
                             strict=config.strict_compile,
                             decode_page_widths=tuple(-(-c // config.page_size)
                                                      for c in config.decode_context_buckets),
                             ops=with_pointwise(matmul_ops(config.matmul), config.pointwise),
                             unroll=config.loop_unroll,
                             compilation_cache_dir=config.compilation_cache_dir)
        self.scheduler = Scheduler(sc, loop_count=self.runner.fused_loop_count)  # warmup may add counts
        # Runner.warmup / warmup_steps options: the executables this config compiles at start-up
        self.warmup_options = dict(loop_counts=(min(cfg.default_loops, self.max_loops), *config.loop_buckets),
                                   series=not config.fused_decode, adaptive=config.adaptive_exit,
                                   weighted=config.enable_weighted_exit)
        if config.warmup:
            self.runner.warmup(**self.warmup_options, threads=config.compile_threads)
        self._extra: dict[str, RequestExtra] = {}
        self._free_carry = list(range(self.runner.max_rows - 1, -1, -1))
        self._free_token_slots = list(range(self.runner.max_rows - 1, -1, -1))
        self._in_flight: deque = deque()  # (plan, runner.PendingStep), dispatched, not yet read
        self._aborted: list[RequestOutput] = []
        # vLLM's primary EOS (stop_reason None): the tokenizer's, else config.json's (no tokenizer)
        eos = tokenizer_files.eos_token_id(model.tokenizer, getattr(model, "path", None))
        self._eos = eos_token_ids(cfg, getattr(model, "generation_config", None), eos)
        self._primary_eos = eos_token_ids(cfg) if eos is None else (eos,)
        self._default_exit_threshold = getattr(cfg, "early_exit_threshold", None)  # Ouro configs have one
        # NOTE: an Ouro config's early_exit_step comes before its threshold, as the reference's
        # exit_at_step and models/ouro.forward (so scoring); a shallower request skips it (_row)
        self._default_exit_step = getattr(cfg, "early_exit_step", None)
        self.num_generated = self.loops_generated = 0

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, *, initial_state=None,
                    warm_start: bool = False) -> str:
        """Queue a request; returns its id (`request_id`, a str, or a fresh one). initial_state
        (Huginn): None (the engine default), 'zero', 'seeded', or explicit s0 per position
        [>= prompt + max_tokens - 1, H] (max_tokens counted up to the context).
        warm_start (Huginn): each generated token's s0 is ln_f of the previous token's final
        state (the reference's `generate_minimal(continuous_compute=True)`); the prompt's
        s0 follow initial_state."""
        if request_id is not None and not isinstance(request_id, str):  # NOTE: ids key dicts, logs, JSON
            raise ValueError(f"request_id must be a str (or None: a fresh one), got "
                             f"{type(request_id).__name__}")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if params.n != 1:  # NOTE: one engine request is one sample; fan-out is the caller's
            raise ValueError(f"n={params.n}: a request is one sample; submit params.fan_out() instead")
        given = check_prompt_ids(prompt_token_ids, self.model.cfg.vocab_size)
        prompt = params.truncate(given)
        check_state_truncation(initial_state, len(given), len(prompt))
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise ValueError(f"logprobs={params.logprobs} exceeds this engine's max_logprobs="
                             f"{self.config.max_logprobs}")
        check_for_model(params, self.model.cfg, has_tokenizer=self.model.tokenizer is not None,
                        warm_start=warm_start)
        if params.loops is not None and params.loops > self.max_loops:
            raise ValueError(f"loops={params.loops} exceeds this engine's max_loops={self.max_loops}")
        depth = params.loops if params.loops is not None else self.scheduler.config.num_loops
        check_exit_depth(params, depth, weighted_steps=self.config.enable_weighted_exit,
                         fused=self.config.fused_decode,
                         adaptive_steps=self.config.adaptive_exit or not self.config.strict_compile
                         or not self.config.fused_decode)  # unfused: refused below, naming fused_decode
        # NOTE: explicit states cover the positions fed: max_tokens counts up to the context only
        outputs = params.output_budget(max(1, self.scheduler.config.max_seq_len - len(prompt)))
        extra = request_extra(self.model, params, initial_state, self.config.huginn_init,
                              len(prompt) + (0 if warm_start else outputs - 1), warm_start)
        changes = {}  # NOTE: one copy for both (a copy validates every field again: ~40 us)
        if params.seed_drawn:  # NOTE: one unseeded params for many requests: independent draws (vLLM's)
            changes["seed"] = None
        if not params.ignore_eos and self._eos:
            # NOTE: an EOS id the request names too counts once (min_tokens masks a bounded number)
            changes["stop_token_ids"] = tuple(dict.fromkeys(params.stop_token_ids + self._eos))
        if changes:
            params = dataclasses.replace(params, **changes)
        check_suppressible(params, len(extra.bad_words))  # before anything is queued
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        # NOTE: adaptive rows are planned as fixed-depth (fused): the device decides the exits.
        adaptive = params.stops_adaptively or extra.warm
        if adaptive and not self.config.fused_decode:
            raise ValueError("adaptive exits and warm start run on device in fused steps; this "
                             "engine has fused_decode=False")
        # NOTE: a ring that wraps within the depth reads an earlier step's tokens otherwise than
        # one prefill: the prompt is one step, its pages neither cached nor taken from the cache
        whole = extra.exit_spec is not None or self.layout.ring_wraps(depth)
        salt = None if adaptive or whole else cache_salt(extra, self.model.cfg, self.config.huginn_seed,
                                                         params.cache_salt)
        request = Request(request_id, prompt, params, max_loops=params.loops, whole_prefill=whole,
                          cache_salt=salt)
        self.scheduler.add(request)  # raises ValueError (one line) and queues nothing
        self._extra[request_id] = extra
        return request_id

    def shares_prefix(self, params: SamplingParams) -> bool:
        """Whether a request of `params` (no explicit s0, no warm start) takes and publishes
        prefix-cache pages, the cache on: not with an adaptive exit, nor where a Huginn ring
        wraps within its depth (add_request prefills its prompt in one step)."""
        depth = params.loops if params.loops is not None else self.scheduler.config.num_loops
        return (self.config.enable_prefix_caching and not params.stops_adaptively
                and not self.layout.ring_wraps(depth))

    def abort(self, request_id: str) -> bool:
        request = self.scheduler.abort(request_id)
        if request is not None:
            self._report_ended([request])
        return request is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted) or bool(self._in_flight)

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """schedule -> run -> update; pipelined (async_scheduling): plan and dispatch the next
        step while one is in flight, then read and apply the oldest."""
        while self._may_schedule() and (plan := self.scheduler.schedule()) is not None:
            try:
                self._in_flight.append((plan, self._run(plan)))
            except BaseException:  # e.g. Ctrl-C while a step compiles: the plan never ran
                self._drop_dispatch(plan)
                raise
        if not self._in_flight:
            return self._update(None, None)
        # NOTE: the oldest step leaves the queue only once it is read: an interrupt while the
        # host waits for the device (Ctrl-C, no Exception) leaves the engine as it was
        try:
            result = self.runner.read(self._in_flight[0][1])
        except Exception as e:  # a device error: this step's outputs are lost, maybe the state too
            raise self._lose_device_state(e) from e
        return self._update(self._in_flight.popleft()[0], result)

    def _may_schedule(self) -> bool:
        if not self._in_flight:
            return True
        return (self.config.async_scheduling and len(self._in_flight) == 1
                and self.scheduler.can_schedule_ahead())

    def _run(self, plan) -> PendingStep:
        """Rows of the plan -> one dispatched runner submission (per-loop decode: one loop)."""
        for request in plan.preempted:
            self._release_slots(request)
        decode, per_loop = plan.kind is PlanKind.DECODE, plan.is_per_loop
        rows = [self._row(r, start, end, emits, loops, per_loop, decode, on_device)
                for r, (start, end), emits, loops, on_device in zip(
                    plan.requests, plan.token_ranges, plan.emits, plan.row_loops, plan.input_on_device)]
        return self.runner.dispatch(rows, decode=decode, loop_begin=plan.loop_begin,
                                    num_loops=plan.num_loops, series=per_loop,
                                    num_rows=plan.row_bucket, num_tokens=plan.token_bucket)

    def _row(self, request: Request, start: int, end: int, emits: bool, loops: int,
             per_loop: bool, decode: bool, on_device: bool) -> RowInput:
        extra = self._extra[request.request_id]
        if (per_loop or extra.warm) and extra.carry_slot is None:
            extra.carry_slot = self._free_carry.pop()
        params = request.sampling_params
        history = None  # a new token slot starts the request's token history (penalties.py)
        if emits and extra.token_slot is None:
            extra.token_slot = self._free_token_slots.pop()
            if params.processes_logits:
                history = (request.prompt_token_ids, request.output_token_ids, params.logit_bias,
                           params.allowed_token_ids)
        threshold = self._default_exit_threshold if params.exit_threshold is None else params.exit_threshold
        states = None
        if extra.init_mode == INIT_EXPLICIT:
            # NOTE: a warm-start request gives its prompt's states only (add_request); its decoded
            # tokens re-prefilled after a preemption start from zero (docs/semantics.md)
            states = extra.init_states[start:end]
            states = np.pad(states, ((0, end - start - len(states)), (0, 0)))
        # The index of the token this row samples (or would sample), pending ones counted.
        index = end - request.num_prompt_tokens if emits else request.num_output_tokens
        # Ouro prompt tokens run every loop (they need their planes); Huginn prefill may exit.
        exits_here = decode or self.model.cfg.family == "huginn"
        trace = params.exit_trace
        traced = None if trace is None else trace[min(index, len(trace) - 1)]
        if trace is not None and exits_here:  # replay: token k runs trace[k] loops
            loops = min(loops, traced)
        exit_step = -1 if params.exit_step is None else params.exit_step
        default_step = self._default_exit_step
        if (exit_step < 0 and params.exit_threshold is None and not params.exit_weighted
                and default_step is not None and default_step < loops):
            exit_step, threshold = default_step, None  # the config's step, never its Q-exit
        if trace is not None and emits and not exits_here and not 0 <= exit_step < traced:
            exit_step = min(traced, loops) - 1  # Ouro prefill: every loop runs, its token exits by trace[k]
        if params.exit_step is not None or params.exit_weighted:
            threshold = 2.0  # the fixed loop or the weighted sum, never the Q-exit
            if extra.skip and exits_here and params.exit_step is not None:
                loops = min(loops, params.exit_step + 1)  # skip: run loops 0..k only
        bm = self.scheduler.block_manager  # NOTE: the row reads the live page list (built at once)
        pages, planes = bm.locate(request.page_ids) if bm.decode_page_planes else (request.page_ids, None)
        assert decode or planes is None or max(planes) < 0, "a prefill row holds a decode page"  # kv_cache.py
        ids = request.token_ids(start, end - 1 if on_device else end) + [0] * on_device
        # NOTE: on_device: num_pending_tokens already counts this plan's own token
        bans = bad_words.step_bans(extra.bad_words, request.output_token_ids, on_device) if emits else ()
        return RowInput(ids, start, pages, emits, loops, params, token_index=index, bans=bans,
                        token_slot=extra.token_slot, input_on_device=on_device,
                        exit_skip=extra.skip and exits_here,
                        exit_spec=extra.exit_spec if decode or params.exit_in_prefill else None,
                        exit_step=exit_step, exit_weighted=params.exit_weighted,
                        carry_slot=extra.carry_slot, exit_threshold=2.0 if threshold is None else threshold,
                        init_mode=INIT_WARM if extra.warm and decode else extra.init_mode,
                        init_seed=self.config.huginn_seed, init_states=states,
                        page_planes=planes, decoded=decode, history=history)

    def _update(self, plan, result: StepResult | None) -> list[RequestOutput]:
        outputs, self._aborted = self._aborted, []
        if plan is None:
            return outputs
        tokens, loops = [None] * plan.num_real_rows, [None] * plan.num_real_rows
        if result is not None:
            read_tokens, read_loops = result.tokens.tolist(), result.exit_loops.tolist()
            for i, emits in enumerate(plan.emits):
                if emits:
                    tokens[i], loops[i] = read_tokens[i], read_loops[i]
        row = {request: i for i, request in enumerate(plan.requests)}
        changed = self.scheduler.update(plan, StepOutput(tokens, loops))
        for n, request in enumerate(changed):
            i = row[request]
            try:
                outputs.append(self._apply(request, tokens[i], loops[i], result, i))
            except BaseException:  # e.g. Ctrl-C while decoding text (engine_failures.py)
                self._abandon(outputs, changed[n:])
                raise
        return outputs

    def _apply(self, request: Request, token: int, loops: int, result: StepResult, i: int) -> RequestOutput:
        """The engine's part of the token `request` got in row i: logprobs, counts, text and
        stop strings, slots; its output."""
        extra = self._extra[request.request_id]
        if request.sampling_params.logprobs is not None:
            record_logprobs(extra, request.sampling_params.logprobs, token, result, i)
        self.num_generated += 1
        self.loops_generated += loops
        if self.model.tokenizer is not None and update_text(extra, request, self.model):
            self.scheduler.finish(request.request_id, FINISH_STOP)  # a stop string matched
        if request.is_finished:
            self._release_slots(request)
        elif request.num_loops_done == 0 and not extra.warm:
            self._release_carry(request)  # between tokens the loop state is not needed
        return self._output(request, request.output_token_ids[-1:])

    # ------------------------------------------------------------------ helpers
    def _output(self, request: Request, new_tokens) -> RequestOutput:
        extra = self._extra.get(request.request_id) or RequestExtra()
        if request.is_finished:
            self._extra.pop(request.request_id, None)
        return request_output(request, extra, new_tokens, self.model, self._primary_eos)

    def _release_carry(self, request: Request) -> None:
        extra = self._extra.get(request.request_id)
        if extra is not None and extra.carry_slot is not None:
            self._free_carry.append(extra.carry_slot)
            extra.carry_slot = None

    def _release_slots(self, request: Request) -> None:
        """Carry and token slot back (finished, aborted, preempted). A step in flight may still
        write them; only steps dispatched later reuse them, and they run after it."""
        self._release_carry(request)
        extra = self._extra.get(request.request_id)
        if extra is not None and extra.token_slot is not None:
            self._free_token_slots.append(extra.token_slot)
            extra.token_slot = None

    def stats(self) -> dict:
        s = self.scheduler.stats()
        return {"queue_len": s["num_waiting"], "running_rows": s["num_running"],
                "pages_used": s["num_used_pages"], "pages_free": s["num_free_pages"],
                "pages_total": self.layout.num_pages, "kv_capacity_tokens": self.layout.capacity_tokens,
                "kv_bytes_per_token": self.layout.bytes_per_token,
                "kv_bytes_per_decoded_token": self.layout.bytes_per_decoded_token,
                "compilations": self.runner.compilations, "submissions": self.runner.submissions,
                **compile_totals(self.runner.compile_times),
                "steps": s["num_steps"], "prefill_steps": s["num_prefill_steps"],
                "decode_steps": s["num_decode_steps"], "preemptions": s["num_preemptions"],
                "generated_tokens": self.num_generated,
                "mean_loops_per_token": self.loops_generated / max(1, self.num_generated),
                **{k: v for k, v in s.items() if k.startswith("prefix_cache")}}
