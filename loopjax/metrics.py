"""Prometheus text exposition (format 0.0.4) in pure Python, plus a small parser.

The server keeps one `Registry`; the engine thread's stats snapshot sets the gauges and the
counters of the engine's counts since start (`*_total`), and the event loop observes TTFT at a
request's first token, TPOT and end-to-end latency when it finishes. Nothing here is thread-safe on
its own: the owner (AsyncEngine) only touches metrics from the event-loop thread.

`parse(text)` reads an exposition back into `{"name{labels}": value}`; the tests and the
HTTP benchmark use it, and it raises ValueError on a malformed line.
"""

from __future__ import annotations

import bisect
import math
import re

# Seconds. TTFT spans queueing + prefill (ms to minutes); TPOT one decode step (sub-ms to s);
# E2E a whole request (ms to many minutes).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0)
TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)(\s+-?\d+)?$")


def _escape(text: str, *, quote: bool) -> str:
    """Text as the exposition format carries it: a backslash and a newline escaped (HELP
    lines), and a double quote too in a label value (`quote`)."""
    text = str(text).replace("\\", "\\\\").replace("\n", "\\n")
    return text.replace('"', '\\"') if quote else text


def _sample(name: str, value: float, labels: dict[str, str] | None = None) -> str:
    """One sample line; the one place label values are written (escaped)."""
    pairs = ",".join(f'{key}="{_escape(text, quote=True)}"' for key, text in (labels or {}).items())
    return f"{name}{{{pairs}}} {_fmt(value)}" if pairs else f"{name} {_fmt(value)}"


def _fmt(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


class _Metric:
    kind = "untyped"

    def __init__(self, name: str, help_text: str):
        if not _NAME.match(name):
            raise ValueError(f"invalid metric name {name!r}")
        self.name, self.help = name, help_text

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {_escape(self.help, quote=False)}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    """Monotonic count; `inc` refuses negative steps. `set_total` mirrors a count kept
    elsewhere (the engine's); a lower total is a counter reset, as Prometheus reads it."""

    kind = "counter"

    def __init__(self, name, help_text):
        super().__init__(name, help_text)
        self.value = 0.0

    def inc(self, amount: float = 1.0):
        if amount < 0:
            raise ValueError(f"counter {self.name} cannot decrease (inc by {amount})")
        self.value += amount

    def set_total(self, value: float):
        self.value = float(value)

    def render(self) -> list[str]:
        return self.header() + [_sample(self.name, self.value)]


class Gauge(_Metric):
    kind = "gauge"

    def __init__(self, name, help_text):
        super().__init__(name, help_text)
        self.value = 0.0

    def set(self, value: float):
        self.value = float(value)

    def render(self) -> list[str]:
        return self.header() + [_sample(self.name, self.value)]


class Histogram(_Metric):
    """Cumulative buckets with upper bounds `buckets` (sorted) plus +Inf, `_sum`, `_count`."""

    kind = "histogram"

    def __init__(self, name, help_text, buckets):
        super().__init__(name, help_text)
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)  # last slot: above every bound
        self.sum = 0.0

    def observe(self, value: float):
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def render(self) -> list[str]:
        lines, total = self.header(), 0
        for bound, n in zip(self.buckets + (math.inf,), self.counts):
            total += n
            lines.append(_sample(f"{self.name}_bucket", total, {"le": _fmt(bound)}))
        lines += [_sample(f"{self.name}_sum", self.sum), _sample(f"{self.name}_count", total)]
        return lines


class Registry:
    """An ordered set of metrics rendered as one exposition."""

    def __init__(self):
        self._metrics: dict[str, _Metric] = {}

    def _add(self, metric):
        if metric.name in self._metrics:
            raise ValueError(f"metric {metric.name} registered twice")
        self._metrics[metric.name] = metric
        return metric

    def counter(self, name, help_text) -> Counter:
        return self._add(Counter(name, help_text))

    def gauge(self, name, help_text) -> Gauge:
        return self._add(Gauge(name, help_text))

    def histogram(self, name, help_text, buckets) -> Histogram:
        return self._add(Histogram(name, help_text, buckets))

    def get(self, name):
        return self._metrics.get(name)

    def render(self) -> str:
        return "\n".join(line for m in self._metrics.values() for line in m.render()) + "\n"


