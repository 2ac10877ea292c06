"""Start-up shim for the processes of a CPU ``sglang.Engine`` (tests/sglang_engine only).

SGLang imports torchvision unconditionally, and PyPI's torchvision 0.28.0 (the release
for torch 2.13) is a CUDA build whose operator library cannot load next to the CPU
torch; its Python part then fails on ``operator torchvision::nms does not exist``. The
Engine runs its scheduler in a fresh subprocess, so the test process's own fix
(``conftest.py``) does not reach it: tests/sglang_engine/conftest.py puts this folder on
PYTHONPATH for the Engine only, and every process it starts runs this first. Defining
the two operator schemas torchvision looks up lets it import; nothing runs its operators.
"""

import torch

for _name, _schema in (
    ("torchvision::nms", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"),
    ("torchvision::qnms", "(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor"),
):
    try:
        torch.library.define(_name, _schema)
    except RuntimeError:  # already defined in this process
        pass
