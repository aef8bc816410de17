"""cachefs: a read-through caching FUSE filesystem for remote training data."""

__version__ = "0.1.0"
