"""Benchmarks against peers (`make bench`): a development tool, not part of the installed package."""
