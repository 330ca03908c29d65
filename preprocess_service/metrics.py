"""``/metrics`` with ``prometheus_client``: the job counts from the job store (a custom collector, so every replica
reports the same numbers, which survive restarts) and this process's request latency per route.

Each app has its own :class:`~prometheus_client.CollectorRegistry` (not the process-wide default), so several apps in
one process (the tests) never collide.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from preprocess_service.store import DURATION_BUCKETS, STATES

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
FINISHED_RESULTS = ("succeeded", "failed", "cancelled", "deleted")
UNMATCHED_ROUTE = "unmatched"
"""The ``route`` label of requests that matched no route (404s, and requests refused before routing: 401, 413, 429),
so that made-up paths cannot grow the label set."""


class JobStoreCollector:
    """Jobs by state, jobs ended, rows and tokens tokenized, job durations (kept in the job store), workers alive and
    uptime, read from ``state`` (the app's state: ``store``, ``supervisor``, ``started``) at each scrape."""

    def __init__(self, state: Any):
        self.state = state

    def collect(self):
        store = getattr(self.state, "store", None)
        if store is None:  # scraped before start-up finished: nothing to report yet
            return
        counts, counters = store.counts_by_state(), store.counters()
        running = store.query("SELECT COALESCE(SUM(rows_done),0) AS r, COALESCE(SUM(tokens_done),0) AS t "
                              "FROM jobs WHERE state='running'")[0]
        jobs = GaugeMetricFamily("pf_service_jobs", "Jobs in the store, by state.", labels=["state"])
        for state in STATES:
            jobs.add_metric([state], counts[state])
        yield jobs
        finished = CounterMetricFamily("pf_service_jobs_finished", "Jobs that ended, by result.", labels=["result"])
        for result in FINISHED_RESULTS:
            finished.add_metric([result], int(counters.get(f"jobs_{result}_total", 0)))
        yield finished
        for name, key, text in (
                ("pf_service_datasets_withdrawn", "jobs_corrupt_total",
                 "Published datasets found corrupt and withdrawn."),
                ("pf_service_rows_tokenized", "rows_tokenized_total", "Source rows of succeeded jobs."),
                ("pf_service_tokens_tokenized", "tokens_tokenized_total", "Tokens written by succeeded jobs.")):
            yield CounterMetricFamily(name, text, value=int(counters.get(key, 0)))
        yield GaugeMetricFamily("pf_service_rows_in_progress", "Rows done so far by running jobs.", value=running["r"])
        buckets = [(str(le), int(counters.get(f"duration_bucket:{le}", 0))) for le in DURATION_BUCKETS]
        buckets.append(("+Inf", int(counters.get("duration_bucket:+Inf", 0))))
        yield HistogramMetricFamily("pf_service_job_duration_seconds", "Wall time of ended jobs (claim to succeeded, "
                                    "failed, cancelled or deleted while running).", buckets=buckets,
                                    sum_value=float(counters.get("duration_sum", 0.0)))
        yield GaugeMetricFamily("pf_service_workers", "Worker processes alive.",
                                value=len(self.state.supervisor.live_pids()))
        yield GaugeMetricFamily("pf_service_uptime_seconds", "Seconds since the service started.",
                                value=time.time() - self.state.started)


class ServiceMetrics:
    """The app's registry: the job-store collector and the request latency histogram."""

    def __init__(self, state: Any):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(JobStoreCollector(state))
        self.request_seconds = Histogram(
            "pf_service_http_request_duration_seconds", "Time to answer an HTTP request (for an event stream: until "
            "it ends), by route template, method and status.", ["route", "method", "status"], registry=self.registry)

    def render(self) -> bytes:
        """The Prometheus text format of everything registered."""
        return generate_latest(self.registry)


class RequestLatencyMiddleware:
    """ASGI middleware: observe each HTTP request's duration under its route template (``/v1/datasets/{dataset_id}``,
    never the raw path), method and status. Outermost, so refusals by the other middlewares count too."""

    def __init__(self, app, metrics: ServiceMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status = time.perf_counter(), [500]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = getattr(scope.get("route"), "path", None) or UNMATCHED_ROUTE
            self.metrics.request_seconds.labels(route, scope["method"], str(status[0])).observe(
                time.perf_counter() - started)
