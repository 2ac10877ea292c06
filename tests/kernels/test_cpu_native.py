"""The compiled CPU FP8 cache write (``kernels/cpu_native.py`` + ``cpu_fp8_write.c``):
every input bit pattern equals the torch contract byte for byte, bad input is refused
before any pointer is used, and the build (once per machine, on first use) is safe
when it cannot happen or when several processes do it at once.

The layout and the shared write cases run for both implementations in
``test_cpu_cache_write.py``; the e2e tests run it inside real vLLM engines.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_cpu_cache_write import SCALES, contract, random_cache, special_values

from kvscale_plugin.kernels import cpu_native
from kvscale_plugin.kernels.cpu_cache_write import cpu_fp8_cache_read

# Builds cpu_fp8_write.c with the machine's C compiler: `make test`, not `make test-fast`.
pytestmark = pytest.mark.compile


@pytest.fixture(scope="module")
def module():
    found = cpu_native.load()
    assert found is not None, cpu_native.failure()
    return found


@pytest.fixture
def rebuild(monkeypatch):
    """A fresh decision in this process (the earlier one restored after the test)."""
    monkeypatch.setattr(cpu_native, "decision", None)
    return monkeypatch


def write_and_read(module, values: torch.Tensor, scale: float, *, heads=4, head_size=64):
    """``values`` (a multiple of heads x head_size elements) written as K (and flipped,
    as V) through the compiled write; returns (K bytes, V bytes) in token order."""
    n = values.numel() // (heads * head_size)
    key = values.view(n, heads, head_size)
    value = values.flip(0).view(n, heads, head_size)
    block_size = 32
    cache = random_cache((n + block_size - 1) // block_size, heads, block_size, head_size)
    slots = torch.arange(n)
    written = cpu_native.write_native(
        module, key, value, cpu_native.native_target(cache), slots, scale, scale * 3
    )
    assert written == n
    k, v = cpu_fp8_cache_read(cache, slots)
    return k.reshape(-1), v.reshape(-1), value.reshape(-1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", SCALES)
def test_every_bit_pattern_equals_the_contract(module, dtype, scale):
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    k, v, flipped = write_and_read(module, x, scale)
    # Exact bytes, NaN included: the C code is torch's own conversion algorithm.
    assert torch.equal(k, contract(x, scale))
    assert torch.equal(v, contract(flipped, scale * 3))


@pytest.mark.parametrize("scale", SCALES)
def test_fp32_random_subnormal_and_special_inputs(module, scale):
    g = torch.Generator().manual_seed(0)
    x = torch.cat(
        [
            torch.randn(200_000, generator=g) * 300 * scale,
            (torch.rand(50_000, generator=g) - 0.5) * 2.0**-6 * scale,  # e4m3 subnormals
            special_values(scale),
        ]
    )
    x = torch.cat([x, torch.zeros(-x.numel() % 256)])
    k, v, flipped = write_and_read(module, x, scale)
    assert torch.equal(k, contract(x, scale))
    assert torch.equal(v, contract(flipped, scale * 3))


def test_specials(module):
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 1000.0, -1000.0, -0.0, 1.0625])
    x = torch.cat([x, -x.abs()[:1], torch.zeros(64 - 8)])  # a negative NaN too
    k, _, _ = write_and_read(module, x, 1.0, heads=1)
    got = k.tolist()
    assert got[0] == 0x7F and got[7] == 0xFF  # NaN stays NaN, with its sign
    assert got[1:5] == [0x7E, 0xFE, 0x7E, 0xFE]  # saturate to +-448
    assert got[5] == 0x80  # -0 kept
    assert got[6] == 0x38  # tie 1.0625 -> 1.0 (even), not 1.125


def _inputs(n=4, heads=2, head_size=64, dtype=torch.bfloat16):
    key = torch.randn(n, heads, head_size).to(dtype)
    return key, key.clone()


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("heads", "do not fit"),
        ("head size", "do not fit"),
        ("too few rows", "do not fit"),
        ("dtype mismatch", "one dtype"),
        ("float64", "one dtype"),
        ("int16 slots", "int32 or int64"),
        ("2-d slots", "slot_mapping shape"),
        ("strided slots", "contiguous"),
        ("transposed key", "contiguous last dimension"),
        ("4-d key", "key shape"),
    ],
)
def test_bad_input_is_refused_before_anything_is_written(module, case, message):
    cache = random_cache(2, 2, 32, 64)
    before = cache.clone()
    key, value = _inputs()
    slots = torch.tensor([0, 5, 40, 63])
    if case == "heads":
        key, value = _inputs(heads=3)
    elif case == "head size":
        key, value = _inputs(head_size=32)
    elif case == "too few rows":
        key, value = key[:3], value[:3]
    elif case == "dtype mismatch":
        value = value.half()
    elif case == "float64":
        key, value = key.double(), value.double()
    elif case == "int16 slots":
        slots = slots.to(torch.int16)
    elif case == "2-d slots":
        slots = slots.view(2, 2)
    elif case == "strided slots":
        slots = torch.tensor([0, 9, 5, 9, 40, 9, 63, 9])[::2]
    elif case == "transposed key":
        key = torch.randn(4, 64, 2).to(torch.bfloat16).transpose(1, 2)
    elif case == "4-d key":
        key = key.unsqueeze(0)
    with pytest.raises(ValueError, match=message):
        cpu_native.write_native(
            module, key, value, cpu_native.native_target(cache), slots, 1.0, 1.0
        )
    assert torch.equal(cache, before)


def test_slot_beyond_the_cache_raises_and_writes_nothing(module):
    cache = random_cache(2, 2, 32, 64)
    before = cache.clone()
    key, value = _inputs()
    target = cpu_native.native_target(cache)
    with pytest.raises(IndexError, match="slot 64 of token 3 is beyond the cache"):
        cpu_native.write_native(module, key, value, target, torch.tensor([0, 1, 2, 64]), 1, 1)
    assert torch.equal(cache, before)
    with pytest.raises(ValueError, match="1-byte"):
        cpu_native.native_target(torch.zeros(2, 2, 32, 128))


def test_built_once_then_loaded_from_disk(module, rebuild):
    """A second process (here: a fresh decision) loads the built file, compiling nothing."""
    path = cpu_native._target_path(cpu_native._compiler())
    assert path.is_file() and path.parent.parent == cpu_native.build_dir()

    def no_build(*args):
        raise AssertionError("compiled again")

    rebuild.setattr(cpu_native, "_build", no_build)
    again = cpu_native.load()
    assert again is not None and Path(again.__file__) == path


def test_an_unwritable_cache_folder_falls_back_to_the_temp_dir(rebuild, tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    rebuild.delenv(cpu_native.DIR_ENV)
    rebuild.setenv("XDG_CACHE_HOME", str(not_a_dir))  # mkdir under it fails (even as root)
    rebuild.setattr(cpu_native.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    found = cpu_native.load()
    assert found is not None, cpu_native.failure()
    assert Path(found.__file__).is_relative_to(tmp_path / "tmp")


def test_without_a_compiler_returns_none_with_one_warning(rebuild, kvscale_warnings):
    rebuild.setattr(cpu_native, "_compiler", lambda: None)
    assert cpu_native.load() is None
    assert cpu_native.load() is None  # decided once
    assert "no C compiler found" in cpu_native.failure()
    assert len(kvscale_warnings("compiled CPU FP8 cache write is not available")) == 1


def test_a_failing_compiler_returns_none_naming_the_command(rebuild, tmp_path, kvscale_warnings):
    rebuild.setenv("CC", "false")  # exists, exits 1
    rebuild.setenv(cpu_native.DIR_ENV, str(tmp_path))
    assert cpu_native.load() is None
    assert "`false " in cpu_native.failure() and "failed" in cpu_native.failure()
    assert len(kvscale_warnings("plain-torch write is used")) == 1
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # no half-built file left


def test_processes_building_at_once_all_load_it(tmp_path):
    """vLLM starts its TP workers together: each may build; each loads a whole file."""
    code = (
        "import torch\n"
        "from kvscale_plugin.kernels import cpu_native\n"
        "m = cpu_native.load()\n"
        "assert m is not None, cpu_native.failure()\n"
        "print('OK', m.__file__)\n"
    )
    env = dict(os.environ, **{cpu_native.DIR_ENV: str(tmp_path)})
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
    files = {o.split()[-1] for o, _ in outs}
    assert len(files) == 1
    built = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert [p.name for p in built] == [Path(next(iter(files))).name]  # no temp files left


def test_a_folder_others_can_write_is_not_loaded_from(module, rebuild, tmp_path):
    rebuild.setenv(cpu_native.DIR_ENV, str(tmp_path))
    assert cpu_native.load() is not None  # built there
    path = cpu_native._target_path(cpu_native._compiler(), tmp_path)
    cpu_native.decision = None  # decide again (the fixture restores the earlier one)
    path.parent.chmod(0o777)
    try:
        assert cpu_native.load() is None
        assert "writable by others" in cpu_native.failure()
    finally:
        path.parent.chmod(0o700)


def test_a_damaged_file_is_built_again(module, rebuild, tmp_path):
    # (a file this process has not loaded: rewriting a loaded one in place would pull
    # the code from under the process)
    rebuild.setenv(cpu_native.DIR_ENV, str(tmp_path))
    path = cpu_native._target_path(cpu_native._compiler(), tmp_path)
    path.parent.mkdir(mode=0o700, parents=True)
    path.write_bytes(b"not a shared object")
    again = cpu_native.load()
    assert again is not None, cpu_native.failure()
    assert path.read_bytes()[:4] == b"\x7fELF"


def test_a_build_that_stores_other_bytes_is_refused(module, rebuild, kvscale_warnings):
    def wrong(module_):
        def write(*args):
            module_.write(*args)
            # then flip one bit of the first cache byte the self-test reads back
            ctypes.c_uint8.from_address(args[8][0]).value ^= 0x01

        return type("Miscompiled", (), {"setup": module_.setup, "write": staticmethod(write)})()

    real_import = cpu_native._import
    rebuild.setattr(cpu_native, "_import", lambda path: wrong(real_import(path)))
    assert cpu_native.load() is None
    assert "differently from torch" in cpu_native.failure()
    assert len(kvscale_warnings("compiled CPU FP8 cache write is not available")) == 1
