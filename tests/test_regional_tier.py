"""A regional tier of three real nginx nodes (the shipped deploy/nginx/regional-cache.conf
on each) in front of a real hub, read by real spokes with `--tier`: a dataset larger
than any node's cache crosses the WAN (nginx -> hub, counted by the hub) once, and a
node killed in the middle of a read costs no failed read.

Each node's cache (`max_size`) is 40 % of the dataset, and the dataset is cut into
256 KiB slices (`slice 256k`, `--tier-slice 256K`), enough of them that hashing gives
each node no more than its cache holds: nginx never has to evict in the tests that
count the WAN, so what they count does not depend on when its cache manager runs.
"""

from __future__ import annotations

import math
import os
import random
import re
import signal
import stat
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from dataset import source_files
from hub_helpers import HubProcess, fetch_manifest, running_hub, scrape_metrics, wait_until
from mount_helpers import SpokeMount, mount_spoke, mounted_spoke, run_cachefs
from nginx_helpers import SHIPPED_CONFIG, RegionalCache, running_nginx

from cachefs.fetch.tier_client import slice_owners

KiB = 1024
MiB = 1024 * KiB
NODES = 3
SLICE_BYTES = 256 * KiB
CACHE_SHARE = 0.40  # each node's max_size, of the dataset
WAN_BOUND = 1.05  # bytes the hub may send, of the dataset
# Four spokes with four block sizes: smaller than a slice (grouped into one
# request per slice), one slice, and larger (cut into slices, one per node).
BLOCK_SIZES = ("64K", "256K", "1M", "4M")
# nginx's disk use per cached slice: the body, its header (key, response
# headers) and the rounding up to file-system blocks.
ENTRY_HEADER_BYTES = 2 * KiB
FS_BLOCK_BYTES = 4 * KiB


@pytest.fixture(scope="module")
def tier_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """36 MiB: eight shards of 4-5 MiB with odd sizes and 40 small files."""
    rng = random.Random(34)
    root = tmp_path_factory.mktemp("tier-source") / "data"
    (root / "shards").mkdir(parents=True)
    (root / "small").mkdir()
    for index in range(8):
        (root / "shards" / f"shard-{index:03d}.bin").write_bytes(rng.randbytes(4 * MiB + rng.randrange(1, MiB)))
    for index in range(40):
        (root / "small" / f"file-{index:02d}.dat").write_bytes(rng.randbytes(rng.randrange(1, 40 * KiB)))
    return root


def dataset_bytes(root: Path) -> int:
    return sum((root / relative).stat().st_size for relative in source_files(root))


def node_cache_bytes(root: Path) -> int:
    return int(dataset_bytes(root) * CACHE_SHARE) // KiB * KiB


@contextmanager
def running_tier(hub: HubProcess, workdir: Path, cache_bytes: int) -> Iterator[list[RegionalCache]]:
    edits = [("max_size=2000g ", f"max_size={cache_bytes // KiB}k "), ("    slice 1m;", "    slice 256k;")]
    with ExitStack() as stack:
        yield [stack.enter_context(running_nginx(hub, workdir / f"tier-{index}", edits)) for index in range(NODES)]


def tier_args(nodes: list[RegionalCache]) -> list[str]:
    args = ["--tier-slice", "256K", "--fetch-timeout", "20"]
    for node in nodes:
        args += ["--tier", node.url]
    return args


@contextmanager
def mounted_spokes(hub: HubProcess, workdir: Path, args: Sequence[list[str]]) -> Iterator[list[SpokeMount]]:
    """Spokes mounted side by side (spoke-0, spoke-1, ...), all unmounted after the block."""
    with ThreadPoolExecutor(len(args)) as pool:
        started = [
            pool.submit(mount_spoke, hub.url, workdir / f"spoke-{index}", workdir / f"spoke-{index}-cache", spoke_args)
            for index, spoke_args in enumerate(args)
        ]
    mounts = [future.result() for future in started if future.exception() is None]
    try:
        for future in started:
            future.result()  # the first failure to mount, with the CLI's output
        yield mounts
    finally:
        with ThreadPoolExecutor(len(args)) as pool:
            list(pool.map(SpokeMount.unmount, mounts))


