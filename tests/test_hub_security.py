"""The hub against clients without credentials, with stolen or rotated
ones, over TLS, and against hostile input: real `python -m hubserver`
subprocesses on loopback, spoken to with the standard library (and raw
sockets where a well-behaved client cannot say what is needed)."""

from __future__ import annotations

import datetime
import errno
import http.client
import ipaddress
import json
import os
import random
import re
import resource
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from hub_helpers import (
    HubProcess,
    Manifest,
    Reply,
    fetch_manifest,
    http_get,
    raw_exchange,
    run_hub_cli,
    running_hub,
    sample,
    scrape_metrics,
    wait_until,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hubserver.auth import RefusalLog, TokenStore, read_token_file
from hubserver.beneath import open_beneath, open_walking
from hubserver.cli import exposure_warning, main
from hubserver.clients import client_of
from hubserver.errors import TokenFileError

pytestmark = pytest.mark.timeout(60)

ALICE = "alice-0123456789abcdefABCDEF"
BOB = "bob-token-9876543210zyxwvu"
CAROL = "carol_rotated-token.0123456789"
WRONG = "not-a-token-anyone-knows-0000"
METRICS_TOKEN = "prometheus-scraper-token-42"
SECRET_MARKER = b"SECRET-MARKER-5a0c3d1e9b"
BIG_SIZE = 200_000


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def write_token_file(path: Path, text: str, mode: int = 0o600) -> Path:
    """Write a token file atomically with ``mode`` (as rotation would)."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(text, encoding="utf-8")
    os.chmod(tmp, mode)
    os.replace(tmp, path)
    return path


# --------------------------------------------------------------- the dataset


@dataclass
class Dataset:
    root: Path
    contents: dict[str, bytes]  # relative path -> bytes, every regular file


def make_dataset(base: Path) -> Dataset:
    """A root with a symlink and a directory symlink pointing outside it,
    at a file holding SECRET_MARKER."""
    outside = base / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_bytes(SECRET_MARKER + b"\n")
    root = base / "root"
    (root / "nested").mkdir(parents=True)
    rng = random.Random(11)
    contents = {
        "big.bin": rng.randbytes(BIG_SIZE),
        "small.txt": b"hello\n",
        "nested/leaf.bin": rng.randbytes(3000),
        "empty.bin": b"",
    }
    for rel, data in contents.items():
        (root / rel).write_bytes(data)
    os.symlink(outside / "secret.txt", root / "escape")
    os.symlink("../outside", root / "dir_escape")
    os.symlink("../../outside/secret.txt", root / "nested" / "relative_escape")
    return Dataset(root, contents)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Dataset:
    return make_dataset(tmp_path_factory.mktemp("security"))


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokens") / "tokens"
    return write_token_file(path, f"# spokes\nalice:{ALICE}\n\n  bob : {BOB}  \n")


@pytest.fixture(scope="module")
def auth_hub(dataset: Dataset, token_file: Path) -> Iterator[HubProcess]:
    with running_hub(dataset.root, ["--token-file", str(token_file)]) as hub:
        yield hub


@pytest.fixture(scope="module")
def manifest(auth_hub: HubProcess) -> Manifest:
    return fetch_manifest(auth_hub, bearer(ALICE))


def file_url(entry: dict[str, Any]) -> str:
    return f"/v1/files/{entry['i']}?v={entry['v']}"


def assert_json_error(reply: Reply, status: int) -> None:
    assert reply.status == status, (reply.status, reply.body[:200])
    assert set(reply.json()) == {"error"}
    assert b"Traceback" not in reply.body


# --------------------------------------------------------------- bearer tokens


@pytest.mark.parametrize(
    "headers",
    [
        {},
        bearer(WRONG),
        bearer(ALICE + "x"),
        bearer(ALICE[:-1]),
        {"Authorization": f"Basic {ALICE}"},
        {"Authorization": "Bearer"},
        {"Authorization": "Bearer "},
        {"Authorization": f"Bearer {ALICE} {ALICE}"},
        {"Authorization": ALICE},
        {"X-Token": ALICE},
    ],
    ids=lambda headers: repr(headers)[:40],
)
def test_requests_without_a_valid_token_get_401(auth_hub: HubProcess, manifest: Manifest, headers) -> None:
    big = manifest.file("big.bin")
    for path in ("/v1/manifest", file_url(big), f"/v1/files/{big['i']}", "/v1/files/0123456789abcdef", "/v2/nothing"):
        reply = http_get(auth_hub, path, {**headers, "Range": "bytes=0-99"})
        assert_json_error(reply, 401)
        assert reply.headers["www-authenticate"].startswith("Bearer")
        assert "authentication required" in reply.json()["error"]
        assert len(reply.body) < 200  # an error, not data


def test_two_authorization_headers_get_401(auth_hub: HubProcess) -> None:
    raw, closed = raw_exchange(
        auth_hub.host,
        auth_hub.port,
        b"GET /v1/manifest HTTP/1.1\r\nHost: hub\r\nAuthorization: Bearer "
        + ALICE.encode()
        + b"\r\nAuthorization: Bearer "
        + WRONG.encode()
        + b"\r\nConnection: close\r\n\r\n",
    )
    assert closed and raw.startswith(b"HTTP/1.1 401 ")


@pytest.mark.parametrize("token", [ALICE, BOB])
def test_every_listed_token_reads_data(auth_hub: HubProcess, manifest: Manifest, dataset: Dataset, token) -> None:
    big = manifest.file("big.bin")
    reply = http_get(auth_hub, file_url(big), {**bearer(token), "Range": "bytes=1000-4999"})
    assert reply.status == 206
    assert reply.body == dataset.contents["big.bin"][1000:5000]
    assert http_get(auth_hub, "/v1/manifest", bearer(token)).status == 200


def test_scheme_is_case_insensitive(auth_hub: HubProcess) -> None:
    assert http_get(auth_hub, "/v1/manifest", {"Authorization": f"bearer {ALICE}"}).status == 200


def test_healthz_and_metrics_stay_open(auth_hub: HubProcess) -> None:
    health = http_get(auth_hub, "/healthz")
    assert health.status == 200 and health.json()["status"] == "ok"
    assert http_get(auth_hub, "/metrics").status == 200  # no --metrics-token-file


def test_log_names_the_client_never_the_token(dataset: Dataset, token_file: Path, manifest: Manifest) -> None:
    big = manifest.file("big.bin")
    with running_hub(dataset.root, ["--token-file", str(token_file)]) as hub:
        assert http_get(hub, file_url(big), {**bearer(BOB), "Range": "bytes=0-9"}).status == 206
        assert http_get(hub, file_url(big), bearer(WRONG)).status == 401
        pattern = re.compile(rf'127\.0\.0\.1 bob "GET /v1/files/{big["i"]}\?v={big["v"]} HTTP/1\.1" 206 10 ')
        assert wait_until(lambda: pattern.search(hub.stderr_text()) is not None, 5)
        assert wait_until(lambda: "rejected GET /v1/files/" in hub.stderr_text(), 5)
    log = hub.stderr_text()
    assert "unknown token" in log
    for token in (ALICE, BOB, WRONG):
        assert token not in log
    assert "Traceback" not in log


def test_a_client_s_401s_are_logged_once_a_minute_and_all_counted(dataset: Dataset, token_file: Path) -> None:
    with running_hub(dataset.root, ["--token-file", str(token_file)]) as hub:
        for _ in range(20):
            assert http_get(hub, "/v1/manifest", bearer(WRONG)).status == 401
        with socket.create_connection((hub.host, hub.port), timeout=5, source_address=("127.0.0.2", 0)) as other:
            other.sendall(b"GET /v1/manifest HTTP/1.1\r\nHost: hub\r\nConnection: close\r\n\r\n")
            assert other.makefile("rb").readline().startswith(b"HTTP/1.1 401 ")
        failures = sample(scrape_metrics(hub), "cachefs_hub_auth_failures_total", endpoint="manifest", reason="invalid")
        assert wait_until(lambda: "from 127.0.0.2" in hub.stderr_text(), 5)
    rejections = [line for line in hub.stderr_text().splitlines() if " rejected " in line]
    assert failures == 20
    assert len(rejections) == 2, rejections  # one for each client


def test_a_client_s_next_report_a_minute_later_says_how_many_were_not_logged() -> None:
    refusals = RefusalLog(interval_s=60)
    assert refusals.due("192.0.2.1", now=0) == 0
    assert [refusals.due("192.0.2.1", now=t) for t in (1, 30, 59.9)] == [None, None, None]
    assert refusals.due("192.0.2.2", now=30) == 0  # another client has its own minute
    assert refusals.due("192.0.2.1", now=60) == 3
    assert refusals.due("192.0.2.1", now=61) is None


def test_auth_failures_are_counted_by_endpoint_and_reason(auth_hub: HubProcess) -> None:
    before = scrape_metrics(auth_hub)
    http_get(auth_hub, "/v1/manifest")
    http_get(auth_hub, "/v1/manifest", bearer(WRONG))
    http_get(auth_hub, "/v1/files/0123456789abcdef", {"Authorization": "Basic x"})
    after = scrape_metrics(auth_hub)
    name = "cachefs_hub_auth_failures_total"
    for endpoint, reason in [("manifest", "missing"), ("manifest", "invalid"), ("files", "malformed")]:
        change = sample(after, name, endpoint=endpoint, reason=reason) - sample(
            before, name, endpoint=endpoint, reason=reason
        )
        assert change == 1, (endpoint, reason)
    change = sample(after, "cachefs_hub_requests_total", endpoint="manifest", status="401") - sample(
        before, "cachefs_hub_requests_total", endpoint="manifest", status="401"
    )
    assert change == 2


def test_token_rotation_on_sighup_without_restart(dataset: Dataset, tmp_path: Path) -> None:
    path = write_token_file(tmp_path / "tokens", f"alice:{ALICE}\n")
    with running_hub(dataset.root, ["--token-file", str(path)]) as hub:
        pid = hub.proc.pid

        def reloads() -> int:
            return hub.stderr_text().count("reloaded token file")

        def status(token: str) -> int:
            return http_get(hub, "/v1/manifest", bearer(token)).status

        assert (status(ALICE), status(CAROL)) == (200, 401)
        # Step 1: add the new token next to the old one; both work.
        write_token_file(path, f"alice:{ALICE}\ncarol:{CAROL}\n")
        hub.proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: reloads() == 1, 10)
        assert (status(ALICE), status(CAROL)) == (200, 200)
        # Step 2: drop the old one; it is refused from now on.
        write_token_file(path, f"carol:{CAROL}\n")
        hub.proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: reloads() == 2, 10)
        assert (status(ALICE), status(CAROL)) == (401, 200)
        # A broken file is refused and the tokens in force stay.
        write_token_file(path, f"carol:{CAROL}\n", mode=0o644)
        hub.proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: "tokens loaded before stay in force" in hub.stderr_text(), 10)
        assert (status(ALICE), status(CAROL)) == (401, 200)
        samples = scrape_metrics(hub)
        assert sample(samples, "cachefs_hub_token_reloads_total", result="ok") == 2
        assert sample(samples, "cachefs_hub_token_reloads_total", result="error") == 1
        assert hub.proc.poll() is None and hub.proc.pid == pid
        assert "carol" in hub.stderr_text()  # the names are logged...
    log = hub.stderr_text()
    for token in (ALICE, CAROL):
        assert token not in log  # ...never the tokens
    assert "Traceback" not in log


def test_metrics_token_file_protects_metrics_only(dataset: Dataset, token_file: Path, tmp_path: Path) -> None:
    metrics_tokens = write_token_file(tmp_path / "metrics-tokens", f"prometheus:{METRICS_TOKEN}\n")
    args = ["--token-file", str(token_file), "--metrics-token-file", str(metrics_tokens)]
    with running_hub(dataset.root, args) as hub:
        assert_json_error(http_get(hub, "/metrics"), 401)
        assert_json_error(http_get(hub, "/metrics", bearer(ALICE)), 401)  # data tokens are not enough
        assert http_get(hub, "/metrics", bearer(METRICS_TOKEN)).status == 200
        assert_json_error(http_get(hub, "/v1/manifest", bearer(METRICS_TOKEN)), 401)  # nor the other way
        assert http_get(hub, "/v1/manifest", bearer(ALICE)).status == 200
        assert http_get(hub, "/healthz").status == 200


def test_metrics_token_file_alone_leaves_data_open(dataset: Dataset, tmp_path: Path) -> None:
    metrics_tokens = write_token_file(tmp_path / "metrics-tokens", f"prometheus:{METRICS_TOKEN}\n")
    with running_hub(dataset.root, ["--metrics-token-file", str(metrics_tokens)]) as hub:
        assert http_get(hub, "/v1/manifest").status == 200
        assert http_get(hub, "/metrics").status == 401


# --------------------------------------------------------------- CLI errors


ADMIN_TOKEN = "operator-rescan-token-0123456789"


def test_rescan_needs_an_admin_token_not_a_data_token(dataset: Dataset, token_file: Path, tmp_path: Path) -> None:
    """POST /v1/rescan is its own permission: a data token does not allow it; a token of
    --admin-token-file does, and opens nothing else."""
    admin_tokens = write_token_file(tmp_path / "admin-tokens", f"operator:{ADMIN_TOKEN}\n")
    with running_hub(dataset.root, ["--token-file", str(token_file)]) as hub:
        refused = http_get(hub, "/v1/rescan", bearer(ALICE), method="POST")
        assert_json_error(refused, 403)
        assert "--admin-token-file" in refused.json()["error"]
    args = ["--token-file", str(token_file), "--admin-token-file", str(admin_tokens)]
    with running_hub(dataset.root, args) as hub:
        assert_json_error(http_get(hub, "/v1/rescan", bearer(ALICE), method="POST"), 401)
        assert_json_error(http_get(hub, "/v1/rescan", method="POST"), 401)
        rescanned = http_get(hub, "/v1/rescan", bearer(ADMIN_TOKEN), method="POST")
        assert rescanned.status == 200 and rescanned.json()["rescanned"] is True
        assert_json_error(http_get(hub, "/v1/manifest", bearer(ADMIN_TOKEN)), 401)
        assert http_get(hub, "/v1/manifest", bearer(ALICE)).status == 200
        assert wait_until(lambda: ' operator "POST /v1/rescan HTTP/1.1" 200 ' in hub.stderr_text(), 5)
    assert ADMIN_TOKEN not in hub.stderr_text()


def assert_one_line_error(result, *needles: str) -> None:
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("cachefs-hub: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("text", "mode", "needles"),
    [
        (f"alice:{ALICE}\n", 0o644, ("accessible by others or by a group", "0644", "chmod 600")),
        ("alice:short-secret\n", 0o600, ("line 1", "16 to 1024 characters")),
    ],
)
def test_bad_token_file_is_one_line_error(tmp_path: Path, text: str, mode: int, needles) -> None:
    path = write_token_file(tmp_path / "tokens", text, mode)
    result = run_hub_cli(["serve", "--root", tmp_path, "--listen", "127.0.0.1:0", "--token-file", path])
    assert_one_line_error(result, str(path), *needles)
    for secret in ("short-secret", ALICE):
        assert secret not in result.stderr


@pytest.mark.parametrize(
    ("text", "mode", "needles"),
    [
        (f"alice:{ALICE}\n", 0o660, ("accessible by others or by a group",)),  # the group may write
        (f"alice:{ALICE}\n", 0o602, ("accessible by others or by a group",)),
        ("# only a comment\n\n", 0o600, ("no NAME:TOKEN line",)),
        (f"# header\nalice {ALICE}\n", 0o600, ("line 2", "expected NAME:TOKEN")),
        (f"alice:{ALICE} extra\n", 0o600, ("line 1", "TOKEN must be")),
        (f"alice:{ALICE}\nalice:{BOB}\n", 0o600, ("line 2", "appears twice")),
        (f"alice:{ALICE}\nbob:{ALICE}\n", 0o600, ("line 2", "also listed")),
        (f"al ice:{ALICE}\n", 0o600, ("line 1", "NAME must be")),
        (f"alice:{ALICE}\nbob:{BOB}\xe9\n", 0o600, ("line 2", "not ASCII")),
    ],
)
def test_token_file_errors_name_the_line_never_the_token(tmp_path: Path, text: str, mode: int, needles) -> None:
    path = write_token_file(tmp_path / "tokens", text, mode)
    with pytest.raises(TokenFileError) as caught:
        read_token_file(path)
    message = str(caught.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message
    assert ALICE not in message and BOB not in message


def test_a_token_file_only_its_owner_and_the_hub_s_own_group_may_read_is_taken(tmp_path: Path) -> None:
    """A Kubernetes Secret mounted with fsGroup is root:fsGroup 0440: the hub's group may read it."""
    path = write_token_file(tmp_path / "tokens", f"alice:{ALICE}\n", 0o440)
    assert os.stat(path).st_gid == os.getegid()
    assert [token.name for token in read_token_file(path)] == ["alice"]
    mine = {os.getegid(), *os.getgroups()}
    os.chown(path, -1, next(gid for gid in range(60000, 65000) if gid not in mine))
    with pytest.raises(TokenFileError, match="by a group not the hub's own"):
        read_token_file(path)


def test_token_file_accepts_comments_blank_lines_and_spaces(token_file: Path) -> None:
    store = TokenStore.load(token_file)
    assert store.names == ["alice", "bob"]
    assert (store.identify(ALICE), store.identify(BOB), store.identify(WRONG)) == ("alice", "bob", None)


def run_cli_in_process(args: Sequence[str | os.PathLike[str]], capsys: pytest.CaptureFixture[str]) -> SimpleNamespace:
    """``cachefs-hub`` errors that come before binding, without a process."""
    returncode: int | str | None
    try:
        returncode = main([os.fspath(arg) for arg in args])
    except SystemExit as exc:
        returncode = exc.code
    captured = capsys.readouterr()
    return SimpleNamespace(returncode=returncode, stdout=captured.out, stderr=captured.err)


def test_missing_token_file_is_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = run_cli_in_process(["serve", "--root", tmp_path, "--token-file", tmp_path / "nope"], capsys)
    assert_one_line_error(result, "cannot read token file", "No such file")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--tls-cert", "cert.pem"], "--tls-cert and --tls-key go together"),
        (["--tls-key", "key.pem"], "--tls-cert and --tls-key go together"),
        (["--tls-client-ca", "ca.pem"], "--tls-client-ca needs --tls-cert"),
        (["--tls-cert", "missing.pem", "--tls-key", "missing.pem"], "cannot load --tls-cert missing.pem"),
    ],
)
def test_tls_option_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, args: list[str], needle: str
) -> None:
    monkeypatch.chdir(tmp_path)
    result = run_cli_in_process(["serve", "--root", tmp_path, *args], capsys)
    assert_one_line_error(result, needle)


