"""TOML config files for both daemons: a file's keys become long options, placed
before the command line's own so that flags override the file.

    cache_size = "500G"      ->  --cache-size 500G
    allow_other = true       ->  --allow-other
    passthrough = false      ->  --no-passthrough

Standard library only: the hub's CLI uses it too.
"""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

from .config import read_option_file
from .errors import UsageError


class ConfigFileError(Exception):
    """A config file that cannot be read or holds an unknown option (one line)."""


def with_config_file(argv: list[str], parser: argparse.ArgumentParser, command: str) -> list[str]:
    """`argv` with the options of `COMMAND ... --config FILE` inserted right after COMMAND."""
    if not argv or argv[0] != command:
        return argv
    path = None
    for index, arg in enumerate(argv):
        if arg == "--config" and index + 1 < len(argv):
            path = Path(argv[index + 1])
        elif arg.startswith("--config="):
            path = Path(arg.split("=", 1)[1])
    if path is None:
        return argv
    given = {arg.split("=", 1)[0] for arg in argv[1:] if arg.startswith("--")}
    return [command, *options_from_file(path, _subparser(parser, command), given), *argv[1:]]


def options_from_file(path: Path, parser: argparse.ArgumentParser, given: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """The file's keys as long options of `parser` (unknown keys are an error), but for those the
    command line gives (`given`: its long options): a flag overrides the file, also for an option
    given once per item (a file's `tier` list and a `--tier` flag are not added together)."""
    try:
        table = tomllib.loads(read_option_file(path, "config file").decode("utf-8"))
    except UsageError as exc:
        raise ConfigFileError(str(exc)) from None
    except UnicodeDecodeError:
        raise ConfigFileError(f"config file {path} is not valid TOML: not UTF-8") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigFileError(f"config file {path} is not valid TOML: {exc}") from None
    known = {action.dest for action in parser._actions if action.option_strings and action.help != argparse.SUPPRESS}
    negatable = {action.dest for action in parser._actions if isinstance(action, argparse.BooleanOptionalAction)}
    options: list[str] = []
    for key, value in table.items():
        if key not in known or key in ("config", "help"):
            raise ConfigFileError(f"config file {path}: unknown option {key!r}")
        if key == "foreground" and value is True:  # a mount from fstab or mount(8) would never return
            raise ConfigFileError(f"config file {path}: foreground is not a file option; give --foreground "
                                  "on the command line")
        flag, negated = "--" + key.replace("_", "-"), "--no-" + key.replace("_", "-")
        if flag in given or negated in given:
            continue
        if value is True:
            options.append(flag)
        elif isinstance(value, list):  # an option given once per item (tier = ["http://a", "http://b"])
            for item in value:
                options += [flag, str(item)]
        elif value is False and key in negatable:  # passthrough = false -> --no-passthrough
            options.append(negated)
        elif value is not False:
            options += [flag, str(value)]
    if any("\0" in option for option in options):
        raise ConfigFileError(f"config file {path}: a value holds a NUL character")
    return options


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[command]
