"""The paged decode kernel compiled for a GPU that is not here: its shared memory and the PTX instructions
that move K and V, per page dtype and layout, with the value pages masked (the default) and loaded unmasked
(`finite_value_tails`), to see what a change to the kernel does before a GPU times it.

The launch is the engine's own (`_paged_decode_attention_triton` on CPU tensors of Qwen3-8B's attention
shapes, bench.decode_attention's pages in each LAYOUTS order), its kernel call recorded instead of run;
the arguments are specialized as Triton's launcher does (pointers and integers divisible by 16, integers
equal to 1 as constants) and the kernel compiled for `--arch` (Triton's PTX, no ptxas needed beyond
Triton's own). Counted: global -> shared copies (`cp.async`, .cg moves 16 bytes, .ca 4 or 8), shared-memory
loads by width (`ld.shared.b8` is one byte), `ldmatrix` (.trans: transposed 16-bit tiles) and `mma`, as
they stand in the code (the page loop's body once, the pipeline's prologue copies beside it).

    python -m bench.kernel_ptx --kv-dtype float8_e4m3fn --layout thd --json ptx.json
"""

from __future__ import annotations

import argparse
import itertools
import re
import types
from collections import Counter

import torch

from bench import emit
from bench.decode_attention import HEAD_DIM, HEADS, LAYOUTS, MAX_LEN, page_view
from dflash_pipeline.shared.generation import paged_attention

_TRITON_TYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.int32: "i32",
    torch.int64: "i64",
}
_COUNTED = re.compile(r"^\s*((?:cp\.async\.c[ag]|ld\.shared|st\.shared|ldmatrix|mma)[.\w]*)", re.M)


class _Recorder:
    """Stands in for a Triton kernel: `kernel[grid](*args, **meta)` records the call."""

    def __init__(self, calls: list):
        self.calls = calls

    def __getitem__(self, grid):
        return lambda *args, **meta: self.calls.append((args, meta))


def recorded_launch(kv_dtype: torch.dtype, layout: str, finite_value_tails: bool = False, page: int = 64) -> tuple:
    """(args, meta) of the kernel call the launch makes for a few rows of bench.decode_attention's
    shapes (the batch size and the lengths are runtime values: they change nothing compiled)."""
    q = torch.zeros(4, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    k, v = (page_view(8, page, kv_dtype, "cpu", order) for order in LAYOUTS[layout])
    table = torch.zeros(4, -(-MAX_LEN // page), dtype=torch.int32)
    lengths = torch.full((4,), 550, dtype=torch.int32)
    calls = []
    recorder = types.SimpleNamespace(attn=_Recorder(calls))
    real = paged_attention._kernels
    paged_attention._kernels = lambda: recorder
    try:
        paged_attention._paged_decode_attention_triton(
            q, k, v, table, lengths, HEAD_DIM**-0.5, num_splits=1, finite_value_tails=finite_value_tails
        )
    finally:
        paged_attention._kernels = real
    return calls[0]


def compile_launch(args: tuple, meta: dict, arch: int):
    """The kernel compiled for sm_`arch` with `args` specialized as Triton's launcher specializes them."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = paged_attention._kernels().attn
    names = kernel.arg_names
    options = {key: meta.pop(key) for key in ("num_warps", "num_stages", "maxnreg") if key in meta}
    signature, constants, attrs = {}, dict(meta), {}
    for i, (name, value) in enumerate(zip(names, args)):
        index = (i,)
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + _TRITON_TYPES[value.dtype]
            if value.data_ptr() % 16 == 0:
                attrs[index] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value == 1:
            constants[name] = 1
        else:
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[index] = [["tt.divisibility", 16]]
    for name in constants:
        signature[name] = "constexpr"
    signature = {name: signature[name] for name in names}
    source = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={(names.index(n),): v for n, v in constants.items()},
        attrs=attrs,
    )
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def ptx_profile(kv_dtype: torch.dtype, layout: str, arch: int, finite_value_tails: bool = False) -> dict:
    args, meta = recorded_launch(kv_dtype, layout, finite_value_tails)
    compiled = compile_launch(args, meta, arch)
    counts = Counter(_COUNTED.findall(compiled.asm["ptx"]))
    return {
        "kv_dtype": str(kv_dtype).removeprefix("torch."),
        "layout": layout,
        "finite_value_tails": finite_value_tails,
        "shared_bytes": compiled.metadata.shared,
        "instructions": dict(sorted(counts.items())),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kv-dtype", choices=["bfloat16", "float8_e4m3fn"], action="append", default=None)
    ap.add_argument("--layout", choices=list(LAYOUTS), action="append", default=None)
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 [default: 90, Hopper]")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import triton

    result = {"triton": triton.__version__, "arch": args.arch, "variants": []}
    for kv, layout, finite in itertools.product(
        args.kv_dtype or ["bfloat16", "float8_e4m3fn"], args.layout or ["thd"], (False, True)
    ):
        row = ptx_profile(getattr(torch, kv), layout, args.arch, finite)
        result["variants"].append(row)
        moves = ", ".join(f"{op} x{n}" for op, n in row["instructions"].items())
        values = "unmasked" if finite else "masked"
        print(f"{kv} pages, layout {layout}, values {values}: {row['shared_bytes']:,} B shared; {moves}")
    emit(result, args.json)
    return result


if __name__ == "__main__":
    main()