@pytest.mark.parametrize("option", ["--tls-cert", "--tls-key", "--tls-client-ca"])
def test_a_fifo_as_a_tls_file_is_one_line_error_not_a_hang(tmp_path: Path, pki: PKI, option: str) -> None:
    fifo = tmp_path / "fifo.pem"
    os.mkfifo(fifo)
    files = {"--tls-cert": pki.server_cert, "--tls-key": pki.server_key, "--tls-client-ca": pki.ca, option: fifo}
    args = [arg for pair in files.items() for arg in map(str, pair)]
    result = run_hub_cli(["serve", "--root", tmp_path, "--listen", "127.0.0.1:0", *args], timeout_s=10)
    assert_one_line_error(result, option, "not a regular file")


def test_a_root_under_a_directory_that_cannot_be_searched_is_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a user without search permission on a directory above the root, Path.exists()
    raises PermissionError, which must not become a traceback; root bypasses permissions, so it is faked."""
    root = tmp_path / "closed" / "root"
    real_stat = Path.stat

    def stat(self: Path, *, follow_symlinks: bool = True) -> os.stat_result:
        if self == root:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_stat(self, follow_symlinks=follow_symlinks)

    monkeypatch.setattr(Path, "stat", stat)
    result = run_cli_in_process(["serve", "--root", root], capsys)
    assert_one_line_error(result, str(root), "Permission denied")


def test_tls_key_not_matching_the_cert_is_one_line_error(
    tmp_path: Path, pki: PKI, capsys: pytest.CaptureFixture[str]
) -> None:
    args: list[str | Path] = ["serve", "--root", tmp_path, "--tls-cert", pki.server_cert, "--tls-key", pki.client_key]
    assert_one_line_error(run_cli_in_process(args, capsys), "cannot load --tls-cert", "KEY_VALUES_MISMATCH")


@pytest.mark.parametrize(
    ("option", "value"), [("--max-connections", "0"), ("--header-timeout", "-1"), ("--send-timeout", "abc")]
)
def test_limits_options_are_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str, value: str
) -> None:
    result = run_cli_in_process(["serve", "--root", tmp_path, option, value], capsys)
    assert result.returncode == 2 and option in result.stderr, result.stderr
    assert len(result.stderr.splitlines()) == 1


def test_a_per_client_limit_above_the_total_is_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before, 600 per client with 512 in all was accepted and silently meant 512."""
    args: list[str | Path] = ["serve", "--root", tmp_path, "--max-connections", "512", "--max-connections-per-client", "600"]
    assert_one_line_error(run_cli_in_process(args, capsys), "--max-connections-per-client 600 is above --max-connections 512")


