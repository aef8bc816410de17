"""Getting blocks from the hub: flights, verified ranged requests with retries, the cache writer."""
