"""How the host runs the work: the heap kept for the next step of a CPU stage (heap) and what every
vllm.LLM shares (vllm_engine)."""
