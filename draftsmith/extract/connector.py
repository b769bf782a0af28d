"""A vLLM KV connector that hands captured hidden states to draftsmith, on CPU and CUDA.

vLLM's ``extract_hidden_states`` speculative method stores the residual stream of the
chosen layers for every processed token in a cache-only attention layer, one paged
buffer ``[blocks, layers, block_size, hidden]``. When a request finishes, this
connector gathers its rows into ``[tokens, layers, hidden]`` and writes them with the
token ids to ``<staging_dir>/<request id>.safetensors``.

Differences from vLLM's example connector, and why:
- No CUDA streams, events or pinned memory on CPU (the example crashes there); on CUDA
  the device-to-host copy is asynchronous and the blocks are released only after it.
- Files appear atomically (written as ``.tmp`` then renamed), so a reader waits for the
  final name instead of taking a file lock.
- A request can opt out with ``kv_transfer_params={"save": False}``: draftsmith uses the
  same engine to write its own prompts and to regenerate earlier turns, whose states
  nobody needs.

Per-request ``kv_transfer_params``: ``include_output_tokens`` (capture prompt + output,
minus the last sampled token which is never fed back) and ``save``.
Extra config (``kv_connector_extra_config``): ``staging_dir`` (required).
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file
from vllm.config import VllmConfig, get_layers_from_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
from vllm.logger import init_logger
from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

logger = init_logger(__name__)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


@dataclass
class _Save:
    req_id: str
    path: str
    token_ids: list[int]
    block_ids: list[int]


@dataclass
class _Meta(KVConnectorMetadata):
    saves: list[_Save] = field(default_factory=list)


def staged_path(staging_dir: str, req_id: str) -> str:
    """Where the connector writes a request's states (the file appears atomically)."""
    return os.path.join(staging_dir, f"{req_id}.safetensors")


class DraftsmithHiddenStatesConnector(KVConnectorBase_V1, SupportsHMA):
    """Store-only connector writing ``hidden_states`` [tokens, layers, hidden] per request."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._staging_dir = self._kv_transfer_config.get_from_extra_config("staging_dir", None)
        if not self._staging_dir:
            raise ValueError(
                "DraftsmithHiddenStatesConnector needs kv_connector_extra_config.staging_dir"
            )
        self._group = self._hidden_state_group(kv_cache_config)
        self._block_size = (
            kv_cache_config.kv_cache_groups[self._group].kv_cache_spec.block_size
            if kv_cache_config is not None
            else vllm_config.cache_config.block_size
        )
        # Scheduler side.
        self._queued: list[_Save] = []
        # Worker side.
        self._buffer: torch.Tensor | None = None
        self._writes_enabled = True
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="draftsmith-hs")
        self._inflight: dict[str, tuple[Future, Any]] = {}
        self._finished: set[str] = set()

    @staticmethod
    def _hidden_state_group(kv_cache_config: KVCacheConfig | None) -> int:
        if kv_cache_config is None:
            return 0
        groups = kv_cache_config.kv_cache_groups
        ids = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, HiddenStateCacheSpec)]
        if len(ids) == 1:
            return ids[0]
        if not ids and len(groups) == 1:
            return 0
        raise ValueError(f"expected one hidden-state cache group, found {len(ids)}")

    # ---------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int):
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        return None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = _Meta(saves=self._queued)
        self._queued = []
        return meta

    def request_finished(self, request: Request, block_ids: list[int]):
        params = request.kv_transfer_params or {}
        if not params.get("save", True):
            return False, None
        if params.get("include_output_tokens", False):
            # The last sampled token was never fed through the model: no state for it.
            token_ids = list(request.all_token_ids)[:-1]
        else:
            token_ids = list(request.prompt_token_ids or [])
        path = staged_path(self._staging_dir, request.request_id)
        self._queued.append(_Save(request.request_id, path, token_ids, list(block_ids)))
        return True, {"hidden_states_path": path}

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]):
        if not 0 <= self._group < len(block_ids):
            return False, None
        return self.request_finished(request, block_ids[self._group])

    def get_finished_count(self) -> int:
        return 1  # only tensor-parallel rank 0 writes

    # ---------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        self._writes_enabled = get_tensor_model_parallel_rank() == 0
        layers = get_layers_from_vllm_config(
            self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches.keys())
        )
        if len(layers) != 1:
            raise ValueError(f"expected one hidden-state cache layer, found {len(layers)}")
        self._buffer = kv_caches[next(iter(layers))]
        if self._buffer.shape[2] != self._block_size:
            raise ValueError(
                f"hidden-state buffer block size {self._buffer.shape[2]} "
                f"!= scheduler block size {self._block_size}"
            )

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kw) -> None:
        return None  # states are already in the buffer; gathered when a request ends

    def wait_for_save(self) -> None:
        return None

    def _gather(self, save: _Save) -> torch.Tensor:
        """Rows of one request: [tokens, layers, hidden] on the buffer's device."""
        assert self._buffer is not None
        n = len(save.token_ids)
        blocks = torch.tensor(save.block_ids, dtype=torch.long, device=self._buffer.device)
        # Slot s of the request lives at block blocks[s // B], offset s % B.
        slots = torch.arange(n, device=self._buffer.device)
        block = blocks[slots // self._block_size]
        return self._buffer[block, :, slots % self._block_size]  # [tokens, layers, hidden]

    def _start_save(self, save: _Save) -> None:
        states = self._gather(save)
        event = None
        if states.is_cuda:
            host = torch.empty(states.shape, dtype=states.dtype, pin_memory=True)
            host.copy_(states, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            states = host
        else:
            states = states.clone()  # advanced indexing already copies; clone keeps it explicit
        token_ids = torch.tensor(save.token_ids, dtype=torch.int64)
        future = self._pool.submit(_write, save.path, states, token_ids, event)
        future.add_done_callback(_log_failure)
        self._inflight[save.req_id] = (future, event)

    def get_finished(self, finished_req_ids: set[str]):
        if self._writes_enabled and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, _Meta):
                for save in meta.saves:
                    self._start_save(save)
        self._finished |= finished_req_ids
        done: set[str] = set()
        for req_id in list(self._finished):
            future, event = self._inflight.get(req_id, (None, None))
            if future is None:
                continue
            # Blocks may be reused once the copy out of them is complete.
            if event is not None and not event.query():
                continue
            self._inflight.pop(req_id)
            self._finished.discard(req_id)
            done.add(req_id)
        return done or None, None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return "LBNHC"  # keep one token's layers together, as the gather above assumes


def _log_failure(future: Future) -> None:
    if future.exception() is not None:
        # The driver times out waiting for this file and reports the request.
        logger.error("draftsmith: writing hidden states failed: %r", future.exception())


def _write(path: str, states: torch.Tensor, token_ids: torch.Tensor, event) -> None:
    if event is not None:
        event.synchronize()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    save_file({"hidden_states": states.contiguous(), "token_ids": token_ids}, tmp)
    os.replace(tmp, path)
