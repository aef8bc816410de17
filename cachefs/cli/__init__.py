"""Command-line interface: argument parsing, the mount command, operator commands, user-facing errors."""

from .commands import main

__all__ = ["main"]
