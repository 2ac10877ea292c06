"""What only kvscale's tests and benchmarks use: never shipped, never imported by the plugin.

* ``checkpoints`` -- read back what ``kvscale_plugin.demo.tinymodels`` stored in a tiny
  checkpoint (its scales, the reference text's token ids).
* ``engines`` -- look inside a running vLLM engine: attention layers, in-place weight
  reloads, ``apply_model`` / ``collective_rpc`` targets for engines with worker processes,
  and whether this CPU runs an FP8 KV cache at all.
* ``cpu_routes`` -- an ``apply_model`` target: which FP8 cache write (kvscale's C or
  plain-torch write, or vLLM's) each attention layer's CPU impl took per input dtype.

The builders and the in-process engine harness these extend live with ``kvscale demo`` in
``kvscale_plugin.demo`` (``tinymodels``, ``probe``, ``quality``, ``realmodel``): import
them from there.

This folder (``tests/support``) is put on ``sys.path`` by pytest (``pythonpath`` in
pyproject.toml), by the scripts the tests run in fresh interpreters (tests/e2e/_*.py,
tests/compat/_probe.py) and by the benchmarks that need it.
"""
