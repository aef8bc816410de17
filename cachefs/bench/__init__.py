"""`cachefs bench PATH`: read workloads against any directory (the peer comparison is in the top-level bench/)."""
