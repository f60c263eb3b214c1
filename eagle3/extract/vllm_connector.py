"""The hidden-state connector the vllm backend hands to vLLM: the stock one, plus a CPU write path.

vLLM loads this module itself, in its worker processes, through
`kv_transfer_config["kv_connector_module_path"]`; nothing in eagle3 imports it (it imports vLLM).

Why it exists: vLLM's `ExampleHiddenStatesConnector` (vllm 0.32/0.33,
`vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py`) writes each
finished request from `_submit_async_write` with a CUDA copy stream, CUDA events and a pinned host
buffer. On a CPU engine that dies at `pin_memory=True` ("requires a CUDA or other accelerator
backend"). The cache it reads is already host memory there, so the CPU path copies the request's
slots synchronously and writes the file on the worker thread, under the same exclusive flock the
stock path takes, so `load_hidden_states` (shared flock) still sees only complete files.

On a CUDA engine every call goes to the stock connector unchanged.

Facts of the stock class this relies on (read in its source):
- `self._kv_cache` is the one cache-only layer's buffer, [num_blocks, n_ids, block_size, H];
  `extract_from_kv_cache(cache, slots, T)` gathers [T, n_ids, H] from it.
- `self._lock_fds[req_id]` holds an fd with LOCK_EX on `<file>.lock`, made in `wait_for_save`
  before the client can see the path; closing the fd releases the lock.
- `get_finished` reports a request as sent once `self._req_copy_events[req_id].query()` is true,
  and only requests with an event there are reported at all.
- Only TP rank 0 writes (`self._is_tp_rank_zero`).
"""
from __future__ import annotations

import fcntl
import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Done:
    """Stands in for the stock path's CUDA event: the CPU copy is finished when it is recorded."""

    @staticmethod
    def query() -> bool:
        return True


class Eagle3HiddenStatesConnector(ExampleHiddenStatesConnector):
    """`ExampleHiddenStatesConnector` with a synchronous write when the cache lives on the CPU."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if self._kv_cache is None or self._kv_cache.is_cuda:
            return super()._submit_async_write(pending)
        if not self._is_tp_rank_zero:
            return
        bs = self._block_size
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * bs + torch.arange(bs, dtype=torch.long)[None, :]).flatten()
        T = pending.token_ids.shape[0]
        # [T, n_ids, H]: a gather, so a copy; the blocks may be reused once this returns
        hidden = extract_from_kv_cache(self._kv_cache, slots, T).contiguous()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            # written to a temp name and renamed, so a killed engine never leaves a partial file
            tmp = pending.filename + ".tmp"
            save_file({"hidden_states": hidden, "token_ids": pending.token_ids.clone()}, tmp)
            os.replace(tmp, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: readers waiting on LOCK_SH go on
        self._req_copy_events[pending.req_id] = _Done()