# --------------------------------------------------------------- TLS


@dataclass
class PKI:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_cert: Path  # a client certificate from another CA
    rogue_key: Path

    def client_context(self, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca))
        if cert is not None:
            context.load_cert_chain(cert, key)
        return context


def _write_key(path: Path, key: Any) -> Path:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    os.chmod(path, 0o600)
    return path


def _issue(
    subject_cn: str,
    issuer: tuple[Any, Any] | None,
    *,
    ca: bool = False,
    server: bool = False,
) -> tuple[Any, Any]:
    """A certificate and its EC key; self-signed when ``issuer`` is None."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject_cn)])
    issuer_cert, issuer_key = issuer if issuer is not None else (None, key)
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer_cert.subject if issuer_cert is not None else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        ).add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    else:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if issuer_cert is not None:
            builder = builder.add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_cert.public_key()), critical=False
            )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
    return builder.sign(issuer_key, hashes.SHA256()), key


def _write_cert(path: Path, cert: Any) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    base = tmp_path_factory.mktemp("pki")
    ca = _issue("cachefs test CA", None, ca=True)
    server = _issue("localhost", ca, server=True)
    client = _issue("spoke-1", ca)
    rogue_ca = _issue("rogue CA", None, ca=True)
    rogue = _issue("spoke-1", rogue_ca)
    return PKI(
        ca=_write_cert(base / "ca.pem", ca[0]),
        server_cert=_write_cert(base / "server.pem", server[0]),
        server_key=_write_key(base / "server.key", server[1]),
        client_cert=_write_cert(base / "client.pem", client[0]),
        client_key=_write_key(base / "client.key", client[1]),
        rogue_cert=_write_cert(base / "rogue.pem", rogue[0]),
        rogue_key=_write_key(base / "rogue.key", rogue[1]),
    )


def tls_args(pki: PKI) -> list[str]:
    return ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key)]


# What a failed TLS handshake looks like to the stdlib client, depending on
# where it fails (TLS 1.3 reports a refused client certificate on first read).
TLS_FAILURES = (ssl.SSLError, ConnectionError, http.client.RemoteDisconnected, http.client.BadStatusLine)


def test_tls_serves_clients_that_trust_the_ca(dataset: Dataset, pki: PKI, token_file: Path) -> None:
    with running_hub(dataset.root, [*tls_args(pki), "--token-file", str(token_file)]) as hub:
        assert hub.url.startswith("https://127.0.0.1:")
        context = pki.client_context()
        assert http_get(hub, "/healthz", ssl_context=context).status == 200
        entry = fetch_manifest(hub, bearer(ALICE), ssl_context=context).file("big.bin")
        reply = http_get(hub, file_url(entry), {**bearer(ALICE), "Range": "bytes=10-19"}, ssl_context=context)
        assert (reply.status, reply.body) == (206, dataset.contents["big.bin"][10:20])
        assert http_get(hub, "/v1/manifest", ssl_context=context).status == 401
        with socket.create_connection((hub.host, hub.port), timeout=5) as raw:
            with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                assert tls.version() in ("TLSv1.2", "TLSv1.3")
        # A client that does not trust the hub's CA refuses it.
        with pytest.raises(ssl.SSLCertVerificationError):
            http_get(hub, "/healthz", ssl_context=ssl.create_default_context())
        # Plain HTTP to the TLS port gets no HTTP answer.
        data, closed = raw_exchange(hub.host, hub.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert closed and not data.startswith(b"HTTP/")
        assert http_get(hub, "/healthz", ssl_context=context).status == 200
    assert "Traceback" not in hub.stderr_text()


def test_mutual_tls_requires_a_client_certificate_from_the_ca(dataset: Dataset, pki: PKI) -> None:
    with running_hub(dataset.root, [*tls_args(pki), "--tls-client-ca", str(pki.ca)]) as hub:
        good = pki.client_context(pki.client_cert, pki.client_key)
        assert http_get(hub, "/v1/manifest", ssl_context=good).status == 200
        with pytest.raises(TLS_FAILURES):
            http_get(hub, "/healthz", ssl_context=pki.client_context())
        with pytest.raises(TLS_FAILURES):
            http_get(hub, "/healthz", ssl_context=pki.client_context(pki.rogue_cert, pki.rogue_key))
        assert http_get(hub, "/healthz", ssl_context=good).status == 200
        assert wait_until(lambda: ' cn=spoke-1 "GET /v1/manifest HTTP/1.1" 200 ' in hub.stderr_text(), 5)
    assert "Traceback" not in hub.stderr_text()


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other end closed `sock` (EOF or reset), without waiting."""
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_a_burst_of_idle_connects_holds_no_more_descriptors_than_a_tls_hub_allows(dataset: Dataset, pki: PKI) -> None:
    """Connections are counted before their TLS handshake: beyond the limits they are
    closed at once, and the admitted ones that never start a handshake are closed after
    --header-timeout; the descriptors the hub holds stay within its limit."""
    max_connections, handshake_timeout_s = 4, 2.0
    args = [*tls_args(pki), "--max-connections", str(max_connections), "--header-timeout", str(handshake_timeout_s)]
    with running_hub(dataset.root, args) as hub:
        baseline = hub_open_fds(hub)
        burst: list[socket.socket] = []
        try:
            for _ in range(60):
                burst.append(socket.create_connection((hub.host, hub.port), timeout=5))
            refused = lambda: sum(closed_by_peer(sock) for sock in burst) >= 60 - max_connections  # noqa: E731
            assert wait_until(refused, handshake_timeout_s / 2)
            # What the hub holds while the admitted ones wait for their handshake.
            peak = baseline
            deadline = time.monotonic() + handshake_timeout_s / 2
            while time.monotonic() < deadline:
                peak = max(peak, hub_open_fds(hub))
                time.sleep(0.01)
            assert peak <= baseline + max_connections + 2, (baseline, peak)
            assert wait_until(lambda: all(closed_by_peer(sock) for sock in burst), handshake_timeout_s + 3)
        finally:
            for sock in burst:
                sock.close()
        # A client that does the handshake is served once the burst is gone.
        assert wait_until(lambda: healthz_status(hub, pki.client_context()) == 200, 5)
        assert sample(scrape_metrics(hub, ssl_context=pki.client_context()), "cachefs_hub_refused_connections_total") >= 50
    assert "Traceback" not in hub.stderr_text()


