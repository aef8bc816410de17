"""The spoke's side of security: tokens, TLS verification, mutual TLS, private cache and mount."""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import shutil
import socket
import stat
import struct
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import SPOKE_ARGS
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from hub_helpers import hub_env, running_hub
from mount_helpers import (
    SpokeMount,
    assert_clean_failure,
    cache_data_files,
    cachefs_command,
    daemon_pid,
    is_mounted,
    mounted_spoke,
    run_cachefs,
    wait_for_stats,
)

TOKEN = "s3cret-token-for-tests-0123456789"


def write_private(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


def test_token_is_required_and_never_shown(dataset: Path, tmp_path: Path) -> None:
    tokens = write_private(tmp_path / "hub-tokens", f"spoke-a:{TOKEN}\n")
    with running_hub(dataset, ["--token-file", str(tokens)]) as hub:
        (tmp_path / "bare").mkdir()
        refused = run_cachefs("mount", hub.url, tmp_path / "bare", "--cache-dir", tmp_path / "c0")
        assert_clean_failure(refused, "401")
        token_file = write_private(tmp_path / "token", TOKEN + "\n")
        with mounted_spoke(hub.url, tmp_path, (*SPOKE_ARGS, "--token-file", str(token_file))) as spoke:
            relative = "shards/shard-000.bin"
            assert (spoke.mountpoint / relative).read_bytes() == (dataset / relative).read_bytes()
            assert TOKEN not in spoke.log_text()
            assert TOKEN not in " ".join(Path(f"/proc/{spoke.pid}/cmdline").read_text().split("\0"))
        # A cache dir holding the snapshot, and a token the hub turns down: refused, not mounted offline.
        wrong = write_private(tmp_path / "wrong-token", "not-the-token-0123456789abcdef\n")
        turned_down = run_cachefs("mount", hub.url, tmp_path / "bare", "--cache-dir", tmp_path / "mnt-cache",
                                  *SPOKE_ARGS, "--token-file", wrong)
        assert turned_down.returncode == 1 and "refused this spoke" in turned_down.stderr.splitlines()[-1]
        assert not is_mounted(tmp_path / "bare")
        assert TOKEN not in hub.stderr_text()
        (tmp_path / "env").mkdir()
        env_mount = subprocess.run(
            cachefs_command("mount", hub.url, tmp_path / "env", "--cache-dir", tmp_path / "c2", *SPOKE_ARGS),
            env={**hub_env(), "CACHEFS_HUB_TOKEN": TOKEN + "\n"}, capture_output=True, text=True, timeout=60,
        )  # a secret given as a variable often ends in a newline
        assert env_mount.returncode == 0, env_mount.stderr
        SpokeMount(tmp_path / "env", tmp_path / "c2", None).unmount()
        assert TOKEN not in (tmp_path / "c2" / "cachefs.log").read_text()
        (tmp_path / "bad").mkdir()
        bad = subprocess.run(
            cachefs_command("mount", hub.url, tmp_path / "bad", "--cache-dir", tmp_path / "c4", *SPOKE_ARGS),
            env={**hub_env(), "CACHEFS_HUB_TOKEN": TOKEN + "\x01x"}, capture_output=True, text=True, timeout=60,
        )
        assert bad.returncode != 0 and bad.stderr == ("cachefs: error: the token in $CACHEFS_HUB_TOKEN is empty or "
                                                      "holds characters an HTTP header cannot carry\n"), bad.stderr
    loose = tmp_path / "loose-token"
    loose.write_text(TOKEN)
    loose.chmod(0o644)
    (tmp_path / "m3").mkdir()
    assert_clean_failure(run_cachefs("mount", "http://127.0.0.1:1", tmp_path / "m3", "--cache-dir", tmp_path / "c3",
                                     "--token-file", loose), "chmod 600")
    # A TLS key others may read is refused as a token file is; a FIFO as either is refused, not read forever.
    assert_clean_failure(run_cachefs("mount", "https://127.0.0.1:1", tmp_path / "m3", "--cache-dir", tmp_path / "c3",
                                     "--tls-cert", loose, "--tls-key", loose), "--tls-key")
    os.mkfifo(tmp_path / "fifo", 0o600)
    for options in (["--token-file"], ["--tls-cert", loose, "--tls-key"], ["--ca-file"]):
        assert_clean_failure(run_cachefs("mount", "https://127.0.0.1:1", tmp_path / "m3", "--cache-dir",
                                         tmp_path / "c3", *options, tmp_path / "fifo", timeout_s=20),
                             "is not a regular file")
    # A refused hub URL is shown without what might be a credential in it.
    for url in ("https://hub.example:99999/?token=S3CRETQ", "ftp://hub.example/x?token=S3CRETQ#S3CRETF"):
        refused = run_cachefs("mount", url, tmp_path / "m3", "--cache-dir", tmp_path / "c3")
        assert refused.returncode != 0 and "invalid hub URL" in refused.stderr and "S3CRET" not in refused.stderr


PLAIN_HTTP_WARNING = "the hub token goes to"


def test_a_token_over_plain_http_is_warned_about_once(dataset: Path, tmp_path: Path) -> None:
    """Once on the terminal of `cachefs mount`, once in the daemon's log; the token in neither."""
    tokens = write_private(tmp_path / "hub-tokens", f"spoke-a:{TOKEN}\n")
    token_file = write_private(tmp_path / "token", TOKEN + "\n")
    with running_hub(dataset, ["--token-file", str(tokens)]) as hub:
        (tmp_path / "mnt").mkdir()
        mounted = run_cachefs("mount", hub.url, tmp_path / "mnt", "--cache-dir", tmp_path / "cache", *SPOKE_ARGS,
                              "--token-file", token_file)
        spoke = SpokeMount(tmp_path / "mnt", tmp_path / "cache", daemon_pid(tmp_path / "cache"))
        try:
            assert mounted.returncode == 0, mounted.stderr
            relative = "shards/shard-000.bin"
            assert (spoke.mountpoint / relative).read_bytes() == (dataset / relative).read_bytes()
            (warning,) = [line for line in mounted.stderr.splitlines() if PLAIN_HTTP_WARNING in line]
            assert "unencrypted" in warning and "checksums" in warning and "https://" in warning
            assert spoke.log_text().count(PLAIN_HTTP_WARNING) == 1
            assert TOKEN not in mounted.stderr + mounted.stdout + spoke.log_text()
        finally:
            spoke.unmount()
    with running_hub(dataset) as open_hub, mounted_spoke(open_hub.url, tmp_path, SPOKE_ARGS, name="m2") as spoke:
        assert PLAIN_HTTP_WARNING not in spoke.log_text()  # no token, nothing secret to give away


def make_ca(tmp_path: Path, name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    path = tmp_path / f"{name}.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert, key, path


def issue(tmp_path: Path, ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey, Path], name: str,
          san_ip: str | None = None, san_dns: str | None = None) -> tuple[Path, Path]:
    ca_cert, ca_key, _ = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
    )
    names: list[x509.GeneralName] = []
    if san_ip:
        names.append(x509.IPAddress(ipaddress.ip_address(san_ip)))
    if san_dns:
        names.append(x509.DNSName(san_dns))
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    cert_path, key_path = tmp_path / f"{name}.crt", tmp_path / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_path.chmod(0o600)
    return cert_path, key_path


