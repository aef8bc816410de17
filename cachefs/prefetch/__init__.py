"""Prefetch by guess: read-ahead of streams, next files, randomly read files and sibling small files."""
