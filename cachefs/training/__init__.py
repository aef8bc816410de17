"""Training-aware caching: loaders' plans followed, prefetched along and used for eviction; epoch statistics."""