def cached_bytes(node: RegionalCache) -> int:
    """Disk used by the node's cache entries (one nginx's cache manager removes while they are
    counted counts as gone)."""
    total = 0
    for path in (node.prefix / "cache").rglob("*"):
        try:
            info = path.stat()
        except FileNotFoundError:
            continue
        if stat.S_ISREG(info.st_mode):
            total += info.st_blocks * 512
    return total


def manifest_files(hub: HubProcess) -> dict[str, tuple[str, int]]:
    """path -> (file id, size) of every regular file the hub serves."""
    return {path: (entry["i"], entry["s"]) for path, entry in fetch_manifest(hub).files().items()}


def owned_bytes(files: dict[str, tuple[str, int]]) -> list[int]:
    """The disk each node needs for the slices it owns (the spokes' placement)."""
    needed = [0] * NODES
    for file_id, size in files.values():
        for number in range(math.ceil(size / SLICE_BYTES)):
            body = min(SLICE_BYTES, size - number * SLICE_BYTES)
            on_disk = math.ceil((body + ENTRY_HEADER_BYTES) / FS_BLOCK_BYTES) * FS_BLOCK_BYTES
            needed[slice_owners(file_id, number, NODES)[0]] += on_disk
    return needed


def wan_bytes(hub: HubProcess) -> float:
    """Body bytes the hub sent for data, checksums and manifests (not its metrics)."""
    return sum(
        value for (name, labels), value in scrape_metrics(hub).items()
        if name == "cachefs_hub_sent_bytes_total" and dict(labels)["endpoint"] != "metrics"
    )


def read_and_compare(spoke: SpokeMount, dataset: Path, errors: list[str], after_first: threading.Event | None = None,
                     go_on: threading.Event | None = None) -> None:
    """Read every file through `spoke` and compare it with the source; optionally pause after the first."""
    try:
        for index, relative in enumerate(source_files(dataset)):
            if (spoke.mountpoint / relative).read_bytes() != (dataset / relative).read_bytes():
                errors.append(f"{spoke.mountpoint.name}: {relative} differs from the source")
            if index == 0 and after_first is not None and go_on is not None:
                after_first.set()
                go_on.wait(30)
    except OSError as exc:
        errors.append(f"{spoke.mountpoint.name}: {exc}")


def assert_no_failed_read(spoke: SpokeMount) -> dict[str, object]:
    stats = spoke.stats()
    assert stats["fetch_failures"] == 0, stats
    assert not any(stats["fuse_errors"].values()), stats["fuse_errors"]
    return stats


def test_four_spokes_read_a_dataset_larger_than_any_node_and_it_crosses_the_wan_once(
    tier_dataset: Path, tmp_path: Path
) -> None:
    total = dataset_bytes(tier_dataset)
    cache_bytes = node_cache_bytes(tier_dataset)
    with running_hub(tier_dataset) as hub, running_tier(hub, tmp_path, cache_bytes) as nodes:
        files = manifest_files(hub)
        needed = owned_bytes(files)
        # What the test stands on: no node could hold the dataset, or half of
        # it, but each holds the slices the spokes ask it for.
        assert total > 2 * cache_bytes
        assert max(needed) <= cache_bytes - 256 * KiB, f"a node owns {max(needed)} bytes, more than its cache"

        args = tier_args(nodes)
        with mounted_spokes(hub, tmp_path, [[*args, "--block-size", size] for size in BLOCK_SIZES]) as mounts:
            errors: list[str] = []
            # The first spoke fills the tier...
            read_and_compare(mounts[0], tier_dataset, errors)
            assert errors == []
            # ...then the other three read at once, with other block sizes: every
            # slice is asked of the node that already holds it.
            readers = [threading.Thread(target=read_and_compare, args=(m, tier_dataset, errors)) for m in mounts[1:]]
            for reader in readers:
                reader.start()
            for reader in readers:
                reader.join(60)
            assert not any(reader.is_alive() for reader in readers), "reads through the tier hang"
            assert errors == []
            for mount in mounts:
                stats = assert_no_failed_read(mount)
                assert stats["fetched_bytes"] == total  # each spoke got every byte once, from the tier
                requests = stats["tier_requests"]
                assert isinstance(requests, dict)
                assert requests["hub"] == 0 and all(requests[str(node)] > 0 for node in range(NODES)), requests

        wan = wan_bytes(hub)
        assert total <= wan <= WAN_BOUND * total, f"the hub sent {wan / total:.3f} x the dataset"

        # The control: one node alone, asked for every slice twice. Once its
        # cache manager has cut it back to max_size (within 10 s: nginx checks
        # the size between sleeps of at most that), it holds at most 40 % of
        # the dataset, so the second pass fetches the rest from the hub again:
        # the tier's placement, not a cache as large as the dataset, kept the
        # WAN bytes down.
        versions = manifest_versions(hub)

        def read_every_slice_through(node: RegionalCache) -> None:
            for file_id, size in files.values():
                for start in range(0, size, SLICE_BYTES):
                    request = urllib.request.Request(
                        f"{node.url}/v1/files/{file_id}?v={versions[file_id]}",
                        headers={"Range": f"bytes={start}-{min(size, start + SLICE_BYTES) - 1}"},
                    )
                    with urllib.request.urlopen(request, timeout=30) as answer:
                        answer.read()

        read_every_slice_through(nodes[0])
        assert wait_until(lambda: cached_bytes(nodes[0]) <= cache_bytes, 20), "nginx did not keep its cache to max_size"
        before_second_pass = wan_bytes(hub)
        read_every_slice_through(nodes[0])
        assert wan_bytes(hub) - before_second_pass >= (1 - CACHE_SHARE - 0.05) * total


