"""A plain HTTP file server for the peers (rclone's http remote, httpdirfs): HTML indexes and Range.

The cachefs hub serves files by id only; the peers need a directory listing
of links and ranged GETs by path. `web.FileResponse` handles Range, HEAD,
206/416 and sendfile. The index pages use *relative* links (`name`,
`dir/`), which both httpdirfs and rclone parse (aiohttp's own
`show_index` pages link absolute paths, which httpdirfs 1.2 ignores).

    python -m bench.static_server --root /data --listen 127.0.0.1:0
"""

from __future__ import annotations

import argparse
import asyncio
import html
import logging
import os
import signal
import sys
import urllib.parse
from pathlib import Path

from aiohttp import web

log = logging.getLogger(__name__)

ROOT_KEY = web.AppKey("root", Path)
RANGE_HEADERS = {"Accept-Ranges": "bytes"}


def _resolve(root: Path, tail: str) -> Path:
    """The path under `root` for a URL tail; 404 for anything outside it."""
    relative = urllib.parse.unquote(tail).lstrip("/")
    candidate = (root / relative).resolve()
    if candidate != root and root not in candidate.parents:
        raise web.HTTPNotFound()
    return candidate


def _index_page(directory: Path, url_path: str) -> str:
    """An HTML list of relative links, directories with a trailing slash."""
    items = []
    for entry in sorted(os.scandir(directory), key=lambda item: item.name):
        is_dir = entry.is_dir(follow_symlinks=False)
        if not is_dir and not entry.is_file(follow_symlinks=False):
            continue
        name = entry.name + ("/" if is_dir else "")
        items.append(f'<li><a href="{urllib.parse.quote(name)}">{html.escape(name)}</a></li>')
    title = html.escape(url_path)
    return f"<html><head><title>Index of {title}</title></head><body><h1>Index of {title}</h1>" \
           f"<ul>{''.join(items)}</ul></body></html>\n"


async def handle(request: web.Request) -> web.StreamResponse:
    """A directory index (redirecting to the slash-terminated URL) or the file, with Range support."""
    root = request.app[ROOT_KEY]
    path = _resolve(root, request.match_info["tail"])
    if path.is_dir():
        if not request.path.endswith("/"):
            raise web.HTTPMovedPermanently(request.path + "/")
        return web.Response(text=_index_page(path, request.path), content_type="text/html")
    if path.is_file():
        if _starts_past_end(request, path.stat().st_size):
            return _not_satisfiable(path.stat().st_size)
        # httpdirfs 1.2 insists on this header in every ranged answer, 206 included.
        return web.FileResponse(path, headers=RANGE_HEADERS)
    raise web.HTTPNotFound()


def _starts_past_end(request: web.Request, size_bytes: int) -> bool:
    try:
        start = request.http_range.start
    except ValueError:
        return False  # malformed: FileResponse answers it
    return start is not None and start >= size_bytes


def _not_satisfiable(size_bytes: int) -> web.Response:
    """416 with a body, as nginx and Apache send it: httpdirfs 1.2 read-ahead asks for the segment
    after the last one and crashes on an empty answer."""
    return web.Response(status=416, text="<html><body><h1>416 Requested Range Not Satisfiable</h1></body></html>\n",
                        content_type="text/html", headers={**RANGE_HEADERS, "Content-Range": f"bytes */{size_bytes}"})


def make_app(root: Path) -> web.Application:
    app = web.Application()
    app[ROOT_KEY] = root.resolve()
    app.router.add_get("/{tail:.*}", handle)  # HEAD too
    return app


async def serve(root: Path, host: str, port: int) -> None:
    """Serve until SIGTERM or SIGINT."""
    runner = web.AppRunner(make_app(root), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    print(f"static listening on http://{host}:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.static_server", description=__doc__.split("\n")[0])
    parser.add_argument("--root", required=True, type=Path, help="directory to serve")
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT (default: 127.0.0.1:0)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    host, _, port = args.listen.rpartition(":")
    asyncio.run(serve(args.root, host, int(port)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
