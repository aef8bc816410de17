"""`cachefs mount --config FILE`: TOML options, overridden by flags, bad files refused cleanly."""

from __future__ import annotations

import os
from pathlib import Path

from mount_helpers import assert_clean_failure, mounted_spoke, run_cachefs


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
    os.mkfifo(tmp_path / "fifo.toml")  # nobody writes it: reading would wait forever
    assert_clean_failure(run_cachefs("mount", hub.url, tmp_path / "mnt", "--cache-dir", tmp_path / "c",
                                     "--config", tmp_path / "fifo.toml", timeout_s=20), "is not a regular file")
    for text, message in (("foreground = true\n", "foreground is not a file option"),  # fstab's mount would hang
                          ('token_file = "/tmp/t\\u0000x"\n', "a value holds a NUL character")):
        (tmp_path / "bad.toml").write_text(text)
        assert_clean_failure(run_cachefs("mount", hub.url, tmp_path / "mnt", "--cache-dir", tmp_path / "c",
                                         "--config", tmp_path / "bad.toml"), message)
    (tmp_path / "zero.toml").write_text('cache_size = "0"\n')
    abbreviated = run_cachefs("mount", hub.url, tmp_path / "mnt", "--cache-dir", tmp_path / "c", "--conf", tmp_path / "zero.toml")
    if abbreviated.returncode == 0:  # it mounted: leave no mount behind the failure
        run_cachefs("unmount", tmp_path / "mnt")
    assert abbreviated.returncode == 2 and "unrecognized arguments: --conf" in abbreviated.stderr  # not a silent --config
    for args, message in ((("--uid", "99999999999"), "invalid uid 99999999999"),
                          (("--gid", "4294967295"), "invalid gid 4294967295")):
        assert_clean_failure(run_cachefs("mount", hub.url, tmp_path / "mnt", "--cache-dir", tmp_path / "c", *args), message)
    zero_min = run_cachefs("mount", "http://127.0.0.1:1", tmp_path / "mnt", "--cache-dir", tmp_path / "c",
                           "--cache-min", "0")  # the default, given (as fstab's cache_min=0 gives it): taken
    assert_clean_failure(zero_min, "cannot get the manifest")
    long_host = "http://" + "a" * 64 + ":8470"
    assert_clean_failure(run_cachefs("mount", long_host, tmp_path / "mnt", "--cache-dir", tmp_path / "c"),
                         "the host name is not a valid DNS name")


def test_hub_config_file_options_apply(dataset: Path, tmp_path: Path) -> None:
    import urllib.error
    import urllib.request

    from hub_helpers import run_hub_cli, running_hub

    tokens = tmp_path / "tokens"
    tokens.write_text("spoke:a-token-that-is-long-enough-0123\n")
    tokens.chmod(0o600)
    config = tmp_path / "hub.toml"
    config.write_text(f'token_file = "{tokens}"\nrescan_interval = 3600\n')
    with running_hub(dataset, ["--config", str(config)]) as hub:
        try:
            urllib.request.urlopen(hub.url + "/v1/manifest", timeout=10)
            raise AssertionError("the token file from the config was not applied")
        except urllib.error.HTTPError as exc:
            assert exc.code == 401
    bad = tmp_path / "bad.toml"
    bad.write_text('rot = "/srv"\n')
    result = run_hub_cli(["serve", "--config", str(bad)])
    assert result.returncode == 1 and "unknown option 'rot'" in result.stderr and "Traceback" not in result.stderr
    result = run_hub_cli(["serve", "--root", str(dataset), "--conf", str(bad)])  # not --config, read apart and ignored
    assert result.returncode != 0 and "--conf" in result.stderr and "Traceback" not in result.stderr
    result = run_hub_cli(["serve", "--root", str(dataset), "--listen", "a" * 300 + ":0"])
    assert result.returncode == 1 and "not a valid host name" in result.stderr and "Traceback" not in result.stderr


