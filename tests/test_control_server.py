"""The daemon's control socket (control/server.py), served in process on a real Unix socket."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from cachefs.control import server as control
from cachefs.errors import CachefsError


@pytest.fixture
def socket_path(tmp_path: Path) -> Iterator[Path]:
    """A ControlServer with two commands, `echo` and `stall`, on a socket in `tmp_path`, in a thread of its own."""
    path = tmp_path / control.SOCKET_NAME
    token = {}
    started = threading.Event()

    async def echo(request: dict[str, Any], _progress: control.Progress) -> dict[str, Any]:
        return {"echo": request.get("value")}

    async def stall(_request: dict[str, Any], _progress: control.Progress) -> dict[str, Any]:
        time.sleep(1.0)  # noqa: ASYNC251 (the event loop busy for a moment: nothing is accepted meanwhile)
        return {}

    async def main() -> None:
        token["trio"] = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            token["cancel"] = nursery.cancel_scope.cancel
            await nursery.start(control.ControlServer({"echo": echo, "stall": stall}).serve, path)
            started.set()

    thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
    thread.start()
    assert started.wait(10)
    try:
        yield path
    finally:
        trio.from_thread.run_sync(token["cancel"], trio_token=token["trio"])
        thread.join(10)


def _exchange(path: Path, line: bytes) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        sock.sendall(line)
        answer: dict[str, Any] = json.loads(sock.makefile("rb").readline())
        return answer


def test_many_clients_connecting_at_once_are_all_answered(socket_path: Path) -> None:
    """Every rank of a training job may send its plan at once: clients that connect with a
    timeout (non-blocking) are refused at once when the backlog is full, not queued."""
    clients = []
    stalling = socket.socket(socket.AF_UNIX)
    try:
        stalling.connect(str(socket_path))
        stalling.sendall(b'{"command": "stall"}\n')
        time.sleep(0.3)
        for _ in range(100):
            client = socket.socket(socket.AF_UNIX)
            client.settimeout(10)
            client.connect(str(socket_path))
            clients.append(client)
        for value, client in enumerate(clients):
            client.sendall(json.dumps({"command": "echo", "value": value}).encode() + b"\n")
        answers = [json.loads(client.makefile("rb").readline()) for client in clients]
    finally:
        for client in [stalling, *clients]:
            client.close()
    assert answers == [{"ok": True, "result": {"echo": value}} for value in range(100)]


def test_a_request_nested_too_deep_is_malformed_not_an_internal_error(socket_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    assert _exchange(socket_path, b"[" * 500_000 + b"\n") == {"ok": False, "error": "malformed request"}
    assert "Traceback" not in caplog.text


def test_a_daemon_that_does_not_answer_is_one_line_for_the_cli(tmp_path: Path) -> None:
    path = tmp_path / "silent.sock"
    with socket.socket(socket.AF_UNIX) as silent:
        silent.bind(str(path))
        silent.listen(1)
        with pytest.raises(CachefsError, match=r"did not answer within 0\.5 s"):
            control.call(path, {"command": "stats"}, timeout_s=0.5)
