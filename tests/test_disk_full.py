"""A full disk ends a stage in one line naming what was being written, where, and how to go on; nothing
half-written stays, and the rerun after space is freed finishes as an uninterrupted run does.

The real cases fill a small tmpfs (mounting one needs root; skipped elsewhere): torch.save's writer then
fails with `unexpected pos` and no errno, safetensors with only the text, zarr's shard files with ENOSPC."""

from __future__ import annotations

import errno
import re
import subprocess
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from test_train import TRAIN_ARGS
from test_user_errors import fails

from dflash_pipeline.extract.cli import main as extract_main
from dflash_pipeline.shared.runtime import durable
from dflash_pipeline.shared.runtime.durable import folder_bytes
from dflash_pipeline.shared.runtime.errors import DiskFull, cli_errors, is_disk_full
from dflash_pipeline.shared.runtime.launch import RankFailed, spawn_ranks
from dflash_pipeline.shared.store.reader import FeatureStore
from dflash_pipeline.train.cli import main as train_main

RUN_ARGS = [*TRAIN_ARGS, "--max-steps", "12", "--checkpoint-every", "4"]


@pytest.fixture
def small_disk(tmp_path):
    """`mount(size_bytes) -> folder` on a tmpfs of that size; `grow(size_bytes)` frees space on it."""
    mounted: list[Path] = []

    class Disk:
        def mount(self, size: int) -> Path:
            assert size > 0  # size=0 would mean no limit
            path = tmp_path / "disk"
            path.mkdir()
            try:
                done = subprocess.run(
                    ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
                )
            except FileNotFoundError:
                pytest.skip("no mount command here")
            if done.returncode != 0:
                pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
            mounted.append(path)
            return path

        def grow(self, size: int) -> None:
            subprocess.run(["mount", "-o", f"remount,size={size}", str(mounted[0])], check=True)

    yield Disk()
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture(scope="module")
def uninterrupted(store, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run") / "run"
    result = CliRunner().invoke(train_main, ["--store", str(store), "--out", str(out), *RUN_ARGS])
    assert result.exit_code == 0, result.output
    return out


def test_train_on_a_full_disk_says_so_keeps_no_half_checkpoint_and_resumes(store, uninterrupted, small_disk):
    checkpoint = folder_bytes(sorted((uninterrupted / "checkpoints").glob("step-*"))[-1])
    assert checkpoint > 0
    disk = small_disk.mount(int(1.5 * checkpoint))  # the first checkpoint fits, the second does not
    out = disk / "run"
    line = fails(train_main, ["--store", str(store), "--out", str(out), *RUN_ARGS], "checkpoint of step 8")
    assert "the disk is full" in line and str(out / "checkpoints") in line
    assert "--resume" in line and "step-00000004" in line  # where the rerun goes on from
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step-00000004"]
    small_disk.grow(4 * checkpoint + 2**20)
    result = CliRunner().invoke(train_main, ["--store", str(store), "--out", str(out), *RUN_ARGS, "--resume"])
    assert result.exit_code == 0, result.output
    for name in ("model.safetensors", "config.json"):
        assert (out / "drafter" / name).read_bytes() == (uninterrupted / "drafter" / name).read_bytes()


def test_extract_on_a_full_disk_names_the_shard_and_the_rerun_completes(
    tiny_target_dir, small_corpus, store, small_disk
):
    assets = folder_bytes(store / "target")
    disk = small_disk.mount(assets + (folder_bytes(store) - assets) // 3)  # the assets fit, the shards do not
    args = ["--target", str(tiny_target_dir), "--data", str(small_corpus), "--out", str(disk / "store")]
    args += ["--device", "cpu", "--max-length", "256", "--batch-tokens", "2048"]
    line = fails(extract_main, args, "shard", "rank-00000.zarr", "the disk is full", "rerun the same command")
    assert "MiB free" in line
    small_disk.grow(4 * folder_bytes(store) + 2**20)
    result = CliRunner().invoke(extract_main, args)
    assert result.exit_code == 0, result.output
    assert "warning" not in result.output  # room for the rest: no warning
    rerun, whole = FeatureStore(disk / "store"), FeatureStore(store)
    assert len(rerun) == len(whole) > 0
    for i in range(len(whole)):
        a, b = rerun[i], whole[i]
        assert a.sample_index == b.sample_index and a.input_ids.tolist() == b.input_ids.tolist()
        assert a.loss_mask.tolist() == b.loss_mask.tolist() and a.hidden_states.equal(b.hidden_states)


def test_extract_warns_at_the_start_when_the_disk_cannot_hold_the_store(
    tiny_target_dir, small_corpus, store, small_disk
):
    disk = small_disk.mount(folder_bytes(store) // 3)
    args = ["--target", str(tiny_target_dir), "--data", str(small_corpus), "--out", str(disk / "store")]
    result = CliRunner().invoke(extract_main, [*args, "--device", "cpu", "--max-length", "256"])
    assert result.exit_code == 1
    whole = FeatureStore(store)
    assert whole.hidden_dtype == torch.bfloat16
    per_token = whole.hidden_width * 2 + 4 + 1  # states, an int32 id, a uint8 loss mask
    warning = (
        f"needs about .* GiB more \\({whole.num_tokens:,} tokens x {per_token:,} B before compression\\) and {disk}"
    )
    assert re.search(warning, result.output), result.output
    assert result.output.index("warning") < result.output.index("extract rank 0: loading")  # before any work


def test_a_failed_folder_write_is_removed_and_only_a_full_disk_is_renamed(tmp_path, monkeypatch):
    def write(tmp: Path, exc: Exception) -> None:
        with durable.filling_folder(tmp, "the thing", "free space there") as folder:
            folder.mkdir()
            (folder / "part").write_bytes(b"x")
            raise exc

    torch_save = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    monkeypatch.setattr(durable, "free_bytes", lambda path: 0)
    with pytest.raises(DiskFull, match=r"writing the thing into .* failed: the disk is full \(0.0 MiB free\); free"):
        write(tmp_path / "a.tmp", torch_save)
    assert not (tmp_path / "a.tmp").exists()
    monkeypatch.setattr(durable, "free_bytes", lambda path: 2**40)  # space left: not the disk, the error stays
    with pytest.raises(RuntimeError, match="unexpected pos"):
        write(tmp_path / "b.tmp", torch_save)
    assert not (tmp_path / "b.tmp").exists()
    with pytest.raises(DiskFull):  # an errno or safetensors' text says it whatever the space
        write(
            tmp_path / "c.tmp", Exception("Error while serializing: I/O error: No space left on device (os error 28)")
        )


def test_what_counts_as_a_full_disk():
    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert is_disk_full(OSError(errno.EDQUOT, "quota"))
    chained = RuntimeError("unexpected pos")
    chained.__context__ = OSError(errno.ENOSPC, "x")
    assert is_disk_full(chained)
    assert is_disk_full(RuntimeError("unexpected pos"), free_bytes=0)
    assert not is_disk_full(RuntimeError("unexpected pos"))
    assert not is_disk_full(ValueError("bad shape"), free_bytes=0)  # a bug is not a full disk
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"), free_bytes=2**40)


def test_a_cli_reports_a_full_disk_from_any_write_in_one_line_and_keeps_other_tracebacks():
    import click

    def command(code: int):
        @click.command()
        @cli_errors("dflash-x")
        def main() -> None:
            raise OSError(code, "No space left on device" if code == errno.ENOSPC else "Permission denied")

        return main

    line = fails(command(errno.ENOSPC), [])
    assert line == "dflash-x: error: the disk is full: [Errno 28] No space left on device"
    result = CliRunner().invoke(command(errno.EACCES), [])
    assert isinstance(result.exception, PermissionError)  # not a user's full disk: the traceback stays


def _fills_the_disk(rank: int) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_worker_rank_on_a_full_disk_fails_in_one_line():
    with pytest.raises(RankFailed, match=r"^rank 0: the disk is full: \[Errno 28\] No space left on device$"):
        spawn_ranks(_fills_the_disk, 1)
