"""The regional nginx tier (deploy/nginx/regional-cache.conf) with a real nginx,
a real hub and two real spokes: every block crosses the "WAN" (nginx -> hub) once.

nginx runs from the test as a foreground subprocess on a loopback port
(nginx_helpers.py), with a config made from the shipped one by replacing the
hub address, the listen address and the paths.
"""

from __future__ import annotations

import http.client
import math
import re
import threading
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

from dataset import source_files
from hub_helpers import fetch_manifest, running_hub, scrape_metrics
from mount_helpers import is_mounted, mounted_spoke, run_cachefs
from nginx_helpers import SLICE_BYTES, running_nginx

SMALL_BLOCKS = ("--block-size", "64K")  # a spoke whose blocks are smaller than a slice
# The hub's access log: one line per request from its access logger, e.g.
# `INFO hubserver.access: ... "GET /v1/files/<id>?v=<version> HTTP/1.1" 206 ...`.
ACCESS_LINE = re.compile(r' INFO (\S+\.access): .*?"GET (\S+) HTTP/1\.1" (\d{3}) ')
FILE_PATH = re.compile(r"/v1/files/([0-9a-f]{16})\?v=([0-9a-f]{16})(?:&bs=\d+)?")  # bs: sums asked for in a header


def http_get(url: str) -> tuple[int, dict[str, str], bytes]:
    with urllib.request.urlopen(url, timeout=30) as answer:
        return answer.status, dict(answer.headers.items()), answer.read()


def get_range(url: str, first: int, last: int, authorization: str | None = None) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, headers={"Range": f"bytes={first}-{last}"})
    if authorization:
        request.add_header("Authorization", authorization)
    with urllib.request.urlopen(request, timeout=30) as answer:
        return answer.status, dict(answer.headers.items()), answer.read()


def hub_requests(hub_log: str) -> list[tuple[str, str]]:
    """(path, status) of every request the hub logged, in order. Counted from
    one access logger only: "hubserver.access" where the hub has it, else
    aiohttp's, so a hub that logs with both is not counted twice."""
    by_logger: dict[str, list[tuple[str, str]]] = {}
    for line in hub_log.splitlines():
        match = ACCESS_LINE.search(line)
        if match:
            by_logger.setdefault(match.group(1), []).append((match.group(2), match.group(3)))
    return by_logger.get("hubserver.access", by_logger.get("aiohttp.access", []))


def hub_file_requests(hub_log: str) -> Counter[tuple[str, str, str]]:
    """(id, version, status) -> number of file requests the hub answered."""
    counts: Counter[tuple[str, str, str]] = Counter()
    for path, status in hub_requests(hub_log):
        match = FILE_PATH.fullmatch(path)
        if match:
            counts[(match.group(1), match.group(2), status)] += 1
    return counts


def read_all(root: Path, files: list[Path], dataset: Path, errors: list[str]) -> None:
    for relative in files:
        if (root / relative).read_bytes() != (dataset / relative).read_bytes():
            errors.append(f"{root.name}: {relative} differs from the source")


