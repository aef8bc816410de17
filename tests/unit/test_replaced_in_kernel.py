"""Which inodes the daemon refuses after a refresh (--nfs-export): those the kernel may
still hold in a replaced version, and not one it was told the new generation of."""

from __future__ import annotations

from cachefs.fs.operations import ReplacedInKernel


def test_a_file_is_refused_until_the_kernel_is_told_its_new_generation() -> None:
    replaced = ReplacedInKernel()
    replaced.shown()
    replaced.replaced([10, 11])
    assert 10 in replaced and 11 in replaced
    replaced.told(10)  # looked up again, or forgotten
    assert 10 not in replaced and 11 in replaced


def test_a_name_looked_up_once_the_new_generation_was_shown_is_not_refused() -> None:
    """Between the load and the refresh's listing of its files, a lookup already answered
    the new generation: refusing that inode would fail a handle of the new version."""
    replaced = ReplacedInKernel()
    replaced.shown()
    replaced.told(10)
    replaced.replaced([10, 11])
    assert 10 not in replaced and 11 in replaced
    replaced.shown()  # the next refresh starts with no lookup noted
    replaced.replaced([10])
    assert 10 in replaced
