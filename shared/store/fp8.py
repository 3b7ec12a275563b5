"""fp8 hidden states (`--store-dtype float8_e4m3fn`, docs/FORMAT.md): half the bytes of bf16 per token.

Each (token, stored layer) row of H values gets its own float32 scale, `amax / 448` (448 = the largest
e4m3 value), so every row uses the whole e4m3 range whatever its magnitude: the layers of one token
differ by orders of magnitude and outlier tokens would crush one shared scale. The codes are
`e4m3(x / scale)` (round to nearest even); `code * scale` gives the state back within
`max(|x| * 2^-4, scale * 2^-10)` (half a step of 3 mantissa bits, or of the subnormal step 2^-9).
Both directions run on whichever device holds the tensors: the extractor quantizes on the GPU before
its device->host copy, the trainer dequantizes after its host->device copy.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def quantize(rows: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes [T, W] and float32 scales [T, groups] of `rows` [T, W], whose W is `groups` layers side by side."""
    tokens, width = rows.shape
    grouped = rows.view(tokens, groups, width // groups)
    # max |x| is exact in any float dtype; the inf-norm takes it without a temporary |x| the size of rows
    amax = torch.linalg.vector_norm(grouped, ord=float("inf"), dim=-1).float()
    # divided by a tensor, not the Python number: CUDA turns division by a scalar into multiplication
    # by its rounded reciprocal, which differs from amax / 448 in the last bit for about half the rows
    scales = amax / torch.full_like(amax, FP8_MAX)
    divisor = torch.where(scales > 0, scales, 1.0)  # an all-zero row stays zero
    codes = torch.empty(tokens, groups, width // groups, dtype=FP8, device=rows.device)
    for g in range(groups):  # one layer at a time: the float32 temporary is [T, H], not [T, W]
        codes[:, g] = (grouped[:, g].float() / divisor[:, g, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return codes.view(tokens, width), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """States [..., W] in `dtype` from e4m3 codes [..., W] and their scales [..., groups]."""
    groups = scales.shape[-1]
    grouped = codes.view(*codes.shape[:-1], groups, codes.shape[-1] // groups)
    return grouped.float().mul_(scales.float()[..., None]).to(dtype).view(codes.shape)
