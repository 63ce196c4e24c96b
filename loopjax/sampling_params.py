"""Per-request sampling and loop/exit settings (pure Python, imports no JAX).

`SamplingParams` is frozen and validated on creation, so a bad request is refused with a
one-line `ValueError` naming the field and its allowed range before anything is queued.
`SamplingParams.from_openai(body)` maps an OpenAI completions / chat request body.

Conventions:
- `seed=None` (or -1, vLLM's "no seed") draws a random 31-bit seed at creation and stores it,
  so every request is
  reproducible from its recorded `seed` (`seed_drawn` records the draw: `LLM.generate` and
  `Engine.add_request`, given one such params for many prompts or calls, draw a seed per
  request, so that their samples are independent, as vLLM's unseeded requests are). The
  device derives the random key of the t-th generated token (t = 0 for the first) from
  (seed, t) only: `sampling.py`.
- `n` independent samples of one prompt: an engine request is one sample, so callers (the
  server) submit `fan_out()`: n copies with n=1 where sample i uses `seed + i` (wrapped into
  the seed range; the device keys seeds mod 2**64). Sample 0 is the n=1 request itself.
- `top_k` of 0 or -1 means off (stored as 0); `top_p=1.0` and `min_p=0.0` mean off;
  `temperature` 0 means greedy; one in (0, MIN_TEMPERATURE) is raised to MIN_TEMPERATURE and
  stored so (vLLM's guard against inf / NaN from dividing by it), so it is drawn, not greedy.
- Penalties and bias (vLLM's and OpenAI's meanings; applied on device, loopjax/penalties.py):
  `repetition_penalty` r in [1e-4, 1e4] (1 = off; vLLM takes any r > 0, which f32 may round to 0
  or inf) scales the logit x of every token seen in the prompt or the output (x > 0: x / r,
  else x * r); `frequency_penalty` f and `presence_penalty` p in
  [-2, 2] (0 = off) subtract f * count + p * (count > 0) for every output token;
  `logit_bias` {token id: bias in [-100, 100]} (at most MAX_LOGIT_BIAS entries) adds to the
  logits first. They apply to greedy requests too; logprobs stay the model's.
  `allowed_token_ids` (vLLM's; at most MAX_LOGIT_BIAS ids) masks every other token out (their
  logits -inf) before the penalties, the bias of an allowed id still added.
- `bad_words` (vLLM's): words the output may not contain; the engine bans each as token-id
  sequences (loopjax/bad_words.py: as given and after a space; output tokens only). A str is
  one word.
- `truncate_prompt_tokens` (vLLM's): a prompt longer than that keeps its last that many tokens
  (`truncate`; the engine, the offline API and the server apply it before checking its length).
  A prompt it cuts cannot take explicit Huginn states (given per position as sent): refused.
- Text (vLLM's fields, docs/semantics.md): `skip_special_tokens` leaves special tokens out,
  `spaces_between_special_tokens` False joins consecutive added tokens without spaces; the
  engine's and the server's detokenizers read them, the device never does.
- `prompt_logprobs` (vLLM's): the offline API (`LLM.generate`) and the server score the
  prompt on the identity path (`scoring.py`); the engine never reads it, so it changes no decode.
- Loop/exit settings: `loops` is the depth (None = model default); `exit_threshold` is
  Ouro's Q-exit threshold in [0, 1] when no `exit_criterion` is set, else the Huginn
  criterion's threshold (None = config / criterion default); `exit_trace` gives, per
  generated token, the number of loops to run (>= 1), to replay a recorded run (an output's
  `exit_loops` as given; an Ouro token sampled at prefill takes loop k's logits, every loop
  running for the prompt's KV, as the exit rule's prefill does); a trace always stops each
  token there (skip, whatever exit_mode; past its end its last entry repeats), so it replays
  skip-mode runs: a select-mode run's later tokens read the deeper loops' KV a replay does
  not compute (docs/semantics.md);
  `exit_step` (Ouro) takes the logits of loop k (0-based); `exit_weighted` (Ouro) takes
  sum_i p_i * logits_i. Exit rules exclude each other (exit_threshold aside: it bounds an
  exit_trace's tokens too, but exit_step and exit_weighted never take the threshold exit).
  `exit_min_loops` / `exit_check_every` pace an `exit_criterion`'s checks, `exit_in_prefill=False`
  keeps them out of the prompt's step: refused without one.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import secrets
from collections.abc import Sequence
from typing import Any

# Temperatures below this are greedy (the device's test; SamplingParams stores 0 or >= MIN_TEMPERATURE).
GREEDY_EPS = 1e-5
MIN_TEMPERATURE = 1e-2  # a smaller positive temperature is raised to it (vLLM's _MAX_TEMP)
MAX_TEMPERATURE = 2.0  # vLLM's and OpenAI's cap
MAX_LOGPROBS = 20
# Samples of one prompt (`n`) a request may ask: LLM.generate's limit and the server's default
# (`--max-n`); each sample is one engine request, so a huge n would queue that many.
DEFAULT_MAX_N = 16
MAX_PENALTY = 2.0  # presence / frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI's range)
MAX_BIAS = 100.0  # a logit_bias value lies in [-MAX_BIAS, MAX_BIAS] (OpenAI's range)
# repetition_penalty lies in [1 / MAX_REPETITION_PENALTY, MAX_REPETITION_PENALTY]: the device scales
# logits by it in f32, where 1e39 is inf and 1e-50 is 0, and 0 * inf is NaN (a token with logit 0,
# or a banned one at -inf, was then chosen); within it every logit below 1e34 stays finite.
MAX_REPETITION_PENALTY = 1e4
MAX_LOGIT_BIAS = 1024  # logit_bias entries of one request: a static width on the device
EXIT_MODES = ("select", "skip")
EXIT_CRITERIA = ("kl", "entropy-diff", "latent-diff", "argmax-stability", "cosine", "minp-kl")
# Seeds are stored mod 2**64 on the device (two uint32 words of a threefry key).
_MIN_SEED, _MAX_SEED = -(2**63), 2**64 - 1


def _fail(msg: str):
    raise ValueError(msg)


def _is_int(x) -> bool:  # numpy integers too (numbers.Integral); bools are no numbers here
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_number(x) -> bool:  # numpy reals too (numbers.Real)
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _plain(x):
    """A numpy (or other non-builtin) integer or real as Python's int or float; others as given."""
    if isinstance(x, bool | int | float) or not isinstance(x, numbers.Real):
        return x
    return int(x) if isinstance(x, numbers.Integral) else float(x)