def test_each_block_crosses_the_wan_once_for_two_spokes(dataset: Path, tmp_path: Path) -> None:
    files = source_files(dataset)
    shards = [f for f in files if f.parts[0] == "shards"]
    others = [f for f in files if f.parts[0] != "shards"]
    with running_hub(dataset) as hub, running_nginx(hub, tmp_path / "nginx") as cache:
        manifest = fetch_manifest(cache.url)
        assert "x-cache-status" not in manifest.reply.headers  # the manifest location has no cache
        records = manifest.files()
        assert sorted(records) == sorted(map(str, files))

        # Two spokes with different block sizes: the slices make their
        # different ranges the same cache entries.
        with (
            mounted_spoke(cache.url, tmp_path, ["--fetch-timeout", "20"], name="spoke-a") as spoke_a,
            mounted_spoke(cache.url, tmp_path, [*SMALL_BLOCKS, "--fetch-timeout", "20"], name="spoke-b") as spoke_b,
        ):
            errors: list[str] = []
            # Both nodes start the same epoch at once: concurrent misses of
            # the same slices (proxy_cache_lock lets one through)...
            readers = [
                threading.Thread(target=read_all, args=(spoke.mountpoint, shards, dataset, errors))
                for spoke in (spoke_a, spoke_b)
            ]
            for reader in readers:
                reader.start()
            for reader in readers:
                reader.join(60)
            assert not any(reader.is_alive() for reader in readers), "concurrent reads hang"
            # ...then one node reads the rest cold, and the other one after it.
            read_all(spoke_a.mountpoint, others, dataset, errors)
            read_all(spoke_b.mountpoint, others, dataset, errors)
            assert errors == []
            total_bytes = sum((dataset / f).stat().st_size for f in files)
            assert spoke_a.stats()["fetched_bytes"] == total_bytes
            assert spoke_b.stats()["fetched_bytes"] == total_bytes

        # Straight to nginx with a token: a cached slice is served to any
        # client of the region (the token is not in the cache key).
        shard = records["shards/shard-000.bin"]
        block_url = f"{cache.url}/v1/files/{shard['i']}?v={shard['v']}"
        status, block_headers, body = get_range(block_url, 1000, 2_000_000, authorization="Bearer other-spoke")
        assert status == 206
        assert block_headers["X-Cache-Status"] == "HIT"
        assert body == (dataset / "shards/shard-000.bin").read_bytes()[1000:2_000_001]
        # Block checksums are cached whole, per version, block size and span.
        checksums_url = f"{cache.url}/v1/files/{shard['i']}/checksums?v={shard['v']}&bs={SLICE_BYTES}&first=0&count=64"
        answers = [http_get(checksums_url) for _ in range(2)]
        assert [status for status, _, _ in answers] == [200, 200]
        assert answers[1][1]["X-Cache-Status"] == "HIT"
        assert answers[0][2] == answers[1][2] and len(answers[0][2]) == 8 * math.ceil(int(shard["s"]) / SLICE_BYTES)
        # The manifest is never cached: this one reaches the hub too.
        fetch_manifest(cache.url, {"Authorization": "Bearer other-spoke"})

    # The hub and nginx are stopped now: their logs are complete.
    hub_log, nginx_log = hub.stderr_text(), cache.access_log()
    requests = hub_file_requests(hub_log)
    # Every request the hub saw was an aligned slice answered 206, and each
    # slice of each file was asked for once: every byte was read through the
    # mounts, so every slice was fetched at least once, and the count per
    # file is exactly its number of slices.
    expected = Counter(
        {
            (str(r["i"]), str(r["v"]), "206"): math.ceil(int(r["s"]) / SLICE_BYTES)  # type: ignore[call-overload]
            for r in records.values()
            if int(r["s"]) > 0  # type: ignore[call-overload]
        }
    )
    assert requests == expected, f"hub file requests differ from one per slice:\n{hub_log[-3000:]}"
    checksum_requests = Counter(path for path, _ in hub_requests(hub_log) if "/checksums?" in path)
    assert checksums_url.removeprefix(cache.url) in checksum_requests
    assert set(checksum_requests.values()) == {1}, checksum_requests  # each span once, for both spokes
    # Batches of small files stop at nginx (404): spokes ask file by file, shared here.
    assert not [path for path, _ in hub_requests(hub_log) if path.startswith("/v1/batch")]
    assert "/v1/batch?" in nginx_log
    manifests = [status for path, status in hub_requests(hub_log) if path == "/v1/manifest"]
    assert manifests == ["200"] * 4  # this test, two spokes, this test again
    # nginx's own log agrees: one line per slice, MISS for those it fetched.
    verdicts = Counter(re.findall(r'"GET /v1/files/\S+ HTTP/1\.1" 206 \d+ range="[^"]*" cache=(\w+)', nginx_log))
    assert verdicts["MISS"] == sum(expected.values()), nginx_log[-3000:]
    assert verdicts["HIT"] > verdicts["MISS"]  # the second spoke, at least


def http_status(
    url: str, authorization: str | None = None, byte_range: str | None = None
) -> tuple[int, dict[str, str]]:
    """Status and headers of a GET, errors included (body discarded)."""
    request = urllib.request.Request(url)
    if authorization:
        request.add_header("Authorization", authorization)
    if byte_range:
        request.add_header("Range", byte_range)
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            answer.read()
            return answer.status, dict(answer.headers.items())
    except urllib.error.HTTPError as error:
        error.read()
        return error.code, dict(error.headers.items())


