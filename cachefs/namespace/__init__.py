"""The mounted snapshot: its tree of inodes in LMDB, loading manifests, moving to new generations."""
