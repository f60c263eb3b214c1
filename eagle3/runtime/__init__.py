"""How the host runs the work: the heap kept for the next step of a CPU stage (heap), denormals flushed while
the trainer runs (floats), progress lines (progress) and what every vllm.LLM shares (vllm_engine)."""
