"""Set-up of a rank before its steps: the process group and the wrapped model, compiled caches,
DDP's buckets, and what the rank host imports once per allocation."""
