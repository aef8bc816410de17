"""Every Prometheus metric of the hub: its own (`cachefs_hub_` prefix) besides the standard
`process_*` and `python_info`.

Each application gets its own `CollectorRegistry` (never the global one),
so several hubs in one process (tests) keep separate counts. Labels are low
cardinality: `endpoint` is a route name from `ENDPOINTS`, never a path
or a file id.
"""

from __future__ import annotations

from typing import Final

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.exposition import choose_encoder

PREFIX: Final = "cachefs_hub"

# A *_created series per counter and histogram doubles the series a scrape
# stores and no rule or panel uses them (a process-wide setting of the client,
# which leaves this function unannotated).
disable_created_metrics()  # type: ignore[no-untyped-call]

# Route names used as the `endpoint` label. "other" is any path no route
# matches; "malformed" a request the HTTP parser refused (bad request line,
# oversized header, ...), answered before routing.
ENDPOINT_HEALTHZ: Final = "healthz"
ENDPOINT_MANIFEST: Final = "manifest"
ENDPOINT_FILES: Final = "files"
ENDPOINT_CHECKSUMS: Final = "checksums"
ENDPOINT_BATCH: Final = "batch"
ENDPOINT_RESCAN: Final = "rescan"
ENDPOINT_METRICS: Final = "metrics"
ENDPOINT_OTHER: Final = "other"
ENDPOINT_MALFORMED: Final = "malformed"
ENDPOINTS: Final = (
    ENDPOINT_HEALTHZ,
    ENDPOINT_MANIFEST,
    ENDPOINT_FILES,
    ENDPOINT_CHECKSUMS,
    ENDPOINT_BATCH,
    ENDPOINT_RESCAN,
    ENDPOINT_METRICS,
    ENDPOINT_OTHER,
    ENDPOINT_MALFORMED,
)

# The status label of a request whose client went away before the response
# was complete (nginx's convention).
STATUS_CLIENT_CLOSED: Final = "499"

# Reasons of cachefs_hub_auth_failures_total.
AUTH_MISSING: Final = "missing"  # no Authorization header
AUTH_MALFORMED: Final = "malformed"  # not exactly one `Bearer <token>`
AUTH_INVALID: Final = "invalid"  # a token no token file lists

# From a cached block on loopback (sub-millisecond) to a large manifest
# over a slow WAN (minutes).
_DURATION_BUCKETS_S: Final = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)


class HubMetrics:
    """The hub's metrics, registered in a registry of their own."""

    def __init__(self) -> None:
        registry = CollectorRegistry()
        self.registry = registry
        # CPU, memory and file descriptors of the process, and the Python
        # version, under their standard names (process_*, python_info) so that
        # stock dashboards and rules apply; process_open_fds is the one to
        # watch against --max-connections.
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)

        def counter(name: str, text: str, *labels: str) -> Counter:
            return Counter(f"{PREFIX}_{name}", text, labels, registry=registry)

        def gauge(name: str, text: str, *labels: str) -> Gauge:
            return Gauge(f"{PREFIX}_{name}", text, labels, registry=registry)

        # One definition per metric: name after the prefix, help, labels.
        self.requests = counter(
            "requests", "HTTP requests answered, by endpoint and status code (499: client closed first)", "endpoint", "status"
        )
        self.sent_bytes = counter(
            "sent_bytes",
            "Response body bytes sent in full (Content-Length of complete responses; for the streamed manifest, its gzip bytes)",
            "endpoint",
        )
        self.request_duration = Histogram(
            f"{PREFIX}_request_duration_seconds", "Time from the request head to the last byte of the response",
            ["endpoint"], buckets=_DURATION_BUCKETS_S, registry=registry,
        )
        self.open_connections = gauge(
            "open_connections", "Client connections open now (admitted ones, TLS handshakes under way included)"
        )
        self.refused_connections = counter(
            "refused_connections",
            "Connections answered 503 and closed: --max-connections, or --max-connections-per-client from its address, were open",
        )
        self.header_timeouts = counter(
            "header_timeouts", "Connections closed because a request head was not complete within --header-timeout"
        )
        self.auth_failures = counter(
            "auth_failures", "Requests answered 401, by endpoint and reason (missing, malformed, invalid)", "endpoint", "reason"
        )
        self.token_reloads = counter(
            "token_reloads", "Token file reloads (SIGHUP), by result (ok, error: the previous tokens stay in force)", "result"
        )
        self.hashed_bytes = counter(
            "hashed_bytes",
            "Bytes read and hashed, by the endpoint whose request hashed them: block checksums "
            "(each block once while it is remembered; concurrent requests for it share one computation) "
            "and the files of batches",
            "endpoint",
        )
        self.snapshot_info = gauge(
            "snapshot_info", "Always 1; the label carries the generation of the snapshot being served", "generation"
        )
        self.snapshot_files = gauge("snapshot_files", "Regular files in the snapshot")
        self.snapshot_size_bytes = gauge("snapshot_size_bytes", "Total size of the regular files in the snapshot")
        self.snapshot_entries = gauge("snapshot_entries", "Manifest entries (directories, files, symlinks) in the snapshot")
        self.snapshot_scan_seconds = gauge("snapshot_scan_seconds", "How long the scan of the root took")
        self.snapshot_timestamp_seconds = gauge("snapshot_timestamp_seconds", "Unix time at which the scan of the root finished")

        # Every series that can appear is created at zero now, so a rate()
        # over a fresh hub has a starting point.
        for endpoint in ENDPOINTS:
            self.sent_bytes.labels(endpoint)
        for endpoint in (ENDPOINT_FILES, ENDPOINT_CHECKSUMS, ENDPOINT_BATCH):
            self.hashed_bytes.labels(endpoint)
        for result in ("ok", "error"):
            self.token_reloads.labels(result)

    def set_snapshot(
        self,
        *,
        generation: str,
        files: int,
        size_bytes: int,
        entries: int,
        scan_s: float,
        finished_at_s: float,
    ) -> None:
        """Describe the snapshot now being served."""
        self.snapshot_info.clear()
        self.snapshot_info.labels(generation).set(1)
        self.snapshot_files.set(files)
        self.snapshot_size_bytes.set(size_bytes)
        self.snapshot_entries.set(entries)
        self.snapshot_scan_seconds.set(scan_s)
        self.snapshot_timestamp_seconds.set(finished_at_s)

    def count_hashed(self, endpoint: str, size_bytes: int) -> None:
        """Count bytes read and hashed for a request to `endpoint`."""
        self.hashed_bytes.labels(endpoint).inc(size_bytes)

    def observe_request(self, endpoint: str, status: str, duration_s: float, body_bytes: int) -> None:
        """Count one answered request."""
        self.requests.labels(endpoint, status).inc()
        self.request_duration.labels(endpoint).observe(duration_s)
        if body_bytes:
            self.sent_bytes.labels(endpoint).inc(body_bytes)

    def exposition(self, accept_header: str | None) -> tuple[bytes, str]:
        """The registry in the text format the scraper asked for (Prometheus
        text by default, OpenMetrics if its Accept header prefers it)."""
        try:
            encoder, content_type = choose_encoder(accept_header or "")
        except (TypeError, ValueError):  # prometheus_client fails on a version it cannot compare ("version=abc")
            encoder, content_type = choose_encoder("")
        return encoder(self.registry), content_type
