"""Which inodes the daemon refuses after a refresh (--nfs-export): those the kernel may
still hold in a replaced version, and not one it was told the new generation of."""

from __future__ import annotations

from cachefs.fs.operations import ReplacedInKernel

OLD, NEW = b"\x01" * 8, b"\x02" * 8


def test_a_file_is_refused_until_the_kernel_looks_it_up_again_or_forgets_it() -> None:
    replaced = ReplacedInKernel()
    with replaced.refreshing():
        replaced.replaced({10: NEW, 11: NEW, 12: NEW})
    assert {10, 11, 12} == {ino for ino in (10, 11, 12) if ino in replaced}
    replaced.told(10, NEW)  # looked up again
    replaced.forgotten(11)  # the kernel let it go
    assert 10 not in replaced and 11 not in replaced and 12 in replaced and len(replaced) == 1


def test_what_the_kernel_was_told_during_the_refresh_decides() -> None:
    """The new generation is shown before the refresh lists its files: a lookup answered
    meanwhile gave the kernel the new version (not refused), one answered before the load
    the old (refused), and an inode forgotten meanwhile is not held (not refused)."""
    replaced = ReplacedInKernel()
    with replaced.refreshing():
        replaced.told(10, NEW)
        replaced.told(11, OLD)
        replaced.told(12, OLD)
        replaced.forgotten(12)
        replaced.replaced({10: NEW, 11: NEW, 12: NEW, 13: NEW})
    assert [ino for ino in (10, 11, 12, 13) if ino in replaced] == [11, 13]
    with replaced.refreshing():  # the next refresh starts with nothing noted
        replaced.replaced({10: NEW})
    assert 10 in replaced
