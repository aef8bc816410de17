"""`remember`: the bounded, most-recent-last memories the read-ahead policies keep per file and per process."""

from __future__ import annotations

import collections
from typing import TypeVar

_Key = TypeVar("_Key")
_Value = TypeVar("_Value")


def remember(memory: collections.OrderedDict[_Key, _Value], key: _Key, value: _Value, limit: int) -> None:
    """Store `key` as the most recent entry of `memory`, forgetting the oldest beyond `limit`."""
    memory[key] = value
    memory.move_to_end(key)
    while len(memory) > limit:
        memory.popitem(last=False)
