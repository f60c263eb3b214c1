"""Decoding: batched greedy decoding with a KV cache (generate) on preallocated buffers (batch_decode)
and prepacked CPU linears (cpu_linear); the draft's chains over cached greedy answers (chains)."""
