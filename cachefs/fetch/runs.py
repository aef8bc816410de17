"""`missing_runs`: the stretches of consecutive blocks still to fetch, for read-ahead, plans and warm-ups alike."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

_Item = TypeVar("_Item")


def missing_runs(
    items: Iterable[_Item], missing: Callable[[_Item], bool], max_blocks: int | None = None
) -> Iterator[list[_Item]]:
    """The longest stretches of consecutive `items` (blocks, in file order) that are `missing`, at
    most `max_blocks` long; each item is checked only once the stretches before it were taken
    (a caller that fetches a stretch before taking the next skips what arrived meanwhile)."""
    run: list[_Item] = []
    for item in items:
        if not missing(item):
            if run:
                yield run
                run = []
            continue
        run.append(item)
        if max_blocks is not None and len(run) >= max_blocks:
            yield run
            run = []
    if run:
        yield run
