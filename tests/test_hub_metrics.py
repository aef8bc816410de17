"""The hub's /metrics: a real hub subprocess, requests through its HTTP
interface, then the counters read back from /metrics."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hub_helpers import HubProcess, fetch_manifest, http_get, raw_exchange, running_hub, sample, scrape_metrics

from hubserver.app import METRICS_KEY, make_app
from hubserver.config import HubConfig

pytestmark = pytest.mark.timeout(60)

SIZE = 300_000


@dataclass
class Served:
    hub: HubProcess
    contents: dict[str, bytes]  # file id -> bytes
    versions: dict[str, str]  # file id -> version
    manifest_gzip_bytes: int


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("metrics-tree")
    rng = random.Random(5)
    (root / "big.bin").write_bytes(rng.randbytes(SIZE))
    (root / "sub").mkdir()
    (root / "sub" / "small.txt").write_bytes(b"small\n")
    with running_hub(root) as hub:
        manifest = fetch_manifest(hub)
        files = {e["i"]: e for e in manifest.files().values()}
        contents = {i: (root / e["p"]).read_bytes() for i, e in files.items()}
        versions = {i: e["v"] for i, e in files.items()}
        yield Served(hub, contents, versions, len(manifest.reply.body))


def test_counters_labels_and_byte_totals(served: Served) -> None:
    hub = served.hub
    big_id = next(i for i, data in served.contents.items() if len(data) == SIZE)
    url = f"/v1/files/{big_id}?v={served.versions[big_id]}"
    before = scrape_metrics(hub)

    files_body_bytes = 0
    for first, last in [(0, 0), (100, 65635), (SIZE - 10, SIZE + 50)]:
        reply = http_get(hub, url, {"Range": f"bytes={first}-{last}"})
        assert reply.status == 206
        assert reply.body == served.contents[big_id][first : last + 1]
        files_body_bytes += int(reply.headers["content-length"])
    whole = http_get(hub, url)
    assert (whole.status, len(whole.body)) == (200, SIZE)
    files_body_bytes += SIZE
    for path, headers, status in [
        ("/v1/files/0123456789abcdef", {}, 404),
        (url, {"Range": f"bytes={SIZE}-"}, 416),
        ("/v1/files/NOT-AN-ID", {}, 400),
    ]:
        reply = http_get(hub, path, headers)
        assert reply.status == status
        files_body_bytes += int(reply.headers["content-length"])
    assert http_get(hub, "/healthz").status == 200
    assert http_get(hub, "/no/such/route").status == 404
    manifest = http_get(hub, "/v1/manifest")
    assert manifest.status == 200
    malformed, _ = raw_exchange(hub.host, hub.port, b"G\x01T / HTTP/1.1\r\n\r\n")
    assert malformed.startswith(b"HTTP/1.0 400")

    after = scrape_metrics(hub)

    def delta(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    requests = "cachefs_hub_requests_total"
    assert delta(requests, endpoint="files", status="206") == 3
    assert delta(requests, endpoint="files", status="200") == 1
    assert delta(requests, endpoint="files", status="404") == 1
    assert delta(requests, endpoint="files", status="416") == 1
    assert delta(requests, endpoint="files", status="400") == 1
    assert delta(requests, endpoint="healthz", status="200") == 1
    assert delta(requests, endpoint="other", status="404") == 1
    assert delta(requests, endpoint="manifest", status="200") == 1
    assert delta(requests, endpoint="malformed", status="400") == 1
    # The scrape before this one is counted once it is sent.
    assert delta(requests, endpoint="metrics", status="200") == 1

    sent = "cachefs_hub_sent_bytes_total"
    assert delta(sent, endpoint="files") == files_body_bytes
    assert delta(sent, endpoint="manifest") == len(manifest.body) == served.manifest_gzip_bytes

    assert delta("cachefs_hub_request_duration_seconds_count", endpoint="files") == 7
    assert delta("cachefs_hub_request_duration_seconds_sum", endpoint="files") > 0
    assert sample(after, "cachefs_hub_request_duration_seconds_bucket", endpoint="files", le="+Inf") >= 7
    # The scrape's own connection, at least.
    assert sample(after, "cachefs_hub_open_connections") >= 1


def test_snapshot_gauges_match_healthz(served: Served) -> None:
    health = http_get(served.hub, "/healthz").json()
    samples = scrape_metrics(served.hub)
    assert sample(samples, "cachefs_hub_snapshot_info", generation=health["generation"]) == 1
    assert sample(samples, "cachefs_hub_snapshot_files") == health["files"] == len(served.contents)
    assert sample(samples, "cachefs_hub_snapshot_size_bytes") == health["bytes"]
    assert sample(samples, "cachefs_hub_snapshot_entries") == 4  # root, big.bin, sub, sub/small.txt
    assert sample(samples, "cachefs_hub_snapshot_timestamp_seconds") > 1.6e9


def test_every_metric_is_prefixed_and_no_label_is_a_path(served: Served) -> None:
    """The hub's own metrics under cachefs_hub_, the standard process and
    Python ones under their standard names, and no *_created series."""
    http_get(served.hub, "/v1/files/" + next(iter(served.contents)))  # a request with an id in its path
    reply = http_get(served.hub, "/metrics")
    assert reply.headers["content-type"].startswith("text/plain")
    assert b"_created" not in reply.body
    samples = scrape_metrics(served.hub)
    assert samples
    names = {name for name, _ in samples}
    assert {"process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds", "python_info"} <= names
    for name, labels in samples:
        if name.startswith(("process_", "python_info")):
            continue
        assert name.startswith("cachefs_hub_") and not name.startswith("cachefs_hub_process_"), name
        for key, value in labels:
            assert key in {"endpoint", "status", "reason", "result", "generation", "le"}, (name, key)
            assert "/" not in value and value not in served.contents, (name, key, value)


def test_openmetrics_on_request(served: Served) -> None:
    reply = http_get(served.hub, "/metrics", {"Accept": "application/openmetrics-text; version=1.0.0"})
    assert reply.status == 200
    assert reply.headers["content-type"].startswith("application/openmetrics-text")
    assert reply.body.rstrip().endswith(b"# EOF")


@pytest.mark.parametrize(
    "accept",
    ["application/openmetrics-text; version=abc", "text/plain; version=x", "application/openmetrics-text; version=1.a"],
)
def test_an_accept_header_with_a_malformed_version_gets_the_text_format(accept: str) -> None:
    """prometheus_client's choose_encoder raises TypeError on such a version: any client
    (/metrics is open by default) must get the text format, not a 500 and a traceback."""
    from hubserver.metrics import HubMetrics

    body, content_type = HubMetrics().exposition(accept)
    assert content_type.startswith("text/plain")
    assert b"cachefs_hub_requests_total" in body


def test_each_app_has_its_own_registry(tmp_path: Path) -> None:
    from prometheus_client import REGISTRY

    first = make_app(HubConfig(root=tmp_path))[METRICS_KEY]
    second = make_app(HubConfig(root=tmp_path))[METRICS_KEY]
    assert first.registry is not second.registry
    labels = {"endpoint": "files", "status": "206"}
    first.observe_request("files", "206", 0.01, 100)
    assert first.registry.get_sample_value("cachefs_hub_requests_total", labels) == 1
    assert second.registry.get_sample_value("cachefs_hub_requests_total", labels) is None
    assert REGISTRY.get_sample_value("cachefs_hub_requests_total", labels) is None
    assert REGISTRY.get_sample_value("cachefs_hub_snapshot_files") is None