@pytest.mark.parametrize(
    ("listen", "args", "warning"),
    [
        ("0.0.0.0:0", [], "without --token-file or TLS: anyone who can reach it can read the whole dataset"),
        ("[::]:0", ["--token-file"], "without TLS: the spokes' tokens and the data cross the network unencrypted"),
        ("0.0.0.0:0", ["--tls"], "without --token-file or --tls-client-ca"),
        ("0.0.0.0:0", ["--token-file", "--tls"], None),
        ("127.0.0.1:0", [], None),
    ],
    ids=["open", "tokens-only", "tls-only", "both", "loopback"],
)
def test_a_hub_open_to_the_network_says_so_once(dataset: Dataset, token_file: Path, pki: PKI, listen, args, warning) -> None:
    """Listening on a non-loopback address without tokens or TLS is one clear warning at
    start (in a network namespace of its own, so nothing outside can reach it)."""
    options = {"--token-file": ["--token-file", str(token_file)], "--tls": tls_args(pki)}
    extra = ["--listen", listen, *(word for arg in args for word in options[arg])]
    with running_hub(dataset.root, extra, wrapper=["unshare", "--net", "--map-root-user"]) as hub:
        assert hub.wait_for_stderr("scanned ")
    log = hub.stderr_text()
    warnings = [line for line in log.splitlines() if "not a loopback address" in line]
    if warning is None:
        assert warnings == []
    else:
        assert len(warnings) == 1 and warning in warnings[0] and " WARNING " in warnings[0], warnings


def test_every_loopback_address_is_loopback_and_no_other() -> None:
    for host in ("127.0.0.1", "127.1.2.3", "::1", "::ffff:127.0.0.1"):
        assert exposure_warning(host, False, False) is None, host
    for host in ("0.0.0.0", "::", "192.0.2.7", "2001:db8::1", "fe80::1%eth0"):
        assert exposure_warning(host, False, False) is not None, host
    assert exposure_warning("192.0.2.7", True, True) is None


# --------------------------------------------------------------- limits


def test_slow_request_head_is_cut_at_the_header_timeout(dataset: Dataset) -> None:
    timeout_s = 1.0
    with running_hub(dataset.root, ["--header-timeout", str(timeout_s)]) as hub:
        # Slowloris: one byte of a request head every 0.1 s.
        head = b"GET /healthz HTTP/1.1\r\nHost: hub\r\nX-Padding: " + b"a" * 200 + b"\r\n\r\n"
        started = time.monotonic()
        sent = 0
        with socket.create_connection((hub.host, hub.port), timeout=5) as sock:
            try:
                for byte in head:
                    sock.send(bytes([byte]))
                    sent += 1
                    time.sleep(0.1)
                    if time.monotonic() - started > 10:
                        break
                sock.recv(1)
            except OSError:
                pass
            disconnected_after_s = time.monotonic() - started
        assert sent < len(head)
        # Generous upper bound for a loaded machine: sending it all takes 24 s.
        assert timeout_s <= disconnected_after_s < timeout_s + 5

        # A connection that never sends anything is closed as well.
        started = time.monotonic()
        data, closed = raw_exchange(hub.host, hub.port, b"", timeout_s=5)
        assert closed and data == b""
        assert time.monotonic() - started < timeout_s + 5

        # An idle keep-alive connection between requests is not cut by it.
        conn = http.client.HTTPConnection(hub.host, hub.port, timeout=5)
        try:
            conn.request("GET", "/healthz")
            assert conn.getresponse().read()
            time.sleep(timeout_s * 1.5)
            conn.request("GET", "/healthz")
            assert conn.getresponse().status == 200
        finally:
            conn.close()
        assert sample(scrape_metrics(hub), "cachefs_hub_header_timeouts_total") == 2
        assert "no complete request head within 1 s" in hub.stderr_text()


def held_connections(hub: HubProcess, count: int) -> list[http.client.HTTPConnection]:
    """`count` keep-alive connections to the hub, each having had one answer."""
    held = [http.client.HTTPConnection(hub.host, hub.port, timeout=5) for _ in range(count)]
    for conn in held:
        conn.request("GET", "/healthz")
        assert conn.getresponse().read()
    return held


