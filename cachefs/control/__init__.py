"""The control socket and the operator commands served over it (warm, evict, purge, stats, refresh, plan)."""