class ServingMetrics:
    """The server's metrics: engine gauges and counters from `stats()`, request counters,
    TTFT / TPOT / e2e latency histograms."""

    # engine.stats() key -> (metric name, kind, help). Gauges take the snapshot's value, counters
    # mirror the engine's cumulative counts. Other numeric keys become gauges loopjax_engine_<key>.
    ENGINE_METRICS = {
        "queue_len": ("loopjax_queue_len", "gauge", "Requests waiting in the engine queue"),
        "running_rows": ("loopjax_running_rows", "gauge", "Requests in the running batch"),
        "pages_used": ("loopjax_pages_used", "gauge", "KV pages in use"),
        "pages_free": ("loopjax_pages_free", "gauge", "KV pages free (cached pages no request holds count)"),
        # Counts since start: counters (rate() reads a restart as a reset; they were gauges).
        "compilations": ("loopjax_compilations_total", "counter", "XLA compilations since start"),
        "compile_s": ("loopjax_compile_seconds_total", "counter",
                      "Seconds spent building executables (summed over compile threads)"),
        "compile_cache_hits": ("loopjax_compile_cache_hits_total", "counter",
                               "Executables the persistent compilation cache supplied"),
        "submissions": ("loopjax_submissions_total", "counter", "Device submissions"),
        "steps": ("loopjax_steps_total", "counter", "Engine steps"),
        "prefill_steps": ("loopjax_prefill_steps_total", "counter", "Engine steps that prefill"),
        "decode_steps": ("loopjax_decode_steps_total", "counter", "Engine steps that decode"),
        "preemptions": ("loopjax_preemptions_total", "counter",
                        "Running requests preempted to free KV pages (recomputed later)"),
        "generated_tokens": ("loopjax_engine_generated_tokens_total", "counter",
                             "Tokens the engine generated (aborted requests' included)"),
        "mean_loops_per_token": ("loopjax_mean_loops_per_token", "gauge",
                                 "Mean loops run per generated token"),
        # Prefix cache (engine.stats()'s prefix_cache_* keys; all zero with the cache off). Hit
        # rates: hits over the context every admitted request queried, since start.
        "prefix_cache_hit_rate": ("loopjax_prefix_cache_hit_rate", "gauge",
                                  "Prefix cache hit rate: cached tokens / context tokens of admitted "
                                  "requests"),
        "prefix_cache_page_hit_rate": ("loopjax_prefix_cache_page_hit_rate", "gauge",
                                       "Prefix cache hit rate: cached pages / full context pages of admitted "
                                       "requests"),
        "prefix_cache_pages": ("loopjax_prefix_cache_pages", "gauge",
                               "KV pages holding a cached prefix (held or parked)"),
        "prefix_cache_parked_pages": ("loopjax_prefix_cache_parked_pages", "gauge",
                                      "Cached pages no request holds (reused, oldest first, when the pool "
                                      "needs room)"),
        "prefix_cache_evictions": ("loopjax_prefix_cache_evictions_total", "counter",
                                   "Cached pages evicted to make room"),
        "prefix_cache_queried_tokens": ("loopjax_prefix_cache_queried_tokens_total", "counter",
                                        "Context tokens of admitted requests looked up in the prefix cache"),
        "prefix_cache_hit_tokens": ("loopjax_prefix_cache_hit_tokens_total", "counter",
                                    "Context tokens served from the prefix cache"),
        "prefix_cache_queried_pages": ("loopjax_prefix_cache_queried_pages_total", "counter",
                                       "Full context pages of admitted requests looked up"),
        "prefix_cache_hit_pages": ("loopjax_prefix_cache_hit_pages_total", "counter",
                                   "Full context pages served from the prefix cache"),
    }

    def __init__(self):
        r = self.registry = Registry()
        self.gauges = {key: (r.counter if kind == "counter" else r.gauge)(name, text)
                       for key, (name, kind, text) in self.ENGINE_METRICS.items()}
        self.prefix_cache_enabled = r.gauge("loopjax_prefix_cache_enabled",
                                            "1 when the engine shares KV pages of common prefixes")
        self.waiting = r.gauge("loopjax_waiting_requests",
                               "Accepted requests that have not yet received a first token")
        # NOTE: the request counters count engine requests, one per sample (an OpenAI request of 2
        # prompts and n=4 counts 8), as vLLM's request_success_total and prompt_tokens_total count
        # each child request of an n > 1 request; a rejection refuses the user request whole: once.
        self.requests = r.counter("loopjax_requests_total",
                                  "Engine requests accepted (one per sample: prompts x n of a request)")
        self.finished = r.counter("loopjax_requests_finished_total",
                                  "Engine requests finished (one per sample)")
        self.aborted = r.counter("loopjax_requests_aborted_total",
                                 "Engine requests aborted (one per sample): client gone, server shutting "
                                 "down, a step failed")
        self.rejected = r.counter("loopjax_requests_rejected_total",
                                  "User requests refused because the queue was full (HTTP 429), once each "
                                  "whatever their prompts x n")
        self.step_failures = r.counter("loopjax_step_failures_total",
                                       "Engine steps that failed on the device (their requests failed)")
        self.prompt_tokens = r.counter("loopjax_prompt_tokens_total",
                                       "Prompt tokens of the accepted engine requests (a prompt once per "
                                       "sample)")
        self.generation_tokens = r.counter("loopjax_generation_tokens_total", "Tokens generated")
        self.ttft = r.histogram("loopjax_ttft_seconds", "Time to first token", TTFT_BUCKETS)
        self.tpot = r.histogram("loopjax_tpot_seconds", "Time per output token after the first",
                                TPOT_BUCKETS)
        self.e2e = r.histogram("loopjax_e2e_request_latency_seconds",
                               "Time from arrival to the last token, per finished request", E2E_BUCKETS)

    def set_engine_stats(self, stats: dict):
        for key, value in stats.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            metric = self.gauges.get(key)
            if metric is None:
                name = "loopjax_engine_" + re.sub(r"[^a-zA-Z0-9_]", "_", str(key))
                metric = self.gauges[key] = self.registry.gauge(name, f"engine stats()[{key!r}]")
            if isinstance(metric, Counter):
                metric.set_total(value)
            else:
                metric.set(value)

    def engine_died(self, stats: dict) -> dict:
        """The engine thread died: its gauges read 0 (no request runs or waits, no page is
        offered) rather than its last live snapshot; the counters keep their totals. -> `stats`
        (its last snapshot) as the dead engine's, its gauges' values 0 alike."""
        for metric in self.gauges.values():
            if isinstance(metric, Gauge):
                metric.set(0)
        return {key: 0 if isinstance(self.gauges.get(key), Gauge) else value for key, value in stats.items()}

    def render(self) -> str:
        return self.registry.render()


