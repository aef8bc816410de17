"""`cachefs bench PATH`: read workloads against any mounted directory."""

from __future__ import annotations

import argparse


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="cachefs bench", description="Measure read workloads on a directory.")
    parser.add_argument("path")
    parser.parse_args(argv)
    raise NotImplementedError("cachefs bench is being built")
