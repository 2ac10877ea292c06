"""A weight-transfer engine for tests on a CPU machine (no NCCL, no trainer).

vLLM 0.32's NCCL engine, at each step of a weight-sync session: ``start_weight_update``
-> ``initialize_layerwise_reload(self.model)`` and ``finish_weight_update`` ->
``finalize_layerwise_reload(self.model, self.model_config)`` (both imported from
``vllm.model_executor.model_loader.reload``), ``update_weights`` ->
``self.model.load_weights(...)`` with the trainer's tensors; ``set_weight_update_target``
/ ``reset_weight_update_target`` aim a session at the draft model and back. This one does
the same, with the tensors read from a checkpoint directory instead of a broadcast. The
worker driving it (``start_weight_update`` / ``start_draft_weight_update`` /
``update_weights`` / ``finish_weight_update``) is vLLM's own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def in_process_worker(llm: Any) -> Any:
    """The engine's (only) worker, for an in-process engine (the suite sets
    VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    return llm.llm_engine.model_executor.driver_worker.worker


class FileTransfer:
    supports_draft_weight_update = True

    def __init__(self, model: torch.nn.Module, model_config: Any) -> None:
        self.model, self.model_config = model, model_config
        self._default = (model, model_config)

    @classmethod
    def attach(cls, worker: Any) -> FileTransfer:
        engine = cls(worker.model_runner.get_model(), worker.vllm_config.model_config)
        worker.weight_transfer_engine = engine
        return engine

    def set_weight_update_target(self, model: torch.nn.Module, model_config: Any) -> None:
        self.model, self.model_config = model, model_config

    def reset_weight_update_target(self) -> None:
        self.model, self.model_config = self._default

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def update_weights(self, model_dir: Path) -> None:
        from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

        files = sorted(str(p) for p in Path(model_dir).glob("*.safetensors"))
        self.model.load_weights(safetensors_weights_iterator(files, False))

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