def test_connections_beyond_the_limit_get_503(dataset: Dataset) -> None:
    with running_hub(dataset.root, ["--max-connections", "2", "--max-connections-per-client", "2"]) as hub:
        held = held_connections(hub, 2)
        try:
            data, closed = raw_exchange(hub.host, hub.port, b"GET /healthz HTTP/1.1\r\nHost: hub\r\n\r\n")
            assert closed
            assert data.startswith(b"HTTP/1.1 503 ")
            assert b"Connection: close" in data
            assert json.loads(data.partition(b"\r\n\r\n")[2]) == {"error": "too many connections: retry later"}
            # The held connections still work.
            held[0].request("GET", "/healthz")
            assert held[0].getresponse().status == 200
        finally:
            held[1].close()
        # Once one is closed, a new connection is admitted.
        assert wait_until(lambda: healthz_status(hub) == 200, 5)
        held[0].close()
        assert wait_until(lambda: sample(scrape_metrics(hub), "cachefs_hub_open_connections") == 1, 5)
        assert sample(scrape_metrics(hub), "cachefs_hub_refused_connections_total") >= 1
    assert "refusing connections: 2 open, the most --max-connections allows (1 refused" in hub.stderr_text()


def _assert_a_third_connection_refused_and_another_address_served(hub: HubProcess) -> None:
    """With two connections from 127.0.0.1 held open, a third from there gets 503 and is
    closed, while one from 127.0.0.2 is served; the held ones are closed after."""
    held = held_connections(hub, 2)
    try:
        data, closed = raw_exchange(hub.host, hub.port, b"GET /healthz HTTP/1.1\r\nHost: hub\r\n\r\n")
        assert closed and data.startswith(b"HTTP/1.1 503 "), data[:100]
        with socket.create_connection((hub.host, hub.port), timeout=5, source_address=("127.0.0.2", 0)) as other:
            other.sendall(b"GET /healthz HTTP/1.1\r\nHost: hub\r\nConnection: close\r\n\r\n")
            assert other.makefile("rb").readline().startswith(b"HTTP/1.1 200 ")
    finally:
        for conn in held:
            conn.close()


def test_one_client_cannot_take_every_connection(dataset: Dataset) -> None:
    """Beyond --max-connections-per-client connections from one address get 503; another
    address is still served (before: one client could hold all of --max-connections)."""
    with running_hub(dataset.root, ["--max-connections", "8", "--max-connections-per-client", "2"]) as hub:
        _assert_a_third_connection_refused_and_another_address_served(hub)
        assert wait_until(lambda: healthz_status(hub) == 200, 5)  # their slots are free again
    assert "refusing connections: 2 open from 127.0.0.1, the most --max-connections-per-client allows" in hub.stderr_text()


def test_two_clients_cannot_take_every_connection_by_default(dataset: Dataset) -> None:
    """Without --max-connections-per-client, one address gets half of --max-connections
    (it used to be three quarters: two addresses took them all)."""
    with running_hub(dataset.root, ["--max-connections", "4"]) as hub:
        _assert_a_third_connection_refused_and_another_address_served(hub)
    assert "2 open from 127.0.0.1, the most --max-connections-per-client allows" in hub.stderr_text()


def hub_open_fds(hub: HubProcess) -> int:
    return len(os.listdir(f"/proc/{hub.proc.pid}/fd"))


def exhaust_descriptors(hub: HubProcess) -> list[socket.socket]:
    """Idle connections, each answered once, until the hub cannot accept another (it has no
    descriptor left). Returns them all, the last one not accepted."""
    held: list[socket.socket] = []
    while len(held) < 200:
        sock = socket.create_connection((hub.host, hub.port), timeout=5)
        held.append(sock)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: hub\r\n\r\n")
        sock.settimeout(1.5)
        try:
            if sock.recv(65536).startswith(b"HTTP/1.1 200 "):
                continue
        except TimeoutError:
            return held
        raise AssertionError("the hub closed an idle connection")
    raise AssertionError("the hub accepted 200 connections")


def test_a_hub_out_of_descriptors_answers_503_and_spokes_wait_not_estale(tmp_path: Path) -> None:
    """Failing to open a file for want of descriptors is not "changed on disk": the hub
    answers 503 and the spoke retries until its --fetch-timeout, so the read succeeds once
    the idle connections that took the descriptors are gone."""
    root = tmp_path / "root"
    root.mkdir()
    content = random.Random(5).randbytes(100_000)
    (root / "data.bin").write_bytes(content)
    mount_helpers = pytest.importorskip("mount_helpers")
    with running_hub(root) as hub:
        with mount_helpers.mounted_spoke(hub.url, tmp_path, ["--fetch-timeout", "30"]) as spoke:
            limit = hub_open_fds(hub) + 12
            resource.prlimit(hub.proc.pid, resource.RLIMIT_NOFILE, (limit, limit))
            held = exhaust_descriptors(hub)
            result: dict[str, Any] = {}

            def read() -> None:
                try:
                    result["data"] = (spoke.mountpoint / "data.bin").read_bytes()
                except OSError as exc:
                    result["error"] = exc

            reader = threading.Thread(target=read)
            reader.start()
            try:
                reader.join(3)
                assert reader.is_alive(), result  # still trying, not failed
            finally:
                for sock in held:
                    sock.close()
            reader.join(30)
            assert not reader.is_alive()
            assert result.get("data") == content, result
            assert "changed on the hub" not in spoke.log_text()
        samples = scrape_metrics(hub)
        assert sample(samples, "cachefs_hub_requests_total", endpoint="files", status="503") >= 1
        assert sample(samples, "cachefs_hub_requests_total", endpoint="files", status="412") == 0
    assert "Traceback" not in hub.stderr_text()


def test_a_compressed_request_body_is_drained_without_a_traceback_or_gunzipping(tmp_path: Path) -> None:
    """No endpoint reads a body; the one drained after the answer is not decompressed: a
    body that is not the gzip it claims must not be a traceback in the log ("Unhandled exception"),
    nor a gzip bomb keep the event loop busy for seconds."""
    import zlib

    root = tmp_path / "root"
    root.mkdir()
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)  # gzip
    zeros = bytes(1 << 20)
    bomb = b"".join([*(compressor.compress(zeros) for _ in range(512)), compressor.flush()])  # 512 MiB in ~0.5 MB
    with running_hub(root) as hub:
        for body in (b"not gzip at all", bomb):
            head = f"GET /healthz HTTP/1.1\r\nHost: hub\r\nContent-Encoding: gzip\r\nContent-Length: {len(body)}\r\n\r\n"
            with socket.create_connection((hub.host, hub.port), timeout=10) as sock:
                sock.sendall(head.encode() + body)
                assert sock.recv(4096).startswith(b"HTTP/1.1 200 ")
                started = time.monotonic()
                assert http_get(hub, "/healthz").status == 200
                assert time.monotonic() - started < 0.5  # the hub is not busy gunzipping
        samples = scrape_metrics(hub)
        assert sample(samples, "process_cpu_seconds_total") < 2
    assert "Traceback" not in hub.stderr_text()
    assert "Unhandled exception" not in hub.stderr_text()


def healthz_status(hub: HubProcess, ssl_context: ssl.SSLContext | None = None) -> int:
    try:
        return http_get(hub, "/healthz", ssl_context=ssl_context).status
    except OSError:
        return 0


