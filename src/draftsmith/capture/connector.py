"""draftsmith's vLLM KV connector for `extract_hidden_states`: runs INSIDE vLLM's interpreter.

This file is loaded by vLLM, not by draftsmith: `draftsmith.capture.vllm` copies it into a folder of
its own, puts that folder on the server's PYTHONPATH and names it in `--kv-transfer-config`
(`"kv_connector_module_path": "draftsmith_hs_connector"`, the way speculators and TorchSpec plug in
theirs). So it imports only vllm, torch, safetensors and the standard library, never draftsmith.

What it changes from vLLM's `ExampleHiddenStatesConnector` (whose write path copies on a CUDA stream
into pinned memory, so on a CPU-only torch it fails at the first request):

- CPU: the states are copied out of the cache and written synchronously, in the worker, to a
  temporary name and renamed; GPU keeps the stock asynchronous copy and writer threads.
- Bounded space: before a write the connector waits (up to `draftsmith_space_wait_s`) until the
  folder's `*.safetensors` files plus this one fit in `draftsmith_max_bytes`; the client deletes each
  request's file once it is in the feature store. A write that still does not fit, or that fails
  (ENOSPC), leaves `<file>.error` with the reason instead of a file, so the client can say why.
- The companion `.lock` protocol is the stock one: the client's shared flock returns once the
  writer is done with the request, whether it wrote the file or the error.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

MAX_BYTES_KEY = "draftsmith_max_bytes"
SPACE_WAIT_KEY = "draftsmith_space_wait_s"
DEFAULT_SPACE_WAIT_S = 600.0
ERROR_SUFFIX = ".error"


class _Written:
    """Stands in for the CUDA event `get_finished` polls: a synchronous write is done when it returns."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


def folder_bytes(folder: str) -> int:
    """Bytes held by finished and in-progress state files in `folder`."""
    total = 0
    for entry in os.scandir(folder):
        if entry.name.endswith((".safetensors", ".tmp")):
            try:
                total += entry.stat().st_size
            except FileNotFoundError:  # the client deleted it meanwhile
                pass
    return total


class DraftsmithHiddenStatesConnector(ExampleHiddenStatesConnector):
    """`ExampleHiddenStatesConnector` with a synchronous CPU write and a bounded output folder."""

    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config
        self._max_bytes = int(extra.get_from_extra_config(MAX_BYTES_KEY, 0))  # 0: unbounded
        self._space_wait_s = float(extra.get_from_extra_config(SPACE_WAIT_KEY, DEFAULT_SPACE_WAIT_S))

    def _wait_for_space(self, folder: str, nbytes: int) -> str | None:
        """None once `nbytes` more fit in the budget; else the reason it never did."""
        if self._max_bytes <= 0:
            return None
        deadline = time.monotonic() + self._space_wait_s
        while True:
            used = folder_bytes(folder)
            if used + nbytes <= self._max_bytes:
                return None
            if time.monotonic() >= deadline:
                return (f"connector folder {folder} full: {used} bytes held + {nbytes} for this request > "
                        f"{MAX_BYTES_KEY}={self._max_bytes} after waiting {self._space_wait_s:.0f} s for the "
                        "client to consume files")
            time.sleep(0.05)

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:  # only rank 0 writes (stock); the others must not wait or leave errors
            return None
        if self._kv_cache is not None and self._kv_cache.is_cuda:
            folder = os.path.dirname(pending.filename)
            nbytes = self._state_bytes(pending)
            reason = self._wait_for_space(folder, nbytes)
            if reason is None:
                return super()._submit_async_write(pending)
            return self._give_up(pending, reason)
        return self._write_now(pending)

    def _state_bytes(self, pending: PendingSave) -> int:
        _, heads, _, width = self._kv_cache.shape
        return int(pending.token_ids.shape[0]) * heads * width * self._kv_cache.element_size()

    def _write_now(self, pending: PendingSave) -> None:
        """CPU: copy this request's states out of the cache and write them before returning."""
        assert self._kv_cache is not None, "register_kv_caches runs before the first request"
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets[None, :] + block_ids[:, None] * self._block_size).flatten()
        num_tokens = int(pending.token_ids.shape[0])
        states = extract_from_kv_cache(self._kv_cache, slots, num_tokens).clone()  # (T, n_ids, H)
        folder = os.path.dirname(pending.filename)
        os.makedirs(folder, exist_ok=True)
        reason = self._wait_for_space(folder, states.numel() * states.element_size())
        if reason is None:
            reason = self._save(pending.filename, states, pending.token_ids.clone())
        if reason is not None:
            return self._give_up(pending, reason)
        self._release(pending)
        return None

    def _release(self, pending: PendingSave) -> None:
        """Done with this request: release its lock (the client's shared flock returns), report it sent."""
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is not None:
            os.close(lock_fd)  # releases LOCK_EX
        self._req_copy_events[pending.req_id] = _Written()

    @staticmethod
    def _save(filename: str, states: torch.Tensor, token_ids: torch.Tensor) -> str | None:
        """Write to a temporary name and rename; the reason when the disk refused."""
        tmp = filename + ".tmp"
        try:
            save_file({"hidden_states": states, "token_ids": token_ids}, tmp)
            os.replace(tmp, filename)
        except Exception as exc:  # safetensors reports ENOSPC as SafetensorError, not OSError
            Path(tmp).unlink(missing_ok=True)
            return f"could not write {filename}: {type(exc).__name__}: {exc}"
        return None

    def _give_up(self, pending: PendingSave, reason: str) -> None:
        """Leave `<file>.error` with the reason instead of states, and release the request."""
        logger.error("draftsmith connector: request %s: %s", pending.req_id, reason)
        try:
            Path(pending.filename + ERROR_SUFFIX).write_text(json.dumps({"error": reason}))
        except OSError:  # a full disk may refuse even this; the client then reports the missing file
            pass
        self._release(pending)