def https(url: str) -> str:
    return url.replace("http://", "https://")


def test_tls_is_verified_and_mutual_tls_works(dataset: Path, tmp_path: Path) -> None:
    ca = make_ca(tmp_path, "test-ca")
    server_cert, server_key = issue(tmp_path, ca, "hub", san_ip="127.0.0.1")
    client_cert, client_key = issue(tmp_path, ca, "spoke")
    with running_hub(dataset, ["--tls-cert", str(server_cert), "--tls-key", str(server_key),
                               "--tls-client-ca", str(ca[2])]) as hub:
        url = https(hub.url)
        tls_args = ("--ca-file", str(ca[2]), "--tls-cert", str(client_cert), "--tls-key", str(client_key))
        with mounted_spoke(url, tmp_path, (*SPOKE_ARGS, *tls_args)) as spoke:
            relative = "shards/shard-001.bin"
            assert (spoke.mountpoint / relative).read_bytes() == (dataset / relative).read_bytes()
        (tmp_path / "m").mkdir()
        untrusted = run_cachefs("mount", url, tmp_path / "m", "--cache-dir", tmp_path / "c1")
        assert_clean_failure(untrusted, "failed TLS verification")
        no_client_cert = run_cachefs("mount", url, tmp_path / "m", "--cache-dir", tmp_path / "c2", "--ca-file", ca[2])
        assert_clean_failure(no_client_cert, "cannot get the manifest")
        assert "check --tls-cert and --tls-key" in no_client_cert.stderr  # what the hub's silence means
        foreign = make_ca(tmp_path, "other-ca")
        foreign_cert, foreign_key = issue(tmp_path, foreign, "spoke-elsewhere")
        refused = run_cachefs("mount", url, tmp_path / "m", "--cache-dir", tmp_path / "c4", "--ca-file", ca[2],
                              "--tls-cert", foreign_cert, "--tls-key", foreign_key)
        assert_clean_failure(refused, "check --tls-cert and --tls-key")
        # TLS options with no https:// URL are refused, not ignored while the data goes in clear.
        in_clear = run_cachefs("mount", hub.url.replace("https://", "http://"), tmp_path / "m",
                               "--cache-dir", tmp_path / "c3", *tls_args)
        assert in_clear.returncode == 2
        assert_clean_failure(in_clear, "nothing would use --ca-file, --tls-cert, --tls-key: they are for https://")
        half = run_cachefs("mount", url, tmp_path / "m", "--cache-dir", tmp_path / "c5", "--tls-cert", client_cert)
        assert_clean_failure(half, "--tls-cert and --tls-key go together")


