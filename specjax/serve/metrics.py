"""The server's Prometheus metrics, named as vLLM names its own (prefix `specjax:`), so
that dashboards built for vLLM read them with the prefix changed.

- From the engine, read at each scrape: requests running and waiting, slots and their
  occupancy, the K in use, each K's step time at each width as the engine timed it
  (`step_seconds`, once compiled), and speculation's counters (`spec_decode_num_drafts`,
  `_num_draft_tokens`, `_num_accepted_tokens`, `_num_accepted_tokens_per_pos` by position):
  acceptance rate = accepted / draft tokens, mean acceptance length = 1 + accepted / drafts.
- From the routes, as requests end: time to first token, inter-token latency, end-to-end
  latency (histograms, seconds), prompt and generated tokens, requests by finish reason.

A chunk carries several tokens (a device call's steps, each up to K + 1 tokens): its gap
from the previous chunk is spread over its tokens, one observation per token, so the
inter-token histogram counts tokens as vLLM's does.

It knows the engine's counters and prometheus-client; nothing of HTTP or text.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# vLLM's buckets for the same histograms (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector:
    """The engine's state and counters, read when Prometheus scrapes."""

    def __init__(self, engine, model_name: str):
        self.engine, self.labels = engine, {"model_name": model_name}

    def describe(self):
        return []  # registered without a first collect: the engine may not be running yet

    def collect(self):
        e, labels = self.engine, self.labels
        stats = e.stats()  # one snapshot
        running, waiting = stats["running"], stats["waiting"]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(f"specjax:{name}", doc, labels=list(labels))
            g.add_metric(list(labels.values()), value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(f"specjax:{name}", doc, labels=list(labels))
            c.add_metric(list(labels.values()), value)
            return c

        yield gauge("num_requests_running", "Requests in the engine's slots.", running)
        yield gauge("num_requests_waiting", "Requests queued for a slot.", waiting)
        yield gauge("num_slots", "The engine's slots (rows of its batch).", e.slots)
        yield gauge("slot_occupancy", "Fraction of the slots holding a request.", running / e.slots)
        yield gauge("num_draft_tokens_in_use", "K (draft tokens per step) of the last device call.", stats["k_in_use"])
        yield counter("spec_decode_num_drafts", "Steps in which a row was drafted for.", stats["drafts"])
        yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed.", stats["draft_tokens"])
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens the target accepted.", stats["accepted"])
        per_position = CounterMetricFamily("specjax:spec_decode_num_accepted_tokens_per_pos",
                                           "Drafts whose token at this position was accepted.",
                                           labels=[*labels, "position"])
        for position, n in enumerate(stats["accepted_per_position"]):
            per_position.add_metric([*labels.values(), str(position)], n)
        yield per_position
        yield counter("engine_failures", "Device calls that failed (their requests failed).", stats["failures"])
        if "kv_cache_usage" in stats:  # a paged engine (vLLM's name)
            yield gauge("kv_cache_usage_perc", "Fraction of the KV cache's pages held by requests (1 = all).",
                        stats["kv_cache_usage"])
            yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                          stats["prefix_cache_queries"])
            yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache (their pages shared).",
                          stats["prefix_cache_hits"])
        if stats["step_ms"] is not None:  # what the K table was chosen from (`Engine.compile_all` timed them)
            step = GaugeMetricFamily("specjax:step_seconds", "One step's time at this K and width (rows computed), "
                                     "as the engine timed it once compiled.", labels=[*labels, "k", "width"])
            for K, widths in sorted(stats["step_ms"].items()):
                for width, ms in sorted(widths.items()):
                    step.add_metric([*labels.values(), str(K), str(width)], ms / 1e3)
            yield step
        yield gauge("num_prefill_groups_compiling", "(group size, bucket) prefills still compiling in the background; "
                    "until one is, its requests are prefilled in smaller groups.", stats["compiling"])


class Metrics:
    """One server's metrics, in a registry of its own (several servers in one process keep
    their counts apart)."""

    def __init__(self, engine, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        common = {"labelnames": ["model_name"], "registry": self.registry}
        self.ttft = Histogram("specjax:time_to_first_token_seconds", "Time to the first generated token.",
                              buckets=TTFT_BUCKETS, **common).labels(model_name)
        self.itl = Histogram("specjax:inter_token_latency_seconds",
                             "Time between generated tokens (a chunk's gap spread over its tokens).",
                             buckets=ITL_BUCKETS, **common).labels(model_name)
        self.e2e = Histogram("specjax:e2e_request_latency_seconds", "Time from arrival to the last token.",
                             buckets=E2E_BUCKETS, **common).labels(model_name)
        self.prompt_tokens = Counter("specjax:prompt_tokens", "Prompt tokens of finished requests.",
                                     **common).labels(model_name)
        self.generation_tokens = Counter("specjax:generation_tokens", "Tokens generated.",
                                         **common).labels(model_name)
        self._success = Counter("specjax:request_success", "Finished requests by finish reason.",
                                labelnames=["model_name", "finished_reason"], registry=self.registry)
        self._model_name = model_name

    def finished(self, reason: str, prompt_tokens: int, chunk_times: list[tuple[float, int]], arrival: float,
                 end: float):
        """One choice's request has ended: reason ("stop", "length", "abort", "error"), its
        prompt's length, its chunks' (time, tokens) and when it arrived and ended."""
        self._success.labels(self._model_name, reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(sum(n for _, n in chunk_times))
        self.e2e.observe(end - arrival)
        if chunk_times:
            self.ttft.observe(chunk_times[0][0] - arrival)
            for (before, _), (when, n) in zip(chunk_times, chunk_times[1:]):
                for _ in range(n):
                    self.itl.observe((when - before) / n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