def manifest_versions(hub: HubProcess) -> dict[str, str]:
    """file id -> version."""
    return {entry["i"]: entry["v"] for entry in fetch_manifest(hub).files().values()}


def requests_waiting_at(port: int) -> int:
    """Connections to 127.0.0.1:`port` with request bytes nobody has read (/proc/net/tcp)."""
    waiting = 0
    with open("/proc/net/tcp") as table:
        for line in table.readlines()[1:]:
            fields = line.split()
            local_port = int(fields[1].split(":")[1], 16)
            receive_queue = int(fields[4].split(":")[1], 16)
            if local_port == port and fields[3] == "01" and receive_queue > 0:  # 01: established
                waiting += 1
    return waiting


def test_a_node_killed_in_the_middle_of_a_read_costs_no_failed_read(tier_dataset: Path, tmp_path: Path) -> None:
    with running_hub(tier_dataset) as hub, running_tier(hub, tmp_path, node_cache_bytes(tier_dataset)) as nodes:
        args = tier_args(nodes)
        victim = nodes[1]
        with mounted_spokes(hub, tmp_path, [[*args, "--block-size", "1M"], [*args, "--block-size", "256K"]]) as mounts:
            first, second = mounts
            errors: list[str] = []
            read_and_compare(first, tier_dataset, errors)  # the tier holds the dataset
            after_first, go_on = threading.Event(), threading.Event()
            reader = threading.Thread(target=read_and_compare, args=(second, tier_dataset, errors, after_first, go_on))
            reader.start()
            try:
                assert after_first.wait(30), "the second spoke did not read its first file"
                # Freeze the node, let the reader go on until one of its
                # requests waits there, then kill the node: that request's
                # connection is reset, and the node's slices are refused from
                # then on.
                os.killpg(victim.process.pid, signal.SIGSTOP)
                go_on.set()
                assert wait_until(lambda: requests_waiting_at(victim.port) > 0, 20), "no request reached the frozen node"
                victim.kill()
            finally:
                go_on.set()
                reader.join(60)
            assert not reader.is_alive(), "the read hangs after a node died"
            assert errors == []
            stats = assert_no_failed_read(second)
            failovers, requests = stats["tier_failovers"], stats["tier_requests"]
            assert isinstance(failovers, dict) and isinstance(requests, dict)
            assert failovers["1"] >= 1 and failovers["0"] == failovers["2"] == 0, failovers
            assert requests["0"] > 0 and requests["2"] > 0, requests  # the live nodes took over, from the hub
            assert f"tier node http://127.0.0.1:{victim.port} failed" in second.log_text()
            shown = run_cachefs("stats", second.mountpoint).stdout
            assert re.search(rf"^tier failovers +0 0, 1 {failovers['1']}, 2 0$", shown, re.MULTILINE), shown