def test_tokens_pass_through_and_cached_blocks_are_shared(dataset: Path, tmp_path: Path) -> None:
    """With a hub that requires bearer tokens: nginx forwards each client's
    Authorization on every miss and on the manifest, passes refusals (401,
    412) through without caching them, and serves a cached block to any
    client of the region (the documented choice: the token is not part of the
    cache key)."""
    token = "spoke-token-0123456789abcdef"
    token_file = tmp_path / "hub.tokens"
    token_file.write_text(f"region-b:{token}\n")
    token_file.chmod(0o600)
    good, bad = f"Bearer {token}", "Bearer wrong-token-0123456789abcdef"
    with (
        running_hub(dataset, ["--token-file", str(token_file)]) as hub,
        running_nginx(hub, tmp_path / "nginx") as cache,
    ):
        assert http_status(cache.url + "/v1/manifest")[0] == 401
        assert http_status(cache.url + "/v1/manifest", bad)[0] == 401
        records = fetch_manifest(cache.url, {"Authorization": good}).files()
        shard_url, other_url = (
            f"{cache.url}/v1/files/{records[name]['i']}?v={records[name]['v']}"
            for name in ("shards/shard-000.bin", "shards/shard-001.bin")
        )
        first_block = f"bytes=0-{SLICE_BYTES - 1}"

        status, headers = http_status(shard_url, good, first_block)
        assert (status, headers["X-Cache-Status"]) == (206, "MISS")  # the hub accepted the forwarded token
        status, headers = http_status(shard_url, None, first_block)
        assert (status, headers["X-Cache-Status"]) == (206, "HIT")  # shared across the region

        assert http_status(other_url, None, first_block)[0] == 401  # a miss goes to the hub, which refuses
        assert http_status(other_url, bad, first_block)[0] == 401
        status, headers = http_status(other_url, good, first_block)
        assert (status, headers["X-Cache-Status"]) == (206, "MISS")  # the refusals were not cached

        # A spoke with the token mounts and reads through nginx; one without
        # is refused by the hub at mount time (the manifest is never cached).
        with mounted_spoke(cache.url, tmp_path, ["--token-file", str(token_file)], name="spoke") as spoke:
            for relative in ("shards/shard-001.bin", "small/dir 0/file-00.dat"):
                assert (spoke.mountpoint / relative).read_bytes() == (dataset / relative).read_bytes()
        (tmp_path / "no-token").mkdir()
        refused = run_cachefs("mount", cache.url, tmp_path / "no-token", "--cache-dir", tmp_path / "no-token-cache")
        assert refused.returncode != 0 and not is_mounted(tmp_path / "no-token")
        assert "401" in refused.stderr or "token" in refused.stderr.lower(), refused.stderr

        # A version the hub no longer serves: its 412 passes through (the
        # spoke turns it into ESTALE), and is not cached either.
        stale_url = other_url.rsplit("=", 1)[0] + "=0123456789abcdef"
        assert http_status(stale_url, good, first_block)[0] == 412
        assert http_status(stale_url, good, first_block)[0] == 412

    statuses = hub_file_requests(hub.stderr_text())
    other = records["shards/shard-001.bin"]
    refusals = {key: count for key, count in statuses.items() if key[2] != "206"}
    assert refusals == {(str(other["i"]), str(other["v"]), "401"): 2, (str(other["i"]), "0123456789abcdef", "412"): 2}
    # Whoever asked (this test with or without a token, the spoke), each
    # slice reached the hub at most once.
    slices = {str(r["i"]): math.ceil(int(r["s"]) / SLICE_BYTES) for r in records.values()}  # type: ignore[call-overload]
    assert all(count <= slices[file_id] for (file_id, _, status), count in statuses.items() if status == "206")


def request_status(url: str, method: str, path: str) -> int:
    """The status of one request (`method`, no body) to the server at `url`."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def test_only_reads_pass_through(dataset: Path, tmp_path: Path) -> None:
    """Spokes only GET: POST /v1/rescan (a whole scan of the hub's root, for
    the hub's operators) and every other method are refused by nginx and
    never reach the hub, while reads still do."""
    with running_hub(dataset) as hub, running_nginx(hub, tmp_path / "nginx") as cache:
        assert request_status(hub.url, "POST", "/v1/rescan") == 200  # the hub itself takes it
        for method, path in [("POST", "/v1/rescan"), ("POST", "/v1/manifest"), ("PUT", "/v1/files/0123456789abcdef"),
                             ("DELETE", "/v1/files/0123456789abcdef"), ("PATCH", "/healthz"), ("OPTIONS", "/v1/rescan")]:
            assert request_status(cache.url, method, path) == 405, (method, path)
        assert request_status(cache.url, "GET", "/healthz") == 200
        assert request_status(cache.url, "HEAD", "/healthz") == 200
        samples = scrape_metrics(hub)
    answered = {
        (dict(labels)["endpoint"], dict(labels)["status"]): count
        for (name, labels), count in samples.items() if name == "cachefs_hub_requests_total" and count
    }
    assert answered == {("rescan", "200"): 1, ("healthz", "200"): 2}  # the direct POST and the two reads
