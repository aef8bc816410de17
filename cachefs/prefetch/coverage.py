"""`PlanCoverage`: what read-ahead asks the training side, whether a loader's plan covers a file."""

from __future__ import annotations

from typing import Protocol

from ..namespace.tree import Inode


class PlanCoverage(Protocol):
    """Whether a loader's plan covers a file (training/advice.py): its prefetch then replaces read-ahead's guesses."""

    def covers(self, inode: Inode) -> bool: ...