def check_int(name, value, lo, hi=None):
    """`value` must be an int in [lo, hi] (hi=None: no upper bound); a one-line ValueError naming
    `name` otherwise."""
    rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
    if not _is_int(value):
        _fail(f"{name} must be an integer {rng}, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        _fail(f"{name} must be {'in ' if hi is not None else ''}{rng}, got {value}")


def _check_float(name, value, lo, hi, *, lo_open=False):
    """`value` must be a finite number in [lo, hi] (or (lo, hi] when lo_open)."""
    rng = f"{'(' if lo_open else '['}{lo}, {hi}]"
    if not _is_number(value) or not math.isfinite(value):
        _fail(f"{name} must be a number in {rng}, got {value!r}")
    if value < lo or value > hi or (lo_open and value == lo):
        _fail(f"{name} must be in {rng}, got {value}")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = 16  # generated tokens, >= 1; None: up to the context (`output_budget`)
    temperature: float = 1.0  # [0, 2]; 0 is greedy, (0, 0.01) is raised to 0.01 (vLLM's)
    top_k: int = 0  # 0 or -1 = off, else keep the k most likely tokens
    top_p: float = 1.0  # (0, 1]; keep the smallest set with mass >= top_p; 1 = off
    min_p: float = 0.0  # [0, 1]; keep tokens with p >= min_p * p_max; 0 = off
    seed: int | None = None  # None: a random seed drawn and stored at creation
    n: int = 1  # independent samples of the prompt, >= 1 (`fan_out` gives one params each)
    stop_token_ids: tuple[int, ...] = ()  # finish when one of these is generated
    stop: tuple[str, ...] = ()  # finish when the text ends with one of these (trimmed); a str is one
    ignore_eos: bool = False  # keep generating past the model's EOS token
    min_tokens: int = 0  # no EOS, stop token or stop string ends the output within its first this many tokens
    detokenize: bool = True  # False: the engine makes no text (nor checks stop strings, refused then)
    skip_special_tokens: bool = True  # the text leaves out special tokens (vLLM's and HF's decode option)
    spaces_between_special_tokens: bool = True  # False: consecutive added tokens' text unspaced (vLLM's)
    include_stop_str_in_output: bool = False  # the text keeps the stop string or stop token that ended it
    logprobs: int | None = None  # None: no logprobs; n: chosen token's + top-n, n in 0..20
    prompt_logprobs: int | None = None  # None: off; n: each prompt token's + top-n, n in 0..20 (scored)
    truncate_prompt_tokens: int | None = None  # >= 1: a longer prompt keeps its last that many tokens
    repetition_penalty: float = 1.0  # [1e-4, 1e4]; 1 = off; prompt and output tokens (x>0: x/r, else x*r)
    frequency_penalty: float = 0.0  # [-2, 2]; minus f * (times the token was output)
    presence_penalty: float = 0.0  # [-2, 2]; minus p if the token was output
    logit_bias: tuple[tuple[int, float], ...] = ()  # {id: bias} or (id, bias) pairs; stored sorted
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be generated; stored sorted
    bad_words: tuple[str, ...] = ()  # words the output may not contain (bad_words.py); a str is one
    cache_salt: str | None = None  # vLLM's: prefix-cache pages are shared only among requests of one salt
    loops: int | None = None  # fixed depth (max depth with an exit rule); None = model default
    exit_mode: str = "select"  # 'select': run all loops, pick by the rule; 'skip': stop at the exit
    exit_threshold: float | None = None  # Ouro Q-exit in [0, 1], or the criterion's threshold
    exit_criterion: str | None = None  # Huginn adaptive exit: one of EXIT_CRITERIA
    exit_min_loops: int = 1  # no exit before this many loops
    exit_check_every: int = 1  # evaluate the exit rule every this many loops
    exit_in_prefill: bool = True  # False: the prompt runs its depth (the reference's do_not_exit_in_prefill)
    exit_trace: tuple[int, ...] | None = None  # loops to run per generated token (replay)
    exit_step: int | None = None  # Ouro: the logits of loop k (0-based, the reference's exit_at_step)
    exit_weighted: bool = False  # Ouro: sum_i p_i * logits_i (the reference's use_weighted_exit)
    # True when `seed` was drawn here (seed=None): `LLM.generate` draws a new one per request.
    seed_drawn: bool = dataclasses.field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self):
        for f in dataclasses.fields(self):  # NOTE: numpy scalars stored as Python's (seeds wrap in int64)
            object.__setattr__(self, f.name, _plain(getattr(self, f.name)))
        if self.max_tokens is not None:
            check_int("max_tokens", self.max_tokens, 1)
        _check_float("temperature", self.temperature, 0, MAX_TEMPERATURE)
        if 0 < self.temperature < MIN_TEMPERATURE:  # NOTE: vLLM's: 1e-6 draws at 0.01, not greedy
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        check_int("top_k", self.top_k, -1)
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        _check_float("top_p", self.top_p, 0, 1, lo_open=True)
        _check_float("min_p", self.min_p, 0, 1)
        if self.seed is None or (_is_int(self.seed) and self.seed == -1):  # -1: vLLM's "no seed"
            object.__setattr__(self, "seed", secrets.randbits(31))
            object.__setattr__(self, "seed_drawn", True)
        check_int("seed", self.seed, _MIN_SEED, _MAX_SEED)
        check_int("n", self.n, 1)
        # NOTE: None is none (vLLM's default for the three); one string is one stop string, as vLLM
        # takes it; an id listed twice is one (vLLM's): min_tokens suppresses a bounded number of them
        stop_ids = _int_tuple("stop_token_ids", () if self.stop_token_ids is None else self.stop_token_ids, 0)
        object.__setattr__(self, "stop_token_ids", tuple(dict.fromkeys(stop_ids)))
        for name in ("stop", "bad_words"):
            value = getattr(self, name)
            value = () if value is None else (value,) if isinstance(value, str) else value
            object.__setattr__(self, name, _str_tuple(name, value))
        check_int("min_tokens", self.min_tokens, 0)
        for name in ("ignore_eos", "detokenize", "skip_special_tokens", "spaces_between_special_tokens",
                     "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                _fail(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.cache_salt is not None and not (isinstance(self.cache_salt, str) and self.cache_salt):
            _fail(f"cache_salt must be a non-empty string (or None), got {self.cache_salt!r}")
        if self.stop and not self.detokenize:
            _fail("stop strings need detokenize=True: they are matched on the text")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        self._check_penalties()
        self._check_exit()

    def _check_penalties(self):
        _check_float("repetition_penalty", self.repetition_penalty, 1 / MAX_REPETITION_PENALTY,
                     MAX_REPETITION_PENALTY)
        _check_float("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        _check_float("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        bias = self.logit_bias
        pairs = list(bias.items()) if isinstance(bias, dict) else bias
        if isinstance(pairs, str | bytes) or not isinstance(pairs, list | tuple) or not all(
                isinstance(p, list | tuple) and len(p) == 2 for p in pairs):
            _fail(f"logit_bias must map token ids to biases, got {bias!r}")
        for token, value in pairs:
            check_int("every logit_bias token id", token, 0)
            _check_float(f"logit_bias[{token}]", value, -MAX_BIAS, MAX_BIAS)
        if len({t for t, _ in pairs}) != len(pairs):
            _fail("logit_bias lists a token id twice")
        if len(pairs) > MAX_LOGIT_BIAS:
            _fail(f"logit_bias takes at most {MAX_LOGIT_BIAS} token ids, got {len(pairs)}")
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(v)) for t, v in pairs)))
        if self.allowed_token_ids is not None:
            allowed = sorted(set(_int_tuple("allowed_token_ids", self.allowed_token_ids, 0)))
            if not allowed or len(allowed) > MAX_LOGIT_BIAS:
                _fail(f"allowed_token_ids must list 1 to {MAX_LOGIT_BIAS} token ids, got {len(allowed)}")
            object.__setattr__(self, "allowed_token_ids", tuple(allowed))

    def _check_exit(self):
        if self.loops is not None:
            check_int("loops", self.loops, 1)
        if self.exit_mode not in EXIT_MODES:
            _fail(f"exit_mode must be one of {', '.join(EXIT_MODES)}, got {self.exit_mode!r}")
        if self.exit_criterion is not None and self.exit_criterion not in EXIT_CRITERIA:
            _fail(f"exit_criterion must be one of {', '.join(EXIT_CRITERIA)} (or unset), "
                  f"got {self.exit_criterion!r}")
        if self.exit_threshold is not None:
            if self.exit_criterion is None:  # Ouro's Q-exit: a cumulative probability
                _check_float("exit_threshold", self.exit_threshold, 0, 1)
            else:
                _check_float("exit_threshold", self.exit_threshold, 0, math.inf)
        check_int("exit_min_loops", self.exit_min_loops, 1, self.loops)
        check_int("exit_check_every", self.exit_check_every, 1)
        if self.exit_criterion is None and (self.exit_min_loops, self.exit_check_every) != (1, 1):
            # NOTE: refused, not ignored: Ouro's threshold exit checks every loop from the first
            _fail(f"exit_min_loops and exit_check_every pace the checks of an exit_criterion (Huginn); "
                  f"got exit_min_loops={self.exit_min_loops}, exit_check_every={self.exit_check_every} "
                  f"without one")
        if self.exit_trace is not None:
            trace = _int_tuple("exit_trace", self.exit_trace, 1, self.loops)
            if not trace:
                _fail("exit_trace must list at least one loop count, got ()")
            if self.exit_criterion is not None:
                _fail("exit_trace and exit_criterion exclude each other: a trace replays fixed exits")
            object.__setattr__(self, "exit_trace", trace)
        if self.exit_step is not None:
            check_int("exit_step", self.exit_step, 0, None if self.loops is None else self.loops - 1)
        for name in ("exit_weighted", "exit_in_prefill"):
            if not isinstance(getattr(self, name), bool):
                _fail(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not self.exit_in_prefill and self.exit_criterion is None:
            _fail("exit_in_prefill=False keeps an exit_criterion (Huginn) out of the prompt; give one")
        fixed = [n for n, on in (("exit_step", self.exit_step is not None),
                                 ("exit_weighted", self.exit_weighted)) if on]
        others = [n for n, on in (("exit_criterion", self.exit_criterion is not None),
                                  ("exit_trace", self.exit_trace is not None)) if on]
        if len(fixed) > 1 or (fixed and others):
            _fail(f"{' and '.join(fixed + others)} exclude each other: give one exit rule")
        if fixed and self.exit_threshold is not None:  # NOTE: refused, not ignored (the engine ignored it)
            _fail(f"{fixed[0]} and exit_threshold exclude each other: {fixed[0]} takes no threshold exit")
        if self.exit_weighted and self.exit_mode == "skip":
            _fail("exit_weighted needs every loop's logits: use exit_mode='select'")

    @property
    def exit_rule(self) -> str | None:
        """The exit rule besides Ouro's threshold exit (exit_criterion, exit_trace, exit_step or
        exit_weighted) this request sets, by field name; None: a fixed depth or the threshold."""
        return next((name for name, on in (("exit_criterion", self.exit_criterion is not None),
                                           ("exit_trace", self.exit_trace is not None),
                                           ("exit_step", self.exit_step is not None),
                                           ("exit_weighted", self.exit_weighted)) if on), None)

    @property
    def stops_adaptively(self) -> bool:
        """The device picks each token's depth (exit_mode 'skip', an exit_trace, Huginn's
        exit_criterion): such rows neither look up nor publish cached prefix pages."""
        return self.exit_mode == "skip" or self.exit_trace is not None or self.exit_criterion is not None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def processes_logits(self) -> bool:
        """The logits go through the request's token history (penalties, logit_bias) before
        the choice."""
        return bool(self.repetition_penalty != 1.0 or self.frequency_penalty or self.presence_penalty
                    or self.logit_bias or self.allowed_token_ids is not None)

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy on the model's logits as they are, asking no top logprobs (the chosen
        token's may be asked): the greedy-only sampler serves it."""
        return self.is_greedy and not self.processes_logits and not self.logprobs

    def output_budget(self, room: int) -> int:
        """The most tokens this request generates after a prompt that leaves `room` tokens of
        the context: max_tokens, at most room; max_tokens=None (vLLM's): all of room."""
        return room if self.max_tokens is None else min(self.max_tokens, room)

    def truncate(self, prompt):
        """The prompt (a sequence of token ids) cut to its last truncate_prompt_tokens tokens."""
        keep = self.truncate_prompt_tokens
        return prompt[-keep:] if keep is not None and len(prompt) > keep else prompt

    def fan_out(self) -> list[SamplingParams]:
        """The n single-sample params of this request: sample i has seed `seed + i`, so the
        samples differ yet all of them follow from `seed`; greedy samples are identical."""
        seeds = [self.seed + i - (2**64 if self.seed + i > _MAX_SEED else 0) for i in range(self.n)]
        return [dataclasses.replace(self, n=1, seed=seed) for seed in seeds]

    @classmethod
    def from_openai(cls, body: dict[str, Any]) -> SamplingParams:
        """Sampling parameters of an OpenAI completions / chat request body
        (loopjax/openai_sampling.py: its fields, one-line ValueErrors naming them)."""
        from loopjax.openai_sampling import sampling_kwargs

        return cls(**sampling_kwargs(body))


def check_for_model(params: SamplingParams, cfg, *, has_tokenizer: bool, warm_start: bool = False) -> None:
    """The checks of `params` that need only the model (cfg: its family and vocabulary; whether
    it has a tokenizer), as one-line ValueErrors. Engine.add_request runs them, and
    loopjax.generate before it builds (compiles) an engine; the engine checks the depths."""
    huginn = cfg.family == "huginn"
    if not isinstance(warm_start, bool):  # NOTE: bool("no") is True
        _fail(f"warm_start must be true or false, got {warm_start!r}")
    if params.exit_criterion is not None and not huginn:
        _fail("exit_criterion applies to Huginn models; Ouro exits by exit_threshold")
    # NOTE: refused, not ignored: Huginn has no threshold exit; skip without a criterion ran all loops
    if huginn and params.exit_threshold is not None and params.exit_criterion is None:
        _fail("exit_threshold on a Huginn model is its exit_criterion's threshold; give an exit_criterion")
    if huginn and params.exit_mode == "skip" and params.exit_criterion is None and params.exit_trace is None:
        _fail("exit_mode='skip' on a Huginn model stops at its exit_criterion; give one (or an exit_trace)")
    if (params.exit_step is not None or params.exit_weighted) and cfg.family != "ouro":
        name = "exit_step" if params.exit_step is not None else "exit_weighted"
        _fail(f"{name} applies to Ouro models only")
    if params.logit_bias and params.logit_bias[-1][0] >= cfg.vocab_size:
        _fail(f"logit_bias token id {params.logit_bias[-1][0]} is outside the vocabulary of {cfg.vocab_size}")
    if params.allowed_token_ids and params.allowed_token_ids[-1] >= cfg.vocab_size:
        _fail(f"allowed_token_ids token id {params.allowed_token_ids[-1]} is outside the vocabulary of "
              f"{cfg.vocab_size}")
    if params.stop and not has_tokenizer:
        _fail("stop strings need a tokenizer; this model has none (use stop_token_ids)")
    if params.bad_words and not has_tokenizer:
        _fail("bad_words needs a tokenizer; this model has none (use logit_bias)")
    if warm_start and not huginn:
        _fail("warm_start applies to Huginn models only")


def listed_rank(token: int, rank: int, top: Sequence[tuple[int, float]]) -> int:
    """vLLM's rank of `token` as listed beside its position's top logprobs `top` ((id, log p),
    most likely first, ranked 1..k): its place among them when it is one of them, else `rank`,
    its rank over the vocabulary (the log-probs >= its own: `sampling.sample`, `scoring.score`)."""
    return next((i for i, (u, _) in enumerate(top, 1) if u == token), rank)


def check_n(n: int, max_n: int, whose: str) -> None:
    """A one-line ValueError when `n` samples exceed `max_n`, the limit of `whose` (e.g. "LLM's",
    "this server's"): n is checked against [1, max_n] where a request is fanned out."""
    if n > max_n:
        _fail(f"n must be in [1, {max_n}] ({whose} max_n), got {n}")


def check_truncate_prompt_tokens(value) -> int | None:
    """A truncate_prompt_tokens value (None: off), or a one-line ValueError."""
    if value is not None:
        check_int("truncate_prompt_tokens", value, 1)
    return value


# ---------------------------------------------------------------- helpers

def _int_tuple(name, values, lo, hi=None) -> tuple[int, ...]:
    # NOTE: any sequence: an output's exit_loops (a Snapshot) replays as exit_trace as it is
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        _fail(f"{name} must be a list of integers, got {values!r}")
    for v in values:
        check_int(f"every {name} entry", v, lo, hi)
    return tuple(int(v) for v in values)


def _str_tuple(name, values) -> tuple[str, ...]:
    if isinstance(values, str) or not isinstance(values, list | tuple):
        _fail(f"{name} must be a list of strings, got {values!r}")
    for v in values:
        if not isinstance(v, str) or not v:
            _fail(f"every {name} entry must be a non-empty string, got {v!r}")
    return tuple(values)