def test_the_kubernetes_tier_serves_a_spoke_from_an_https_hub_with_tokens(tier_dataset: Path, tmp_path: Path) -> None:
    """deploy/kubernetes/regional-tier: valid objects, and the container's command, run here,
    makes from the shipped nginx config one that reaches an HTTPS hub requiring tokens (as the
    Kubernetes hub is), checks its certificate, and serves a spoke every file's bytes."""
    manifest = SHIPPED_CONFIG.parent.parent / "kubernetes" / "regional-tier" / "regional-tier.yaml"
    objects = [doc for doc in yaml.safe_load_all(manifest.read_text()) if doc]
    version = kubernetes_validate.utils.latest_version()
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)
    service, statefulset = objects
    assert statefulset["spec"]["serviceName"] == service["metadata"]["name"] and service["spec"]["clusterIP"] == "None"
    pod = statefulset["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
    assert f"proxy_cache_path {mounts['cache']} " in SHIPPED_CONFIG.read_text()
    assert {claim["metadata"]["name"] for claim in statefulset["spec"]["volumeClaimTemplates"]} == {"cache"}
    assert "listen 8470;" in SHIPPED_CONFIG.read_text() and any(p["containerPort"] == 8470 for p in container["ports"])

    env = {variable["name"]: variable["value"] for variable in container["env"]}
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-days", "2", "-subj", f"/CN={env['CACHEFS_HUB_TLS_NAME']}",
                    "-addext", f"subjectAltName=DNS:{env['CACHEFS_HUB_TLS_NAME']}",
                    "-keyout", str(secrets / "hub.key"), "-out", str(secrets / "hub.crt")],
                   check=True, capture_output=True, timeout=60)
    token = "tier-test-" + "t" * 32
    for name, text in [("hub.tokens", f"spokes:{token}\n"), ("spoke.token", f"{token}\n")]:
        (secrets / name).write_text(text)
        (secrets / name).chmod(0o600)
    assert env["CACHEFS_HUB_CA_FILE"].startswith(mounts["hub-ca"] + "/")
    (tmp_path / "ca").mkdir()
    (tmp_path / "ca" / env["CACHEFS_HUB_CA_FILE"].rsplit("/", 1)[1]).write_bytes((secrets / "hub.crt").read_bytes())
    with running_hub(tier_dataset, ["--tls-cert", str(secrets / "hub.crt"), "--tls-key", str(secrets / "hub.key"),
                                    "--token-file", str(secrets / "hub.tokens")]) as hub:
        env["CACHEFS_HUB_ADDRESS"] = f"{hub.host}:{hub.port}"  # the hub as the cluster reaches it
        script = container["args"][0]
        for name, value in env.items():
            script = script.replace(f"$({name})", value)
        script = script.replace(f"{mounts['nginx-config']}/regional-cache.conf", str(SHIPPED_CONFIG))
        script = script.replace(mounts["hub-ca"] + "/", f"{tmp_path / 'ca'}/")
        script = script.replace(f"{mounts['conf-d']}/", f"{tmp_path}/").replace("exec nginx -g 'daemon off;'", "true")
        subprocess.run(["/bin/sh", "-c", script], check=True, timeout=30)
        rendered = (tmp_path / "cachefs-regional.conf").read_text()
        assert "proxy_pass http://" not in rendered and rendered.count("proxy_pass https://cachefs_hub;") == 4
        assert "\n    proxy_ssl_verify on;" in rendered and f"max_size={env['CACHEFS_TIER_MAX_SIZE']} " in rendered
        with running_nginx(hub, tmp_path / "nginx", site=rendered) as node:
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(f"{node.url}/v1/manifest", timeout=30)
            assert refused.value.code == 401  # the hub's answer, passed through
            with mounted_spoke(node.url, tmp_path, ["--token-file", str(secrets / "spoke.token")]) as spoke:
                for relative in source_files(tier_dataset):
                    assert (spoke.mountpoint / relative).read_bytes() == (tier_dataset / relative).read_bytes()
            assert " cache=MISS " in node.access_log() and "SSL" not in node.error_log()
