"""Benchmarks and the WAN emulator they (and the tests) use."""
