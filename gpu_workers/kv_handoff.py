"""sluice's shared-storage KV connector for vLLM, loaded by the engine's processes through
`kv_connector_module_path` (never imported by the worker process itself).

It is vLLM's ExampleConnector with three changes, so a handoff is a private, one-request affair:
- only a request whose kv_transfer_params name a handoff (gpu_workers.handoff) saves or loads, and only
  the side it asks for: nothing else is written to the shared folder;
- a handoff's KV lives in a folder named by its secret id, not by the prompt's hash, so one team's
  request can never load KV written for another's, nor learn from timing that another sent a prompt;
- a request preempted after loading recomputes instead of loading again.
"""

from __future__ import annotations

import os
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
    ExampleConnectorMetadata,
)

from gpu_workers.handoff import KvTransfer, parse_params


class SluiceHandoffConnector(ExampleConnector):  # type: ignore[misc]
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._handoffs: dict[str, KvTransfer] = {}  # request id -> its part, until it is scheduled

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        kv = parse_params(request.kv_transfer_params)
        if kv is None or request.request_id in self._handoffs:
            return 0, False  # not a handoff, or a preempted one: computed here
        self._handoffs[request.request_id] = kv
        if kv.save:
            return 0, False
        count, asynchronous = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if count is None or count <= 0:  # its own prefix cache holds at least as much
            return 0, False
        return count, asynchronous

    def _found_match_for_request(self, request: Any) -> bool:
        kv = self._handoffs.get(request.request_id)
        return kv is not None and os.path.isdir(os.path.join(self._storage_path, kv.handoff_id))

    def _generate_foldername_debug(
        self, token_ids: Any, mm_hashes: list[str], create_folder: bool = False
    ) -> str:
        # mm_hashes carries the handoff id (build_connector_meta below); folder names never come from
        # the prompt.
        folder = os.path.join(self._storage_path, mm_hashes[0])
        if create_folder:
            os.makedirs(folder, exist_ok=True)
        return folder

    def build_connector_meta(self, scheduler_output: Any) -> ExampleConnectorMetadata:
        meta = ExampleConnectorMetadata()
        for new_req in scheduler_output.scheduled_new_reqs:
            kv = self._handoffs.get(new_req.req_id)
            loading = new_req.req_id in self._requests_need_load
            if kv is None or not (kv.save or loading):
                continue
            meta.add_request(
                token_ids=new_req.prompt_token_ids or [],
                block_ids=new_req.block_ids[0],
                block_size=self._block_size,
                is_store=not loading,
                mm_hashes=[kv.handoff_id],
            )
        self._requests_need_load.clear()
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._handoffs.pop(request.request_id, None)
        return False, None