def test_a_list_in_a_config_file_gives_its_option_once_per_item(tmp_path: Path) -> None:
    from cachefs.cli.commands import build_parser
    from cachefs.config_file import with_config_file

    config = tmp_path / "cachefs.toml"
    config.write_text('tier = ["http://tier-0:8470", "http://tier-1:8470"]\n')
    command_line = ["mount", "http://hub:8470", "/mnt", "--cache-dir", "/c", "--config", str(config)]
    argv = with_config_file(command_line, build_parser(), "mount")
    assert argv[:5] == ["mount", "--tier", "http://tier-0:8470", "--tier", "http://tier-1:8470"]
    assert build_parser().parse_args(argv).tier == ["http://tier-0:8470", "http://tier-1:8470"]
    # A flag overrides the file, a list too: the file's tiers are not added to the flag's.
    argv = with_config_file([*command_line, "--tier", "http://tier-0:8470"], build_parser(), "mount")
    assert build_parser().parse_args(argv).tier == ["http://tier-0:8470"]


def test_passthrough_false_in_a_config_file_turns_it_off(tmp_path: Path) -> None:
    from cachefs.cli.commands import build_parser
    from cachefs.config_file import with_config_file

    config = tmp_path / "cachefs.toml"
    config.write_text("passthrough = false\nallow_other = false\n")
    command_line = ["mount", "http://hub:8470", "/mnt", "--cache-dir", "/c", "--config", str(config)]
    argv = with_config_file(command_line, build_parser(), "mount")
    assert argv[:3] == ["mount", "--no-passthrough", "--no-allow-other"]
    assert build_parser().parse_args(argv).passthrough is False
    assert build_parser().parse_args(command_line).passthrough is None  # the default: on where possible


def test_flags_turn_off_what_a_config_file_turns_on(hub, tmp_path: Path) -> None:
    """allow_other, nfs_export, debug and refresh_interval set in a file: a --no- flag (a
    refresh interval of 0) turns each off for one mount. On a real mount: --passthrough is
    refused beside the file's nfs_export and taken with --no-nfs-export, and the file's
    allow_other is not among the mount's options with --no-allow-other."""
    from cachefs.cli.commands import build_parser
    from cachefs.config_file import with_config_file

    config = tmp_path / "cachefs.toml"
    config.write_text("allow_other = true\nnfs_export = true\ndebug = true\nrefresh_interval = 60\n")
    command_line = ["mount", "http://hub:8470", "/mnt", "--cache-dir", "/c", "--config", str(config)]
    args = build_parser().parse_args(with_config_file(command_line, build_parser(), "mount"))
    assert (args.allow_other, args.nfs_export, args.debug, args.refresh_interval) == (True, True, True, 60)
    flags = ["--no-allow-other", "--no-nfs-export", "--no-debug", "--refresh-interval", "0"]
    args = build_parser().parse_args(with_config_file([*command_line, *flags], build_parser(), "mount"))
    assert (args.allow_other, args.nfs_export, args.debug, args.refresh_interval) == (False, False, False, 0)

    config.write_text("nfs_export = true\nallow_other = true\n")
    mountpoint = tmp_path / "refused"
    mountpoint.mkdir()
    refused = run_cachefs("mount", hub.url, mountpoint, "--cache-dir", tmp_path / "refused-cache", "--config", config,
                          "--passthrough")
    assert_clean_failure(refused, "--passthrough cannot be used with --nfs-export")
    with mounted_spoke(hub.url, tmp_path, ("--config", str(config), "--no-nfs-export", "--passthrough",
                                           "--no-allow-other", "--refresh-interval", "0")) as spoke:
        options = [line.split(" - ")[1].split()[2] for line in Path("/proc/self/mountinfo").read_text().splitlines()
                   if line.split()[4] == str(spoke.mountpoint)]  # the file system's options: user_id=...,allow_other
        assert len(options) == 1 and "user_id=" in options[0] and "allow_other" not in options[0], options
