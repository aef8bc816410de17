"""Allow `python -m hubserver`, equivalent to the `cachefs-hub` command."""

from __future__ import annotations

from hubserver.cli import main

raise SystemExit(main())
