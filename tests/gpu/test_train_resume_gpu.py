"""A finished CUDA run resumed with loader workers and pinned slots: with no steps left it must end (its cut
evaluation run, its drafter saved), and only a GPU has those slots to check it with.

Run on the GPU machine: `python -m pytest tests/gpu -q`.
"""

import json
import subprocess
import sys

import pytest
import torch
from test_feed_gpu import sample_store

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_a_finished_run_resumed_on_cuda_with_workers_ends(tiny_target_dir, tmp_path):
    store = sample_store(tiny_target_dir, tmp_path)
    out = tmp_path / "run"
    train = [
        sys.executable, "-m", "dflash_pipeline.train.cli", "--store", str(store), "--out", str(out), "--gpus", "0",
        "--num-layers", "1", "--block-size", "4", "--pack-tokens", "256", "--max-steps", "6", "--epochs", "100",
        "--eval-every", "3", "--checkpoint-every", "3", "--eval-samples", "8", "--loader-workers", "8", "--resume",
    ]  # fmt: skip
    subprocess.run(train, check=True, timeout=600)
    metrics = out / "metrics.jsonl"
    last_eval = json.dumps({"step": 6, "type": "eval"})[:-1]
    lines = metrics.read_text().splitlines()
    kept = [line for line in lines if not line.startswith(last_eval)]
    assert len(kept) < len(lines)
    metrics.write_text("\n".join(kept) + "\n")  # as a SIGTERM after the last step leaves it
    for f in (out / "drafter").iterdir():
        f.unlink()
    (out / "drafter").rmdir()
    done = subprocess.run(train, timeout=300, capture_output=True, text=True)  # a hang fails here
    assert done.returncode == 0, done.stderr[-2000:]
    assert "already complete at step 6" in done.stdout
    assert (out / "drafter" / "config.json").exists()
    assert any(
        json.loads(line).get("type") == "eval" and json.loads(line)["step"] == 6
        for line in metrics.read_text().splitlines()
    )