class CuttingProxy:
    """A TCP proxy on loopback that resets its first connection once `cut_after` bytes went
    downstream on it (for TLS: in the middle of a response body, below the encryption)."""

    def __init__(self, target_port: int, cut_after: int) -> None:
        self.target_port = target_port
        self.cut_after = cut_after
        self.cuts = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._handle, args=(client,), daemon=True).start()

    def _handle(self, client: socket.socket) -> None:
        with client, socket.create_connection(("127.0.0.1", self.target_port)) as upstream:
            threading.Thread(target=_pump, args=(client, upstream), daemon=True).start()
            sent = 0
            while data := _recv(upstream):
                if self.cuts == 0 and sent + len(data) > self.cut_after:
                    self.cuts += 1
                    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST on close
                    client.shutdown(socket.SHUT_RD)  # wakes the upstream pump, which holds the socket open
                    return
                client.sendall(data)
                sent += len(data)

    def close(self) -> None:
        self.listener.close()


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except OSError:
        return b""


def _pump(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            sink.sendall(data)


def test_a_tls_connection_cut_in_a_body_is_retried(dataset: Path, tmp_path: Path) -> None:
    """Over TLS a connection reset in the middle of a response body is reported by trio's TLS
    stream, not as an OSError: it is a failed attempt like any other, retried, the bytes right
    and the mount still up (read-ahead and demand reads alike)."""
    ca = make_ca(tmp_path, "test-ca")
    server_cert, server_key = issue(tmp_path, ca, "hub", san_ip="127.0.0.1")
    with running_hub(dataset, ["--tls-cert", str(server_cert), "--tls-key", str(server_key)]) as hub:
        proxy = CuttingProxy(int(hub.url.rsplit(":", 1)[1]), cut_after=200 * 1024)  # past the manifest
        try:
            url = f"https://127.0.0.1:{proxy.port}"
            with mounted_spoke(url, tmp_path, (*SPOKE_ARGS, "--ca-file", str(ca[2]))) as spoke:
                for relative in ("shards/shard-000.bin", "shards/shard-001.bin"):
                    assert (spoke.mountpoint / relative).read_bytes() == (dataset / relative).read_bytes()
                stats = spoke.stats()
                assert is_mounted(spoke.mountpoint)
        finally:
            proxy.close()
    assert proxy.cuts == 1
    assert stats["fetch_retries"] >= 1 and stats["fetch_failures"] == 0


def test_certificate_for_another_name_is_refused(dataset: Path, tmp_path: Path) -> None:
    ca = make_ca(tmp_path, "test-ca")
    server_cert, server_key = issue(tmp_path, ca, "other", san_dns="other.example")
    with running_hub(dataset, ["--tls-cert", str(server_cert), "--tls-key", str(server_key)]) as hub:
        (tmp_path / "m").mkdir()
        mismatch = run_cachefs("mount", https(hub.url), tmp_path / "m", "--cache-dir", tmp_path / "c", "--ca-file", ca[2])
        assert_clean_failure(mismatch, "failed TLS verification")


def test_cache_and_control_socket_are_private(spoke: SpokeMount) -> None:
    (spoke.mountpoint / "shards/shard-002.bin").read_bytes()
    wait_for_stats(spoke, lambda stats: stats["cached_blocks"] > 0)
    assert stat.S_IMODE(spoke.cache_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((spoke.cache_dir / "control.sock").stat().st_mode) == 0o600
    assert stat.S_IMODE((spoke.cache_dir / "cachefs.log").stat().st_mode) == 0o600
    blocks = cache_data_files(spoke.cache_dir)
    assert blocks and all(stat.S_IMODE(p.stat().st_mode) in (0o600, 0o400) for p in blocks)  # 0400: sealed (passthrough)


def as_nobody(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", *command],
                          capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("allow_other", [False, True])
def test_other_users_only_with_allow_other(hub, tmp_path: Path, dataset: Path, allow_other: bool) -> None:
    args = (*SPOKE_ARGS, "--allow-other") if allow_other else SPOKE_ARGS
    with public_dir() as public, mounted_spoke(hub.url, public, args, cache_dir=tmp_path / "cache") as spoke:
        check_other_user(spoke, allow_other)


def check_other_user(spoke: SpokeMount, allow_other: bool) -> None:
    result = as_nobody("cat", str(spoke.mountpoint / "with space.txt"))
    if allow_other:
        assert result.returncode == 0 and result.stdout == "a name with a space\n"
    else:
        assert result.returncode != 0 and "Permission denied" in result.stderr
    control = str(spoke.cache_dir / "control.sock")
    connect = as_nobody("python3", "-c", f"import socket; socket.socket(socket.AF_UNIX).connect({control!r})")
    assert connect.returncode != 0  # the cache dir is 0700: other users cannot reach the control socket


@contextlib.contextmanager
def public_dir() -> Iterator[Path]:
    """A directory every user can reach (pytest's own temp dirs are 0700), removed after."""
    path = Path(tempfile.mkdtemp(prefix="cachefs-public-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    """The process umask for the block (the daemon inherits it)."""
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def test_a_cache_dir_open_to_others_is_made_private(hub, dataset: Path, tmp_path: Path) -> None:
    """A Kubernetes DirectoryOrCreate hostPath is 0755: the index would show every path to any local user.
    The second mount finds the index as an older cachefs left it (under umask 022)."""
    with public_dir() as public, umask(0o022):
        cache_dir = public / "cache"
        cache_dir.mkdir(mode=0o755)
        (tmp_path / "mnt").mkdir()
        for relative in ("shards/shard-000.bin", "small/dir 0/file-00.dat"):
            mounted = run_cachefs("mount", hub.url, tmp_path / "mnt", "--cache-dir", cache_dir, *SPOKE_ARGS)
            spoke = SpokeMount(tmp_path / "mnt", cache_dir, daemon_pid(cache_dir))
            try:
                assert mounted.returncode == 0, mounted.stderr
                assert mounted.stderr.count("was open to other users (mode 0755): made it 0700") == 1, mounted.stderr
                assert (spoke.mountpoint / relative).read_bytes() == (dataset / relative).read_bytes()
                wait_for_stats(spoke, lambda stats: stats["cached_blocks"] > 0)
                assert_private(public, cache_dir)
            finally:
                spoke.unmount()
            for path in (cache_dir, *cache_dir.glob("*.lmdb")):
                path.chmod(0o755)
            for path in cache_dir.glob("*.lmdb/*.mdb"):
                path.chmod(0o644)


def assert_private(public: Path, cache_dir: Path) -> None:
    """No file or directory in the cache dir is open to group or others, and another user reads none."""
    paths = [cache_dir, *cache_dir.rglob("*")]
    assert any(path.name == "data.mdb" for path in paths) and cache_data_files(cache_dir)
    open_to_others = {str(path.relative_to(public)): oct(stat.S_IMODE(path.lstat().st_mode))
                      for path in paths if path.lstat().st_mode & 0o077}
    assert not open_to_others
    for path in (cache_dir / "index.lmdb" / "data.mdb", cache_dir / "namespace.lmdb" / "data.mdb",
                 cache_data_files(cache_dir)[0]):
        denied = as_nobody("cat", str(path))
        assert denied.returncode != 0 and "Permission denied" in denied.stderr, path


def test_a_cache_dir_of_another_user_is_refused(tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir(mode=0o755)
    os.chown(cache_dir, 65534, 65534)
    (tmp_path / "m").mkdir()
    refused = run_cachefs("mount", "http://127.0.0.1:1", tmp_path / "m", "--cache-dir", cache_dir)
    assert_clean_failure(refused, str(cache_dir), "owned by uid 65534")
    assert stat.S_IMODE(cache_dir.stat().st_mode) == 0o755 and not any(cache_dir.iterdir())


def test_a_directory_open_to_others_that_is_not_a_cache_dir_is_refused_unchanged(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    (shared / "notes.txt").write_text("not cachefs's\n")
    (tmp_path / "m").mkdir()
    refused = run_cachefs("mount", "http://127.0.0.1:1", tmp_path / "m", "--cache-dir", shared)
    assert_clean_failure(refused, str(shared), "holds files cachefs did not make")
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755 and [p.name for p in shared.iterdir()] == ["notes.txt"]
