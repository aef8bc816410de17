"""sd_notify(3) without libsystemd: a datagram to $NOTIFY_SOCKET. Standard library only:
the hub uses it too."""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


def sd_notify(message: str) -> None:
    """Tell systemd (Type=notify units) about readiness or shutdown; a no-op outside systemd."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    if address.startswith("@"):
        address = "\0" + address[1:]  # abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.sendto(message.encode(), address)
    except OSError as exc:
        log.warning("cannot notify systemd at %s: %s", address.lstrip("\0"), exc)
