"""bench.kernel_ptx compiles the engine's own launch of the paged decode kernel for Hopper without a GPU:
what it counts is what `whole_value_pages` is for (fp8 values read from shared memory a byte at a time
by the masked load, not by the whole-page load)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from bench.kernel_ptx import ptx_profile  # noqa: E402


def test_whole_value_pages_remove_the_fp8_byte_loads():
    masked, whole = (ptx_profile(torch.float8_e4m3fn, "thd", w, arch=90) for w in (False, True))
    assert masked["instructions"].get("ld.shared.b8", 0) >= 64
    assert "ld.shared.b8" not in whole["instructions"]
    assert any(op.startswith("ldmatrix") and ".trans" in op for op in whole["instructions"])
    assert whole["shared_bytes"] - masked["shared_bytes"] == 64 * 128 * 2  # one float16 page of values
    bf16 = ptx_profile(torch.bfloat16, "thd", False, arch=90)
    assert "ld.shared.b8" not in bf16["instructions"] and bf16["instructions"]["cp.async.cg.shared.global"] > 0
