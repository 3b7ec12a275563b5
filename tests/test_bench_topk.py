"""The top-k bench's two-stage top-k gives torch.topk's values, sorted, at every group size."""

from __future__ import annotations

import torch

from bench.topk import main, two_stage_topk


def test_two_stage_topk_equals_torch_topk_whether_or_not_the_group_divides_the_vocabulary():
    logits = torch.randn(37, 1000, generator=torch.Generator().manual_seed(0))
    logits[3, [5, 700]] = 9.0  # a tie at the top
    want = logits.topk(16, dim=-1)
    for group in (16, 64, 100, 128, 1000, 4096):
        values, indices = two_stage_topk(logits, 16, group)
        assert torch.equal(values, want.values), group
        assert torch.equal(logits.gather(1, indices), want.values), group
        assert all(len(set(row)) == 16 for row in indices.tolist())  # k distinct entries per row


def test_bench_reports_exactness_and_ratios_on_cpu(tmp_path):
    result = main(
        [
            "--rows",
            "8",
            "--vocab",
            "1000",
            "--group",
            "64",
            "--group",
            "96",
            "--repeats",
            "2",
            "--device",
            "cpu",
            "--json",
            str(tmp_path / "topk.json"),
        ]
    )
    (shape,) = result["shapes"]
    assert [(t["group"], t["exact"]) for t in shape["two_stage"]] == [(64, True), (96, True)]
    assert shape["torch_topk_s"] > 0 and shape["bound_s"] > 0 and result["copy_bytes_per_s"] > 0
    assert (tmp_path / "topk.json").exists()
