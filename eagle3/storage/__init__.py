"""Storage and integrity, below everything else: atomic writes (atomic), file hashes and their per-host
stamp cache (hashing), kill points for fault drills (faults), one writer per dir (lock), the typed
manifest each stage writes last (manifests), the hidden-state store (store) and the prepared-shard
format (shards)."""
