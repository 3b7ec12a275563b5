"""bench.kernel_ptx compiles the engine's own launch of the paged decode kernel for Hopper without a GPU:
what it counts is what bench/RESULTS.md (runs 12-14) says of the compiled kernel, bf16 pages copied in
16 bytes at a time and fed to the tensor cores by `ldmatrix`, fp8 values read from shared memory a byte at
a time by the masked load; and what `finite_value_tails` is for."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from bench.kernel_ptx import ptx_profile  # noqa: E402


def test_counts_the_fp8_byte_loads_and_the_bf16_copies():
    fp8 = ptx_profile(torch.float8_e4m3fn, "thd", arch=90)
    assert fp8["instructions"].get("ld.shared.b8", 0) >= 64
    bf16 = ptx_profile(torch.bfloat16, "thd", arch=90)
    assert "ld.shared.b8" not in bf16["instructions"]
    assert bf16["instructions"]["cp.async.cg.shared.global"] > 0
    assert any(op.startswith("ldmatrix") and ".trans" in op for op in bf16["instructions"])
    assert bf16["shared_bytes"] > fp8["shared_bytes"]  # the same pipeline of pages twice as wide


def test_unmasked_token_minor_values_join_the_pipeline_without_byte_loads():
    """fp8 values stored token-minor (`vt`) and loaded unmasked, the engine's fp8 launch: 16-byte copies
    beside K's, no byte-wide reads, and no more shared memory than the token-major masked launch takes."""
    masked = ptx_profile(torch.float8_e4m3fn, "vt", arch=90)
    unmasked = ptx_profile(torch.float8_e4m3fn, "vt", arch=90, finite_value_tails=True)
    token_major = ptx_profile(torch.float8_e4m3fn, "thd", arch=90)
    ins = unmasked["instructions"]
    assert "ld.shared.b8" not in ins and "cp.async.ca.shared.global" not in ins
    assert ins["cp.async.cg.shared.global"] == 2 * masked["instructions"]["cp.async.cg.shared.global"]
    assert unmasked["shared_bytes"] == token_major["shared_bytes"]
