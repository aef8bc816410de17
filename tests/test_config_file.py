"""`cachefs mount --config FILE`: TOML options, overridden by flags, bad files refused cleanly."""

from __future__ import annotations

from pathlib import Path

from mount_helpers import mounted_spoke, run_cachefs
from test_cli_errors import assert_clean_failure


def test_config_file_options_and_flags_override(hub, tmp_path: Path, dataset: Path) -> None:
    config = tmp_path / "cachefs.toml"
    config.write_text('cache_size = "3M"\nblock_size = "1M"\nprefetch_siblings = 0\nforeground = false\n')
    with mounted_spoke(hub.url, tmp_path, ("--config", str(config), "--block-size", "64K")) as spoke:
        stats = spoke.stats()
        assert stats["cache_capacity_bytes"] == 3 * 2**20  # from the file
        assert stats["block_size_bytes"] == 64 * 1024  # the flag wins
        relative = "shards/shard-001.bin"
        assert (spoke.mountpoint / relative).read_bytes() == (dataset / relative).read_bytes()


def test_bad_config_files_are_refused(hub, tmp_path: Path) -> None:
    (tmp_path / "mnt").mkdir()
    unknown = tmp_path / "unknown.toml"
    unknown.write_text('cache_sise = "3M"\n')
    assert_clean_failure(run_cachefs("mount", hub.url, tmp_path / "mnt", "--cache-dir", tmp_path / "c", "--config", unknown),
                         "unknown option 'cache_sise'")
    broken = tmp_path / "broken.toml"
    broken.write_text("cache_size = \n")
    assert_clean_failure(run_cachefs("mount", hub.url, tmp_path / "mnt", "--cache-dir", tmp_path / "c", "--config", broken),
                         "not valid TOML")
    assert_clean_failure(run_cachefs("mount", hub.url, tmp_path / "mnt", "--cache-dir", tmp_path / "c",
                                     "--config", tmp_path / "missing.toml"), "cannot read config file")
