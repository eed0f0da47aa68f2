"""Prometheus metrics of one server (its own registry: no global state)."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from pkv.core.engine.async_engine import RequestTimings
from pkv.core.engine.llm_engine import LLMEngine
from pkv.core.sched.kv_offload import OffloadStats
from pkv.core.spec_decode.proposer import SpecDecodeStats

# Up to vLLM's tops: a long request on a busy CPU runs for many minutes, and one past the
# last bucket reads as that bucket in every quantile.
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 640, 2560)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640, 1280, 2560, 7680)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5, 5, 10, 20,
                 40, 80)


class _EngineCollector(Collector):
    """Reads the engine's live stats at scrape time."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        s = self.engine.get_stats()
        gauges = {
            "pkv:num_requests_running": ("Requests in the running batch.", s.num_running),
            "pkv:num_requests_waiting": ("Requests waiting to be scheduled.", s.num_waiting),
            "pkv:kv_cache_usage_perc": ("Fraction of KV blocks in use (0-1).", s.kv_cache_usage),
            "pkv:kv_blocks_total": ("KV blocks in the pool.", s.num_blocks_total),
            "pkv:kv_blocks_free": ("KV blocks not held by any request.", s.num_blocks_free),
            "pkv:kv_cache_resident_bytes": ("KV pool bytes in RAM (the pages its blocks touched).",
                                            s.kv_resident_bytes),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        yield _kv_cache_info(self.engine)
        counters = {
            "pkv:num_preemptions": ("Requests preempted for lack of blocks.", s.num_preemptions),
            "pkv:prompt_tokens": ("Prompt tokens received.", s.num_prompt_tokens),
            "pkv:generation_tokens": ("Tokens generated.", s.num_generation_tokens),
            "pkv:prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.",
                                         s.prefix_cache_queries),
            "pkv:prefix_cache_hits": ("Prompt tokens found in the prefix cache.",
                                      s.prefix_cache_hits),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)
        if s.kv_offload is not None:
            yield from _kv_offload_metrics(s.kv_offload)
        if self.engine.proposer is not None:
            yield from _spec_decode_metrics(self.engine.spec_stats)
        if self.engine.lora is not None:
            yield _lora_info(self.engine)


def _kv_cache_info(engine: LLMEngine) -> Metric:
    """The KV cache's storage, as labels (an info metric): dtype and bytes per block."""
    info = GaugeMetricFamily("pkv:kv_cache_info", "KV cache storage (value 1).",
                             labels=["dtype", "block_size", "bytes_per_block"])
    runner = engine.runner
    info.add_metric([runner.kv_format.name, str(runner.block_size),
                     str(engine.kv_bytes_per_block)], 1)
    return info


def _kv_offload_metrics(o: OffloadStats) -> Iterator[Metric]:
    """The prefix cache's disk tier (`--kv-offload-dir`)."""
    counters = {
        "pkv:kv_offload_hits": ("KV blocks read back from the disk tier.", o.hits),
        "pkv:kv_offload_saved_tokens": ("Prefill tokens spared by disk-tier hits.",
                                        o.saved_tokens),
        "pkv:kv_offload_writes": ("KV blocks written to the disk tier.", o.writes),
        "pkv:kv_offload_drops": ("Evicted KV blocks not written: the staging area was full.",
                                 o.drops),
        "pkv:kv_offload_corrupt": ("Torn or damaged disk-tier files found (deleted).",
                                   o.corrupt),
        "pkv:kv_offload_write_errors": ("Disk-tier writes that failed (a full or vanished "
                                        "disk).", o.write_errors),
        "pkv:kv_offload_evictions": ("Disk-tier files deleted to stay under its size.",
                                     o.evictions),
    }
    for name, (doc, value) in counters.items():
        yield CounterMetricFamily(name, doc, value=value)
    yield GaugeMetricFamily("pkv:kv_offload_bytes", "Bytes the disk tier's files hold.",
                            value=o.bytes_used)


def _lora_info(engine: LLMEngine) -> Metric:
    """vLLM's shape: the adapters of running and waiting requests as comma-separated label
    values, the value being the scrape time."""
    # list() copies in one C call: the engine thread may be changing these right now.
    running = sorted({r.lora.name for r in list(engine.scheduler.running) if r.lora})
    waiting = sorted({r.lora.name for r in list(engine.scheduler.waiting) if r.lora})
    info = GaugeMetricFamily("pkv:lora_requests_info", "LoRA adapters in use.",
                             labels=["running_lora_adapters", "waiting_lora_adapters",
                                     "max_lora"])
    info.add_metric([",".join(running), ",".join(waiting), str(engine.config.max_loras)],
                    time.time())
    return info


def _spec_decode_metrics(spec: SpecDecodeStats) -> Iterator[Metric]:
    """Speculative decoding: drafts proposed and accepted, and accepted drafts per verify."""
    counters = {
        "pkv:spec_decode_num_drafts": ("Verify steps of requests that had drafts.",
                                       spec.num_drafts),
        "pkv:spec_decode_num_draft_tokens": ("Draft tokens proposed.", spec.num_draft_tokens),
        "pkv:spec_decode_num_accepted_tokens": ("Draft tokens accepted.",
                                                spec.num_accepted_tokens),
    }
    for name, (doc, value) in counters.items():
        yield CounterMetricFamily(name, doc, value=value)
    buckets, running = [], 0
    for accepted, count in enumerate(spec.acceptance_lengths):
        running += count
        buckets.append((str(accepted), running))
    buckets.append(("+Inf", running))
    yield HistogramMetricFamily("pkv:spec_decode_acceptance_length",
                                "Draft tokens accepted per verify step.", buckets=buckets,
                                sum_value=spec.num_accepted_tokens)


class ServerMetrics:
    """Engine gauges plus request latency histograms and outcomes."""

    def __init__(self, engine: LLMEngine) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self.ttft = Histogram("pkv:time_to_first_token_seconds", "Time to first token.",
                              buckets=_TTFT_BUCKETS, registry=self.registry)
        # vLLM's two: every step's gap (where stalls show) and each request's mean
        self.itl = Histogram("pkv:inter_token_latency_seconds",
                             "Time from a request's tokens to its next, each step.",
                             buckets=_TPOT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("pkv:request_time_per_output_token_seconds",
                              "Mean time between output tokens of a request.",
                              buckets=_TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram("pkv:e2e_request_latency_seconds", "Request latency, end to end.",
                             buckets=_E2E_BUCKETS, registry=self.registry)
        self.success = Counter("pkv:request_success", "Finished requests by finish reason.",
                               ["finished_reason"], registry=self.registry)
        self.http = Counter("pkv:http_requests", "HTTP requests by API endpoint and status.",
                            ["endpoint", "status"], registry=self.registry)

    def observe(self, timings: RequestTimings) -> None:
        if timings.first_token is not None:
            self.ttft.observe(timings.first_token - timings.arrival)
            per_sample = timings.num_output_tokens / timings.num_samples
            if timings.finished is not None and per_sample > 1:
                self.tpot.observe((timings.finished - timings.first_token) / (per_sample - 1))
        if timings.finished is not None:
            self.e2e.observe(timings.finished - timings.arrival)
        for reason in timings.finish_reasons:
            self.success.labels(reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
