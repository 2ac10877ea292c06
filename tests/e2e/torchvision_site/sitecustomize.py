"""Start-up shim for the one engine test that needs torchvision (Qwen3.5 + MTP).

vLLM 0.32's ``qwen3_5`` module imports torchvision (through ``qwen3_vl``), and so does
the fresh interpreter vLLM starts to inspect the architecture. The CPU venv has no
torchvision: PyPI's 0.28.0 (the release for torch 2.13) is a CUDA build whose operator
library cannot load next to CPU torch, and its Python part then fails on ``operator
torchvision::nms does not exist``. `make test` installs that wheel into
build/test-torchvision together with this file; the test puts that folder on
PYTHONPATH, so every process of that engine runs this first: defining the two operator
schemas torchvision looks up lets it import. Nothing runs its operators.
"""

import torch

torch.library.define(
    "torchvision::nms", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
)
torch.library.define(
    "torchvision::qnms", "(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor"
)