def test_client_that_stops_reading_is_cut_at_the_send_timeout(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    with open(root / "huge.bin", "wb") as f:
        f.truncate(64 * 1024 * 1024)  # sparse: costs no disk
    with running_hub(root, ["--send-timeout", "1"]) as hub:
        entry = next(e for e in fetch_manifest(hub).entries if e["k"] == "f")
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            sock.connect((hub.host, hub.port))
            sock.sendall(f"GET {file_url(entry)} HTTP/1.1\r\nHost: hub\r\n\r\n".encode())
            # Read nothing: the hub's send stalls on a shut window.
            cut = lambda: sample(scrape_metrics(hub), "cachefs_hub_requests_total", endpoint="files", status="499") == 1  # noqa: E731
            assert wait_until(cut, 20, interval_s=0.25)
        assert http_get(hub, "/healthz").status == 200


def test_a_tls_client_that_goes_away_mid_body_is_499_not_500(tmp_path: Path, pki: PKI) -> None:
    """A TLS client that goes away mid-body is a client gone (499): not a 500, not a 200
    after the hub read the rest of the file, nor a warning in the log per piece unsent."""
    root = tmp_path / "root"
    root.mkdir()
    with open(root / "huge.bin", "wb") as f:
        f.truncate(64 * 1024 * 1024)  # sparse: costs no disk
    with running_hub(root, tls_args(pki)) as hub:
        context = pki.client_context()
        entry = next(e for e in fetch_manifest(hub, ssl_context=context).entries if e["k"] == "f")
        with socket.create_connection((hub.host, hub.port), timeout=5) as raw:
            with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                tls.sendall(f"GET {file_url(entry)} HTTP/1.1\r\nHost: hub\r\n\r\n".encode())
                tls.recv(4096)  # the head and the first bytes, then go away
        gone = lambda: sample(scrape_metrics(hub, ssl_context=context), "cachefs_hub_requests_total",  # noqa: E731
                              endpoint="files", status="499") == 1
        assert wait_until(gone, 10, interval_s=0.25)
        samples = scrape_metrics(hub, ssl_context=context)
        assert sample(samples, "cachefs_hub_requests_total", endpoint="files", status="500") == 0
        assert sample(samples, "cachefs_hub_requests_total", endpoint="files", status="200") == 0
    # Not read on to the end of the file, one warning per piece written to nobody.
    assert "SSL connection is closed" not in hub.stderr_text()
    assert "Traceback" not in hub.stderr_text()


# --------------------------------------------------------------- hostile input


@pytest.mark.parametrize(
    ("path", "headers", "status"),
    [
        ("/v1/manifest?x=1", {}, 400),
        ("/healthz?verbose", {}, 400),
        ("/v1/files/{id}?v={v}&v={v}", {}, 400),
        ("/v1/files/{id}?v={v}&debug=1", {}, 400),
        ("/v1/files/{id}?v={v}", {"Range": "bytes=-0"}, 416),
        ("/v1/files/{id}?v={v}", {"Range": "bytes=0-1,3-4"}, 416),
        ("/v1/files/{id}?v={v}", {"Range": "bytes=10-5"}, 416),
        ("/v1/files/{id}?v={v}", {"Range": "bytes=-5-10"}, 416),
        ("/v1/files/{id}?v={v}", {"Range": "bytes=" + "9" * 40 + "-"}, 416),
        ("/v1/files/{id}?v={v}", {"Range": "bytes=0-" + "9" * 400}, 416),
        ("/v1/files/{id}?v={v}", {"Range": "bytes=18446744073709551616-18446744073709551617"}, 416),
        ("/v1/files/{id}%00", {}, 400),
        ("/v1/files/%2e%2e%2f%2e%2e%2foutside%2fsecret.txt", {}, 400),
        ("/v1/files/escape", {}, 400),
        ("/v1/files/dir_escape%2fsecret.txt", {}, 400),
    ],
)
def test_bad_inputs_get_json_errors(auth_hub: HubProcess, manifest: Manifest, path: str, headers, status) -> None:
    entry = manifest.file("big.bin")
    reply = http_get(auth_hub, path.format(id=entry["i"], v=entry["v"]), {**bearer(ALICE), **headers})
    assert_json_error(reply, status)
    assert SECRET_MARKER not in reply.body


def test_a_directory_swapped_for_a_symlink_is_never_followed_out_of_the_root(tmp_path: Path) -> None:
    """A directory of the root replaced by a symlink to a directory outside holding a FIFO
    of the file's name: the hub answers 412 without opening the FIFO (opening it would
    let its blocked writer go on)."""
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "data.bin").write_bytes(b"x" * 1000)
    outside = tmp_path / "outside"
    outside.mkdir()
    fifo = outside / "data.bin"
    os.mkfifo(fifo)
    writer = subprocess.Popen([sys.executable, "-c", f"open({str(fifo)!r}, 'w')"])
    try:
        with running_hub(root) as hub:
            entry = next(e for e in fetch_manifest(hub).entries if e["p"] == "sub/data.bin")
            os.rename(root / "sub", tmp_path / "sub.moved")
            os.symlink(outside, root / "sub")
            for path in (file_url(entry), file_url(entry) + "&bs=65536"):
                assert_json_error(http_get(hub, path, {"Range": "bytes=0-9"}), 412)
            batch = http_get(hub, f"/v1/batch?bs=65536&f={entry['i']}.{entry['v']}")
            assert_json_error(batch, 412)
            checksums = http_get(hub, f"/v1/files/{entry['i']}/checksums?v={entry['v']}&bs=65536&first=0&count=1")
            assert_json_error(checksums, 412)
            with pytest.raises(subprocess.TimeoutExpired):
                writer.wait(0.5)  # still blocked: nobody opened the FIFO for reading
        assert "Traceback" not in hub.stderr_text()
    finally:
        writer.kill()
        writer.wait()


def test_remembered_sums_of_a_file_under_a_directory_swapped_for_a_symlink_answer_412(tmp_path: Path) -> None:
    """The directory above a file moved out of the root and a symlink to it put in its place:
    the file is still the scanned inode, but reached through a symlink, so its checksums
    answer 412 like its data, also when they are remembered (an lstat of the path would follow
    the symlink to the same inode)."""
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "data.bin").write_bytes(b"x" * 100_000)
    with running_hub(root) as hub:
        entry = next(e for e in fetch_manifest(hub).entries if e["p"] == "sub/data.bin")
        checksums = f"/v1/files/{entry['i']}/checksums?v={entry['v']}&bs=65536&first=0&count=2"
        assert http_get(hub, checksums).status == 200  # now remembered
        os.rename(root / "sub", tmp_path / "sub.moved")
        os.symlink(tmp_path / "sub.moved", root / "sub")
        assert_json_error(http_get(hub, file_url(entry), {"Range": "bytes=0-9"}), 412)
        assert_json_error(http_get(hub, checksums), 412)
    assert "Traceback" not in hub.stderr_text()


def _open_walking(root: Path, rel: bytes, flags: int) -> int:
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return open_walking(root_fd, rel, flags)
    finally:
        os.close(root_fd)


def _open_beneath(root: Path, rel: bytes, flags: int) -> int:
    return open_beneath(os.fsencode(root), rel, flags)


@pytest.mark.parametrize("opener", [_open_beneath, _open_walking], ids=["openat2", "walking"])
def test_opening_in_the_root_follows_no_symlink_in_any_component(tmp_path: Path, opener) -> None:
    """Both ways the hub opens a file (openat2 where the kernel has it, else a walk one
    directory at a time) refuse a symlink anywhere in the path, and nothing else."""
    root = tmp_path / "root"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "f").write_bytes(b"inside")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "f").write_bytes(b"outside")
    os.symlink(tmp_path / "outside", root / "a" / "link")
    os.symlink("b", root / "a" / "relative")
    os.symlink("b/f", root / "a" / "file_link")
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
    fd = opener(root, b"a/b/f", flags)
    try:
        assert os.read(fd, 100) == b"inside"
    finally:
        os.close(fd)
    symlink = {errno.ELOOP, errno.ENOTDIR}  # a symlink opened as a directory with O_NOFOLLOW: ENOTDIR
    for rel, codes in [(b"a/link/f", symlink), (b"a/relative/f", symlink), (b"a/file_link", {errno.ELOOP}),
                       (b"a/b/f/g", {errno.ENOTDIR}), (b"a/missing/f", {errno.ENOENT})]:
        with pytest.raises(OSError) as raised:
            opener(root, rel, flags)
        assert raised.value.errno in codes, rel


