"""The hub's TLS context, from the certificate, key and client CA files of its options."""

from __future__ import annotations

import os
import ssl
import stat
from pathlib import Path

from hubserver.config import HubConfig
from hubserver.errors import TLSConfigError


def _ssl_reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError):
        return exc.reason or str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc)


def _no_password() -> bytes:
    raise TLSConfigError("the key is encrypted; give an unencrypted key (readable by the hub only)")


def _check_regular_file(option: str, path: Path | None) -> None:
    """Refuse a FIFO, a device or a socket (OpenSSL would wait forever on a FIFO); raises
    TLSConfigError. A missing or unreadable file, or a directory, is left to OpenSSL's message."""
    if path is None:
        return
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        raise TLSConfigError(f"{option} {path} is not a regular file")


def make_ssl_context(config: HubConfig) -> ssl.SSLContext | None:
    """The server's TLS context (TLS 1.2 or newer, HTTP/1.1 only), None
    without --tls-cert. With --tls-client-ca every client must present a
    certificate that CA signed. Raises TLSConfigError."""
    if config.tls_cert is None or config.tls_key is None:
        return None
    for option, path in (("--tls-cert", config.tls_cert), ("--tls-key", config.tls_key),
                         ("--tls-client-ca", config.tls_client_ca)):
        _check_regular_file(option, path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["http/1.1"])
    try:
        context.load_cert_chain(config.tls_cert, config.tls_key, password=_no_password)
    except TLSConfigError as exc:
        raise TLSConfigError(f"--tls-key {config.tls_key}: {exc}") from None
    except (OSError, ValueError) as exc:
        raise TLSConfigError(
            f"cannot load --tls-cert {config.tls_cert} with --tls-key {config.tls_key}: {_ssl_reason(exc)}"
        ) from None
    if config.tls_client_ca is not None:
        try:
            context.load_verify_locations(cafile=config.tls_client_ca)
        except (OSError, ValueError) as exc:
            raise TLSConfigError(f"cannot load --tls-client-ca {config.tls_client_ca}: {_ssl_reason(exc)}") from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context
