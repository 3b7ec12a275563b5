"""fp8 states on CUDA: the extractor quantizes there and the trainer dequantizes there, so both must give
the CPU's bits (bench/quality.py's fp8 store quantizes a bf16 store on the CPU and relies on it).

Run on the GPU machine: `python -m pytest tests/gpu -q`.
"""

import pytest
import torch

from dflash_pipeline.shared.store.fp8 import dequantize, quantize

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_cuda_quantize_and_dequantize_give_the_cpu_bits():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4096, 5 * 512, generator=g) * torch.logspace(-3, 3, 4096)[:, None]).to(torch.bfloat16)
    codes, scales = quantize(x, 5)
    cuda_codes, cuda_scales = quantize(x.cuda(), 5)
    assert torch.equal(cuda_codes.cpu().view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(cuda_scales.cpu(), scales)
    for dtype in (torch.float32, torch.bfloat16):
        want = dequantize(codes, scales, dtype)
        assert torch.equal(dequantize(cuda_codes, cuda_scales, dtype).cpu().view(torch.uint8), want.view(torch.uint8))
