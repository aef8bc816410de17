"""cachefs hub: serves one dataset directory, read-only, over HTTP.

The protocol is described in `docs/protocol.md`. Entry points:
`hubserver.app.make_app` (the aiohttp application) and
`hubserver.cli.main` (the `cachefs-hub` command).
"""

from __future__ import annotations

PROTOCOL_VERSION = 1
