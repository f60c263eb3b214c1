"""The models: what is known about a target dir (target), the EAGLE-3 draft's whole forward pass (draft)
and its TTT attention kernel (attention), every head layout on disk (formats), and the target's hidden
states at vLLM's layer ids (capture)."""
