"""Prometheus metrics and the per-request log line of the scheduler process.

Names follow vLLM's (``vllm:num_requests_running`` becomes
``jitney:num_requests_running``) so existing dashboards carry over. Every
metric lives in one ``CollectorRegistry`` per ``Metrics`` object, never the
global one, so several servers can run in one test process.

    kind        fed by
    gauges      read from the serving Engine at scrape time (StateCollector)
    counters    the engine's own counters, summed over the engines this
                process has had (one per worker start), plus request ends
    histograms  the gRPC handlers (time to first token, inter-token, e2e)
                and the step loop (step duration, batch size)

One line per request goes to the ``jitney.requests`` logger when it ends:
id, the API key's name (with ``--api-key-file``), tokens in/out, time to
first token, total time, finish reason or error. The prompt text is logged
only with ``--log-prompts``; a key itself never is.

With ``--fairness tenant`` the scheduler's tenants (fairness.py) are read at
scrape time: ``jitney:tenant_service`` (the virtual token counter the policy
compares), ``jitney:tenant_computed_tokens`` by ``kind`` (prompt, output)
and ``jitney:tenant_requests_waiting`` / ``_running``, labelled ``tenant``.
Only the ``METRIC_TENANTS`` most-served tenants have their own label; the
rest are summed into ``tenant="jitney:other"`` (no service: counters of
different tenants do not add up), so the series stay bounded however many
``user`` strings clients send; the shared tenant is ``jitney:shared``.
(Client tenants cannot start with ``jitney:``.) They are gauges: a counter
is lifted when its tenant returns from idle, and a tenant moves between its
own label and ``other`` as the ranking changes.

The request counters (success, failure, prompt and generation tokens) carry
a ``door`` label, the API the request came through (DOORS: grpc, openai,
responses, anthropic), and with API keys (``key_label``) a ``key`` label: the
key's name, "" for calls without a valid key. Both are bounded (the doors by
DOORS, the names by the key file); the histograms have neither (latency is
the server's, and buckets times labels adds up).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from jitney.scheduler.core.fairness import RESERVED_PREFIX, TenantReport

request_log = logging.getLogger("jitney.requests")

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                50.0, 60.0, 120.0, 240.0, 480.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
DOORS = ("grpc", "openai", "responses", "anthropic")   # the values of the ``door`` label
METRIC_TENANTS = 16           # tenants with a label of their own; the rest are "other"
OTHER_TENANT = RESERVED_PREFIX + "other"
SHARED_TENANT_LABEL = RESERVED_PREFIX + "shared"


class Metrics:
    """The process's metrics; ``engine()`` returns the serving Engine or None."""

    def __init__(self, engine: Callable[[], Any], *, key_label: bool = False) -> None:
        self.registry = CollectorRegistry()
        self.key_label = key_label
        r = self.registry
        key = ["door", "key"] if key_label else ["door"]
        self.ttft = Histogram("jitney:time_to_first_token_seconds", "Time to first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("jitney:inter_token_latency_seconds", "Time between two tokens.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("jitney:e2e_request_latency_seconds", "Request latency, end to end.",
                             buckets=_E2E_BUCKETS, registry=r)
        self.step_duration = Histogram("jitney:step_duration_seconds",
                                       "Time of one engine step, plan sent to result back.",
                                       buckets=_LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("jitney:batch_size", "Sequences scheduled in one step.",
                                    buckets=_BATCH_BUCKETS, registry=r)
        self.prompt_tokens = Counter("jitney:prompt_tokens", "Prompt tokens of admitted requests.",
                                     key, registry=r)
        self.generation_tokens = Counter("jitney:generation_tokens", "Tokens generated.",
                                         key, registry=r)
        self.request_success = Counter("jitney:request_success", "Requests finished normally.",
                                       ["finished_reason", *key], registry=r)
        self.request_failure = Counter("jitney:request_failure",
                                       "Requests ended by a gRPC error status.", ["code", *key],
                                       registry=r)
        self.state = StateCollector(engine)
        r.register(self.state)
        self.log_prompts = False

    def serve_http(self, host: str, port: int) -> Any:
        """Serve ``/metrics`` on ``host:port`` from a daemon thread. Raises
        OSError when the port cannot be bound: http.server's socket sets
        SO_REUSEADDR only (``allow_reuse_port`` is False), so a port another
        server listens on is refused, never shared."""
        return start_http_server(port, addr=host, registry=self.registry)

    def labelled(self, counter: Counter, key: str | None, door: str, **labels: str) -> Counter:
        """``counter``'s child for ``labels`` and ``door``, and the key's name when keys are on."""
        if door not in DOORS:
            raise ValueError(f"door must be one of {', '.join(DOORS)}, got {door!r}")
        labels["door"] = door
        if self.key_label:
            labels["key"] = key or ""
        return counter.labels(**labels)

    def failure(self, code: str, key: str | None = None, door: str = "grpc") -> None:
        self.labelled(self.request_failure, key, door, code=code).inc()

    def track(self, request_id: str, prompt_tokens: int, prompt: object = None,
              key: str | None = None, door: str = "grpc") -> "RequestRecord":
        self.labelled(self.prompt_tokens, key, door).inc(prompt_tokens)
        return RequestRecord(self, request_id, prompt_tokens,
                             prompt if self.log_prompts else None, key, door)

    def observe_step(self, seconds: float, batch_size: int) -> None:
        self.step_duration.observe(seconds)
        self.batch_size.observe(batch_size)


class StateCollector(Collector):
    """Gauges and engine counters, read from the serving Engine at scrape time."""

    _COUNTERS = {  # metric -> (help, how to read it from an Engine)
        "jitney:num_preemptions": ("Preemptions.", lambda e: e.num_preemptions),
        "jitney:num_steps": ("Engine steps run.", lambda e: e.num_steps),
        "jitney:prefix_cache_queries": (
            "Prompt tokens looked up in the prefix cache.",
            lambda e: getattr(e.scheduler.block_manager, "prefix_cache_queried_tokens", 0)),
        "jitney:prefix_cache_hits": (
            "Prompt tokens found in the prefix cache.",
            lambda e: getattr(e.scheduler.block_manager, "prefix_cache_hit_tokens", 0)),
        # Speculative decoding (vLLM's spec_decode_* names): chunks that verified drafts, their drafts, accepted.
        "jitney:spec_decode_num_drafts": ("Chunks that verified drafts.", lambda e: e.scheduler.num_drafts),
        "jitney:spec_decode_num_draft_tokens": ("Draft tokens verified.", lambda e: e.scheduler.num_draft_tokens),
        "jitney:spec_decode_num_accepted_tokens": ("Draft tokens accepted.",
                                                   lambda e: e.scheduler.num_accepted_tokens),
        "jitney:lora_loads": ("LoRA adapters loaded into a worker slot (a first use, or one evicted before).",
                              lambda e: e.scheduler.lora.num_loads),
    }

    def __init__(self, engine: Callable[[], Any]) -> None:
        self._engine = engine
        self._retired = dict.fromkeys(self._COUNTERS, 0.0)   # of engines no longer serving
        self._retired_acceptance: list[int] = []   # drafts per accepted length, of those engines
        self.worker_restarts = 0

    def retire(self, engine: Any) -> None:
        """Keep the counters of an engine that stops serving (its worker was lost)."""
        for name, (_, read) in self._COUNTERS.items():
            self._retired[name] += read(engine)
        self._retired_acceptance = _add_counts(self._retired_acceptance, engine.scheduler.acceptance_counts)

    def collect(self) -> Iterator[Any]:
        engine = self._engine()
        sched = engine.scheduler if engine is not None else None
        yield _gauge("jitney:num_requests_running", "Requests holding a seat.",
                     sched.num_running if sched else 0)
        yield _gauge("jitney:num_requests_waiting", "Requests waiting for a seat.",
                     sched.num_waiting if sched else 0)
        usage = 0.0
        if sched is not None:
            bm = sched.block_manager
            usage = bm.num_used_blocks / bm.num_blocks
        yield _gauge("jitney:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", usage)
        yield _gauge("jitney:worker_ready", "1 while a worker is serving.", int(engine is not None))
        yield _gauge("jitney:lora_adapters_resident", "LoRA adapters in the worker's slots (--max-loras).",
                     len(sched.lora.resident()) if sched else 0)
        for name, (doc, read) in self._COUNTERS.items():
            value = self._retired[name] + (read(engine) if engine is not None else 0)
            yield CounterMetricFamily(name, doc, value=value)
        yield CounterMetricFamily("jitney:worker_restarts", "Workers that replaced a lost one.",
                                  value=self.worker_restarts)
        yield self._acceptance_histogram(sched)
        if sched is not None and sched.fairness is not None:
            yield from _tenant_metrics(sched.tenant_report())

    def _acceptance_histogram(self, sched: Any) -> HistogramMetricFamily:
        """Drafts by how many of their tokens were accepted (0..K)."""
        counts = _add_counts(self._retired_acceptance, sched.acceptance_counts if sched is not None else [])
        cumulative, buckets = 0, []
        for length, n in enumerate(counts):
            cumulative += n
            buckets.append((str(length), cumulative))
        buckets.append(("+Inf", cumulative))
        total = sum(length * n for length, n in enumerate(counts))
        return HistogramMetricFamily("jitney:spec_decode_acceptance_length",
                                     "Draft tokens accepted per chunk that verified drafts.",
                                     buckets=buckets, sum_value=total)


def _tenant_metrics(rows: list[TenantReport]) -> Iterator[GaugeMetricFamily]:
    """The tenants' gauges: the METRIC_TENANTS most-served by name (``rows``
    comes most-served first), the rest summed into OTHER_TENANT."""
    service = GaugeMetricFamily("jitney:tenant_service", "A tenant's virtual token counter "
                                "(weighted tokens computed, lifted on return from idle).", labels=["tenant"])
    tokens = GaugeMetricFamily("jitney:tenant_computed_tokens", "Tokens computed for a tenant, by kind.",
                               labels=["tenant", "kind"])
    waiting = GaugeMetricFamily("jitney:tenant_requests_waiting", "A tenant's requests waiting.", labels=["tenant"])
    running = GaugeMetricFamily("jitney:tenant_requests_running", "A tenant's requests running.", labels=["tenant"])
    named, rest = rows[:METRIC_TENANTS], rows[METRIC_TENANTS:]
    for row in named:
        label = row.tenant or SHARED_TENANT_LABEL
        service.add_metric([label], row.service)
        tokens.add_metric([label, "prompt"], row.prompt_tokens)
        tokens.add_metric([label, "output"], row.output_tokens)
        waiting.add_metric([label], row.waiting)
        running.add_metric([label], row.running)
    if rest:
        tokens.add_metric([OTHER_TENANT, "prompt"], sum(r.prompt_tokens for r in rest))
        tokens.add_metric([OTHER_TENANT, "output"], sum(r.output_tokens for r in rest))
        waiting.add_metric([OTHER_TENANT], sum(r.waiting for r in rest))
        running.add_metric([OTHER_TENANT], sum(r.running for r in rest))
    yield from (service, tokens, waiting, running)


def _add_counts(a: list[int], b: list[int]) -> list[int]:
    return [x + y for x, y in itertools.zip_longest(a, b, fillvalue=0)]


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


class RequestRecord:
    """Timing of one request as its gRPC handler sees it; ends in one log line.
    ``key``: the name of the caller's API key (None: keys are off)."""

    def __init__(self, metrics: Metrics, request_id: str, prompt_tokens: int,
                 prompt: object, key: str | None = None, door: str = "grpc") -> None:
        self._metrics = metrics
        self.request_id = request_id
        self.key = key
        self.door = door
        self._on_end: list[Callable[[], None]] = []
        self._generated = metrics.labelled(metrics.generation_tokens, key, door)
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self._prompt = prompt
        self._start = time.monotonic()
        self._first: float | None = None
        self._last: float | None = None
        self._ended = False

    def on_tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.monotonic()
        if self._first is None:
            self._first = now
            self._metrics.ttft.observe(now - self._start)
        elif self._last is not None:
            self._metrics.itl.observe((now - self._last) / n)
        self._last = now
        self.completion_tokens += n
        self._generated.inc(n)

    def on_finish(self, reason: str) -> None:
        if self._end():
            self._metrics.labelled(self._metrics.request_success, self.key, self.door,
                                   finished_reason=reason).inc()
            self._metrics.e2e.observe(time.monotonic() - self._start)
            self._log(f"finish={reason}")

    def on_error(self, code: str, message: str) -> None:
        if self._end():
            self._metrics.failure(code, self.key, self.door)
            self._log(f"error={code} ({message})")

    def on_end(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once, when the request ends (finish or error)."""
        self._on_end.append(callback)

    def _end(self) -> bool:
        ended, self._ended = self._ended, True
        if not ended:
            for callback in self._on_end:
                callback()
        return not ended

    def _log(self, outcome: str) -> None:
        now = time.monotonic()
        ttft = f"{self._first - self._start:.3f}s" if self._first is not None else "-"
        prompt = f" prompt={self._prompt!r}" if self._prompt is not None else ""
        request_log.info("request %s:%s tokens in=%d out=%d ttft=%s total=%.3fs %s%s",
                         self.request_id, key_field(self.key), self.prompt_tokens,
                         self.completion_tokens, ttft,
                         now - self._start, outcome, prompt)


def key_field(key: str | None) -> str:
    """`` key=NAME`` for a log line, or nothing when keys are off."""
    return f" key={key}" if key is not None else ""