@pytest.mark.parametrize(
    "range_lines",
    [
        "Range: bytes=0-1\r\nRange: bytes=5-9\r\n",
        "Range: bytes=０-５\r\n",  # fullwidth digits, sent as UTF-8
    ],
)
def test_range_headers_a_client_library_would_not_send_get_416(
    auth_hub: HubProcess, manifest: Manifest, range_lines: str
) -> None:
    entry = manifest.file("big.bin")
    request = (
        f"GET {file_url(entry)} HTTP/1.1\r\nHost: hub\r\nAuthorization: Bearer {ALICE}\r\n"
        f"{range_lines}Connection: close\r\n\r\n"
    ).encode()
    data, closed = raw_exchange(auth_hub.host, auth_hub.port, request)
    assert closed and data.startswith(b"HTTP/1.1 416 "), data[:100]


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /healthz HTTP/1.1\r\nHost: hub\r\nX-Big: " + b"a" * 5000 + b"\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nHost: hub\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(40)) + b"\r\n",
        b"GET /" + b"a" * 5000 + b" HTTP/1.1\r\nHost: hub\r\n\r\n",
        b"GET /healthz?" + b"&".join(b"k%d=v" % i for i in range(1000)) + b" HTTP/1.1\r\nHost: hub\r\n\r\n",
        b"G\x00T /healthz HTTP/1.1\r\nHost: hub\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nHost: hub\r\nX: a\x00b\r\n\r\n",
        b"GET /healthz HTTP/7.3\r\nHost: hub\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(64) + b"\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\n\r\n",  # HTTP/1.1 without Host
    ],
    ids=[
        "long-header",
        "many-headers",
        "long-line",
        "absurd-query",
        "nul-method",
        "nul-header",
        "version",
        "tls",
        "no-host",
    ],
)
def test_malformed_requests_get_400_json(auth_hub: HubProcess, request_bytes: bytes) -> None:
    data, closed = raw_exchange(auth_hub.host, auth_hub.port, request_bytes)
    assert closed
    head, _, body = data.partition(b"\r\n\r\n")
    assert re.match(rb"HTTP/1\.[01] 400 ", head), head
    assert set(json.loads(body)) == {"error"}
    assert b"Traceback" not in data
    assert http_get(auth_hub, "/healthz").status == 200


# What a client may send with a token in it that the HTTP parser or the routes refuse.
_LEAKY_REQUESTS = {
    "cr-cr-lf": b"GET /v1/manifest HTTP/1.1\r\nHost: hub\r\nAuthorization: Bearer %s\r\r\n\r\n",
    "control-char-in-token-line": b"GET /v1/manifest HTTP/1.1\r\nHost: hub\r\nAuthorization: Bearer %s\x01\r\n\r\n",
    "control-char-in-header": b"GET /v1/manifest HTTP/1.1\r\nAuthorization: Bearer %s\r\nHost: h\x7fub\r\n\r\n",
    "space-before-colon": b"GET /v1/manifest HTTP/1.1\r\nHost: hub\r\nAuthorization : Bearer %s\r\n\r\n",
    "bare-lf": b"GET /v1/manifest HTTP/1.1\nHost: hub\nAuthorization: Bearer %s\n\n",
    "oversized-header": b"GET /v1/manifest HTTP/1.1\r\nHost: hub\r\nX-Token: %s" + b"a" * 5000 + b"\r\n\r\n",
    "control-char-in-url": b"GET /v1/manifest?access_token=%s\x01 HTTP/1.1\r\nHost: hub\r\n\r\n",
    "query-token": b"GET /v1/manifest?access_token=%s HTTP/1.1\r\nHost: hub\r\nConnection: close\r\n\r\n",
    "query-token-and-header": b"GET /v1/manifest?access_token=%s HTTP/1.1\r\nHost: hub\r\n"
    b"Authorization: Bearer " + ALICE.encode() + b"\r\nConnection: close\r\n\r\n",
    "query-key": b"GET /v1/manifest?%s HTTP/1.1\r\nHost: hub\r\n"
    b"Authorization: Bearer " + ALICE.encode() + b"\r\nConnection: close\r\n\r\n",
    "absolute-form-userinfo": b"GET http://spoke:%s@hub/v1/manifest HTTP/1.1\r\nHost: hub\r\nConnection: close\r\n\r\n",
}


def test_no_request_the_hub_refuses_puts_its_token_in_a_log_or_a_reply(dataset: Dataset, token_file: Path) -> None:
    """Parser errors quote the offending bytes, and paths carry queries: neither may bring a
    token into the hub's output (at debug level) or its answers."""
    token = BOB.encode()
    replies = {}
    with running_hub(dataset.root, ["--token-file", str(token_file), "--log-level", "debug"]) as hub:
        for name, template in _LEAKY_REQUESTS.items():
            data, closed = raw_exchange(hub.host, hub.port, template % token)
            assert closed and re.match(rb"HTTP/1\.[01] 4\d\d ", data), (name, data[:300])
            replies[name] = data
        assert wait_until(lambda: hub.stderr_text().count('"GET /v1/manifest?') >= 3, 5)
        assert http_get(hub, "/healthz").status == 200
    leaks = [name for name, data in replies.items() if token in data]
    output = hub.stdout_text() + hub.stderr_text()
    assert not leaks and BOB not in output, (leaks, [line for line in output.splitlines() if BOB in line])
    assert "Traceback" not in output
    # What the parser objected to is still said, without the bytes.
    assert b"bad request: " in replies["space-before-colon"]
    assert '"GET /v1/manifest?<query redacted> HTTP/1.1" 401 ' in output


# --------------------------------------------------------------- fuzzing

FUZZ_HEADER_TIMEOUT_S = 1.0
# Header names the fuzzer leaves alone: they announce a body or a protocol
# switch, which would only make the hub wait for bytes that never come.
_BODY_HEADERS = {"content-length", "transfer-encoding", "expect", "upgrade", "connection"}


@pytest.fixture(scope="module")
def fuzz_hub(dataset: Dataset, token_file: Path) -> Iterator[HubProcess]:
    args = ["--token-file", str(token_file), "--header-timeout", str(FUZZ_HEADER_TIMEOUT_S)]
    with running_hub(dataset.root, args) as hub:
        yield hub


