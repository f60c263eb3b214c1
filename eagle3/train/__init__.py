"""Stage 4: training the draft (loop.py), with its loss (loss.py), data packing (data.py), checkpoints
(checkpoint.py), metrics (metrics.py) and every torch.distributed call (distributed.py).

`python -m eagle3.train` (or torchrun -m eagle3.train) is the entry point: __main__.py.
"""
