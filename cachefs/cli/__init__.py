"""Command-line interface: argument parsing, the mount command, operator commands, user-facing errors."""