def _request_strategy(manifest: Manifest) -> Any:
    """Hypothesis strategy: the bytes of one HTTP request aimed at the hub."""
    files = [e for e in manifest.entries if e["k"] == "f"]
    ids = [e["i"] for e in files]
    versions = [e["v"] for e in files]
    url_text = st.text(
        alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters="?#"), max_size=40
    )
    segment = st.one_of(
        st.sampled_from(ids),
        st.sampled_from(ids).map(str.upper),
        st.text(alphabet="0123456789abcdefABCDEF", max_size=20),
        st.sampled_from(
            [
                "..",
                "%2e%2e",
                "%2E%2E%2F",
                "%2f",
                "%252f",
                "%00",
                "%c0%af",
                "..;",
                "..\\..\\",
                "escape",
                "dir_escape",
                "dir_escape/secret.txt",
                "nested/relative_escape",
                "outside/secret.txt",
                "/etc/passwd",
                "~root",
                "big.bin",
                "",
            ]
        ),
        url_text,
    )
    path = st.builds(
        lambda prefix, parts: prefix + "/".join(parts),
        st.sampled_from(
            [
                "/v1/files/",
                "/v1/files/../",
                "//v1/files/",
                "/v1/%66iles/",
                "/v1/manifest",
                "/v1/manifest/",
                "/healthz",
                "/metrics",
                "/",
                "/v1/",
                "/static/",
                "http://hub/v1/files/",
                "*",
                "",
            ]
        ),
        st.lists(segment, max_size=4),
    )
    query_value = st.one_of(st.sampled_from(versions), st.text(alphabet="0123456789abcdef", max_size=20), url_text)
    query = st.one_of(
        st.just(""),
        query_value.map(lambda v: f"?v={v}"),
        st.lists(st.tuples(st.sampled_from(["v", "x", "", "v[]", "%76"]), query_value), max_size=5).map(
            lambda pairs: "?" + "&".join(f"{k}={v}" for k, v in pairs)
        ),
        st.one_of(st.integers(1, 100), st.integers(4000, 6000)).map(lambda n: "?" + "a" * n),
    )
    number = st.one_of(
        st.integers(0, 4096),
        st.integers(0, BIG_SIZE * 2),
        st.integers(-(2**70), 2**70),
        st.sampled_from([0, 1, BIG_SIZE - 1, BIG_SIZE, 2**63 - 1, 2**63, 2**64, 10**30]),
    )
    single = st.one_of(
        st.builds(lambda a, b: f"bytes={a}-{b}", number, number),
        st.builds(lambda a: f"bytes={a}-", number),
        st.builds(lambda n: f"bytes=-{n}", number),
    )
    range_value = st.one_of(
        single,
        st.lists(single, min_size=2, max_size=4).map(lambda parts: "bytes=" + ",".join(p[6:] for p in parts)),
        st.sampled_from(["bytes=", "bytes=-", "bytes=--1", "bytes=1-2-3", "bytes 0-1", "items=0-1", "bytes=0x10-"]),
        st.integers(1, 5000).map(lambda n: "bytes=" + "9" * n + "-"),
        url_text,
    )
    authorization = st.one_of(
        st.just(f"Bearer {ALICE}"),
        st.just(f"Bearer {BOB}"),
        st.just(f"Bearer {WRONG}"),
        st.just(f"bearer {ALICE}"),
        st.sampled_from(["Bearer", "Bearer ", "Basic YWxpY2U6eA==", ALICE, f"Bearer {ALICE}=="]),
        url_text.map(lambda t: f"Bearer {t}"),
    )
    header_name = st.text(alphabet="abcdefghijklmnopqrstuvwxyz-ABCXYZ", min_size=1, max_size=20).filter(
        lambda name: name.lower() not in _BODY_HEADERS
    )
    header_value = st.one_of(url_text, st.integers(4000, 6000).map(lambda n: "v" * n))
    headers = st.lists(
        st.one_of(
            st.tuples(st.just("Authorization"), authorization),
            st.tuples(st.just("Range"), range_value),
            st.tuples(
                st.sampled_from(["If-Range", "If-None-Match", "If-Match", "If-Modified-Since", "Accept-Encoding"]),
                url_text,
            ),
            st.tuples(header_name, header_value),
        ),
        max_size=6,
    )
    method = st.one_of(
        st.sampled_from(["GET", "GET", "GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "TRACE", "PATCH", "CONNECT"]),
        st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ-_!", min_size=1, max_size=12),
    )
    version = st.sampled_from(["HTTP/1.1"] * 6 + ["HTTP/1.0", "HTTP/2.0", "HTTP/1.2", "HTTP/0.9", "http/1.1"])
    with_auth = st.sampled_from([True, True, True, False])

    def build(method, path, query, version, with_auth, headers) -> bytes:
        lines = [f"{method} {path}{query} {version}", "Host: hub"]
        if with_auth:
            lines.append(f"Authorization: Bearer {ALICE}")
        lines += [f"{name}: {value}" for name, value in headers]
        lines.append("Connection: close")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape")

    structured = st.builds(build, method, path, query, version, with_auth, headers)
    # Well-formed reads of real files with hostile ranges: the data path.
    file_target = st.sampled_from(files).flatmap(
        lambda e: st.sampled_from([f"/v1/files/{e['i']}", f"/v1/files/{e['i']}?v={e['v']}"])
    )
    satisfiable = st.builds(lambda first, n: f"bytes={first}-{first + n}", st.integers(0, 2999), st.integers(0, 5000))
    ranged = st.builds(
        build,
        st.sampled_from(["GET", "GET", "GET", "HEAD"]),
        file_target,
        st.just(""),
        st.just("HTTP/1.1"),
        st.just(True),
        st.one_of(
            st.one_of(satisfiable, satisfiable, range_value).map(lambda value: [("Range", value)]),
            st.lists(st.tuples(st.just("Range"), range_value), max_size=3),
        ),
    )
    garbage = st.binary(max_size=300).map(lambda data: data + b"\r\n\r\n")
    return st.one_of(structured, structured, ranged, ranged, garbage)


def _check_response(request: bytes, data: bytes, dataset: Dataset) -> None:
    assert SECRET_MARKER not in data
    assert b"Traceback" not in data and b'File "' not in data
    if not data:
        return  # closed without an answer (garbage the parser gave up on)
    head, _, body = data.partition(b"\r\n\r\n")
    match = re.match(rb"HTTP/(\d)\.\d (\d{3}) ", head)
    assert match, head[:100]
    major, status = int(match.group(1)), int(match.group(2))
    assert status < 500 or (status == 505 and major != 1), head[:300]
    if status in (200, 206) and b"application/octet-stream" in head and not request.startswith(b"HEAD "):
        content_range = re.search(rb"(?i)\r\ncontent-range: bytes (\d+)-(\d+)/(\d+)", head)
        if content_range:
            first, last, size = (int(g) for g in content_range.groups())
            candidates = [data_ for data_ in dataset.contents.values() if len(data_) == size]
            assert any(body == data_[first : last + 1] for data_ in candidates), head[:300]
        elif body:
            assert body in dataset.contents.values(), head[:300]


def test_fuzzed_requests_never_leak_crash_or_hang(fuzz_hub: HubProcess, dataset: Dataset) -> None:
    manifest = fetch_manifest(fuzz_hub, bearer(ALICE))
    served_statuses: set[int] = set()

    @settings(
        max_examples=300,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(request=_request_strategy(manifest))
    def exchange(request: bytes) -> None:
        data, closed = raw_exchange(fuzz_hub.host, fuzz_hub.port, request, timeout_s=FUZZ_HEADER_TIMEOUT_S + 4)
        assert closed, f"hub kept the connection open: {request[:200]!r}"
        _check_response(request, data, dataset)
        if data.startswith(b"HTTP/1."):
            served_statuses.add(int(data[9:12]))

    started = time.monotonic()
    exchange()
    assert time.monotonic() - started < 50
    # The fuzzer reached the data, not only the error paths.
    assert {200, 206, 400, 401, 404, 416} <= served_statuses, served_statuses
    assert fuzz_hub.proc.poll() is None
    assert http_get(fuzz_hub, "/healthz").status == 200
    assert fetch_manifest(fuzz_hub, bearer(ALICE)).entries == manifest.entries
    log = fuzz_hub.stderr_text()
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
    assert SECRET_MARKER.decode() not in log


def test_a_client_is_its_ipv4_address_or_its_ipv6_64() -> None:
    """Per-client limits count an IPv4 client seen through a dual-stack socket as that IPv4
    address, and an IPv6 client as its /64 (it can pick any address in it)."""
    assert client_of("192.0.2.7") == "192.0.2.7"
    assert client_of("::ffff:192.0.2.7") == "192.0.2.7"
    assert client_of("2001:db8:1:2:aaaa::1") == client_of("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
    assert client_of("2001:db8:1:3::1") == "2001:db8:1:3::/64"
    assert client_of("fe80::1%eth0") == "fe80::/64"
    assert client_of("-") == "-"


def test_a_dual_stack_hub_counts_ipv4_clients_by_their_ipv4_address(dataset: Dataset) -> None:
    with running_hub(dataset.root, ["--listen", "[::]:0", "--max-connections", "8", "--max-connections-per-client", "2"]) as hub:
        held = [http.client.HTTPConnection("127.0.0.1", hub.port, timeout=5) for _ in range(2)]
        try:
            for conn in held:
                conn.request("GET", "/healthz")
                assert conn.getresponse().read()
            data, closed = raw_exchange("127.0.0.1", hub.port, b"GET /healthz HTTP/1.1\r\nHost: hub\r\n\r\n")
            assert closed and data.startswith(b"HTTP/1.1 503 ")
            data, closed = raw_exchange("::1", hub.port, b"GET /healthz HTTP/1.1\r\nHost: hub\r\nConnection: close\r\n\r\n")
            assert data.startswith(b"HTTP/1.1 200 ")  # another client
        finally:
            for conn in held:
                conn.close()
    assert "2 open from 127.0.0.1, the most --max-connections-per-client allows" in hub.stderr_text()
