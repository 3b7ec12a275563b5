"""Durable replacement: a path holds the old or the new content, and file and folder are fsynced."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dflash_pipeline.shared.runtime import durable


@pytest.fixture
def fsynced(monkeypatch) -> list[Path]:
    """The paths os.fsync is called on, in order."""
    calls: list[Path] = []
    real = os.fsync

    def record(fd: int) -> None:
        calls.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        real(fd)

    monkeypatch.setattr(os, "fsync", record)
    return calls


def test_write_bytes_durably_fsyncs_file_then_folder(tmp_path, fsynced):
    path = tmp_path / "record.json"
    durable.write_bytes_durably(path, b"new")
    assert path.read_bytes() == b"new" and os.listdir(tmp_path) == ["record.json"]
    assert len(fsynced) == 2 and fsynced[0].parent == tmp_path and fsynced[0].name.endswith(".tmp")
    assert fsynced[1] == tmp_path


@pytest.mark.parametrize("fail_at", ["fsync", "replace"])
def test_failure_before_rename_leaves_old_content_and_no_temp(tmp_path, monkeypatch, fail_at):
    path = tmp_path / "record.json"
    path.write_bytes(b"old")

    def crash(*args) -> None:
        raise OSError("simulated crash")

    monkeypatch.setattr(os, fail_at, crash)
    with pytest.raises(OSError, match="simulated"):
        durable.write_bytes_durably(path, b"new content")
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["record.json"]


def test_replace_dir_durably_fsyncs_everything_before_the_rename(tmp_path, fsynced, monkeypatch):
    tmp, final = tmp_path / "ckpt.tmp", tmp_path / "ckpt"
    (tmp / "sub").mkdir(parents=True)
    (tmp / "a.bin").write_bytes(b"a")
    (tmp / "sub" / "b.bin").write_bytes(b"b")
    final.mkdir()
    (final / "stale").write_bytes(b"old")
    renamed_after: list[int] = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (renamed_after.append(len(fsynced)), real_replace(a, b))[1])
    durable.replace_dir_durably(tmp, final)
    assert sorted(str(p.relative_to(final)) for p in final.rglob("*")) == ["a.bin", "sub", "sub/b.bin"]
    assert not tmp.exists()
    before = set(fsynced[: renamed_after[0]])
    assert before == {tmp / "a.bin", tmp / "sub", tmp / "sub" / "b.bin", tmp}
    assert fsynced.index(tmp / "sub" / "b.bin") < fsynced.index(tmp / "sub") < fsynced.index(tmp)
    assert fsynced[renamed_after[0] :] == [tmp_path]
