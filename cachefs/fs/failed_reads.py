"""Reads that just failed: a read of the same blocks right after fails at once.

When a read-ahead request of the kernel fails, the kernel asks again for the
page its reader wants, and that second request would wait a fetch timeout
of its own: one read() took twice `--fetch-timeout` to fail (and longer
when it waited for a read-ahead request of its pages made earlier). So a
read request that arrives within FRESH_S after a read of one of its blocks
failed fails at once with that read's error: whatever the hub answered (an
error status, a body cut short or failing its checksums, one too slow),
its fetch was retried until the fetch timeout already. Except after a
silent hub (down, paused, unreachable): one answer from it since that read
began ends the failure, as the hub may be back.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from ..errors import FetchAbandoned, HubError, HubUnavailable, RemoteFileChanged

# The kernel's second request comes within milliseconds of the failed one;
# a hub restarted meanwhile takes longer than this to listen again.
FRESH_S = 0.5
# Blocks remembered at most (the newest kept): more than the reads failing
# together within FRESH_S (one 1 MiB request: 16 blocks of 64 KiB).
MAX_BLOCKS = 4096

_Block = tuple[bytes, bytes, int]  # file id, version, block number


class FailedReads:
    """The blocks of the reads that failed in the last FRESH_S, and with which error.

    `answers()` counts the responses the hub client received (HubClient.answers):
    unchanged, nothing came from the hub. Times are any one monotonic clock.
    """

    def __init__(self, answers: Callable[[], int], fresh_s: float = FRESH_S, max_blocks: int = MAX_BLOCKS) -> None:
        self.answers = answers
        self._fresh_s = fresh_s
        self._max_blocks = max_blocks
        # block -> (when its read failed, the hub's answers when that read began if the hub
        # was silent (else None: the failure stands whatever the hub answers), its error)
        self._failed: collections.OrderedDict[_Block, tuple[float, int | None, HubError]] = collections.OrderedDict()

    def read_failed(
        self, file_id: bytes, version: bytes, blocks: range, error: HubError, began: int, now: float
    ) -> None:
        """A read of `blocks` that began when the hub had given `began` answers failed with
        `error`. Not remembered: a fetch abandoned (its reader went away) or a file changed
        on the hub (ESTALE, at once anyway)."""
        if isinstance(error, (FetchAbandoned, RemoteFileChanged)):
            return
        silent = isinstance(error, HubUnavailable) and self.answers() == began
        for blockno in blocks:
            block = (file_id, version, blockno)
            self._failed[block] = (now, began if silent else None, error)
            self._failed.move_to_end(block)
        while self._failed and (len(self._failed) > self._max_blocks
                                or now - next(iter(self._failed.values()))[0] >= self._fresh_s):
            self._failed.popitem(last=False)

    def failure(self, file_id: bytes, version: bytes, blocks: range, now: float) -> HubError | None:
        """The error to fail a read of `blocks` arriving `now` with at once, or None to read
        them: a read of one of them failed at most FRESH_S ago, and (if the hub was silent)
        the hub has answered nothing since that read began."""
        if not self._failed:
            return None
        answers = self.answers()
        for blockno in blocks:
            failed = self._failed.get((file_id, version, blockno))
            if failed is not None:
                when, began, error = failed
                if 0 <= now - when < self._fresh_s:
                    if began is None:
                        return HubUnavailable(f"{error} (a moment ago)")
                    if answers == began:
                        return HubUnavailable(f"{error} (a moment ago, and the hub has answered nothing since)")
        return None