def engine_stats_from_samples(samples: dict[str, float]) -> dict[str, float]:
    """The inverse of the exposition for a client (bench --url): engine stats under their
    `stats()` keys (prefix_cache_evictions, generated_tokens, ...), every other unlabelled
    loopjax_ sample under its name without the prefix (requests_finished_total, ...)."""
    keys = {name: key for key, (name, _, _) in ServingMetrics.ENGINE_METRICS.items()}
    out = {}
    for name, value in samples.items():
        if "{" in name or not name.startswith("loopjax_"):
            continue
        if name in keys:
            out[keys[name]] = value
        elif name.startswith("loopjax_engine_"):
            out[name[len("loopjax_engine_"):]] = value
        else:
            out[name[len("loopjax_"):]] = value
    return out


def parse(text: str) -> dict[str, float]:
    """`{"name{labels}": value}` of an exposition; ValueError naming the first bad line."""
    samples: dict[str, float] = {}
    for num, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            raise ValueError(f"metrics line {num} is not a Prometheus sample: {line!r}")
        name, labels, value = match.group(1), match.group(2) or "", match.group(3)
        try:
            samples[name + labels] = float(value.replace("Inf", "inf"))
        except ValueError:
            raise ValueError(f"metrics line {num} has a bad value {value!r}") from None
    return samples
