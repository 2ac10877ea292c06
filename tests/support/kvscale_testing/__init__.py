"""What only kvscale's tests and benchmarks use: never shipped, never imported by the plugin.

* ``tinymodels`` -- every tiny checkpoint shape the tests build (families, MTP layers,
  per-head scales, shards), from the steps of ``kvscale_plugin.demo.tinymodels``.
* ``checkpoints`` -- read back what ``tinymodels`` stored in a tiny checkpoint (its
  scales, the reference text's token ids).
* ``probe`` -- ``kvscale demo``'s in-process vLLM engine with every attention layer read
  back in full (scale tensors, floats, host copies, per-head values, data pointers,
  kvscale's resolution, module path); the tests' engine harness.
* ``engines`` -- look inside a running vLLM engine: attention layers, in-place weight
  reloads, ``apply_model`` / ``collective_rpc`` targets for engines with worker processes,
  and whether this CPU runs an FP8 KV cache at all.
* ``cpu_routes`` -- an ``apply_model`` target: which FP8 cache write (kvscale's C or
  plain-torch write, or vLLM's) each attention layer's CPU impl took per input dtype.

What ``kvscale demo`` itself uses stays with it in ``kvscale_plugin.demo`` (the Llama
builder of ``tinymodels``, the slim ``probe``, ``quality``, ``realmodel``); ``tinymodels``
and ``probe`` here extend those.

This folder (``tests/support``) is put on ``sys.path`` by pytest (``pythonpath`` in
pyproject.toml), by the scripts the tests run in fresh interpreters (tests/e2e/_*.py,
tests/compat/_probe.py) and by the benchmarks that need it.
"""
