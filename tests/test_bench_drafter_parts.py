"""bench/drafter_parts.py: a drafter cut into parts and put back loads as the drafter cast to bfloat16."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

import bench.drafter_parts as parts
from dflash_pipeline.shared.model.drafter import DFlashDrafter
from dflash_pipeline.train.checkpoint import latest_checkpoint
from tests.test_drafter import tiny_drafter


def trained_run(root: Path, final: bool) -> tuple[Path, DFlashDrafter]:
    """A run folder as dflash-train leaves it: a checkpoint (drafter + optimizer state), maybe a final drafter."""
    run, model = root / "d2", tiny_drafter(seed=3)
    step = run / "checkpoints" / "step-00000700"
    model.save_pretrained(step)
    (step / "trainer.pt").write_bytes(b"optimizer state")
    (step / "state.json").write_text("{}")
    (step / "target_identity.json").write_text('{"name": "t"}')
    (run / "checkpoints" / "latest").write_text(step.name)
    if final:
        model.save_pretrained(run / "drafter")
        (run / "drafter" / "target_identity.json").write_text('{"name": "t"}')
    return run, model


def assert_bfloat16_of(folder: Path, model: DFlashDrafter) -> None:
    loaded = DFlashDrafter.from_pretrained(folder).state_dict()
    expected = model.state_dict()
    assert loaded.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(loaded[key].float(), value.to(torch.bfloat16).float()), key
    assert (folder / "target_identity.json").read_text() == '{"name": "t"}'


@pytest.mark.parametrize("final", [True, False])
def test_parts_sent_over_calls_and_put_back_give_the_drafter_in_bfloat16(
    tmp_path: Path, monkeypatch, final: bool
) -> None:
    run, model = trained_run(tmp_path / "gpu", final)
    monkeypatch.setattr(parts, "PART_BYTES", 8_000)  # several parts from a tiny drafter
    tiny_drafter(seed=4).save_pretrained(parts.source(run)[0])  # packed, then trained on: packed again
    stale = parts.pack(run, tmp_path / "parts")
    model.save_pretrained(parts.source(run)[0])
    written = parts.pack(run, tmp_path / "parts")
    assert stale[0].name != written[0].name and sorted((tmp_path / "parts").iterdir()) == written
    count, kind = len(written), "final" if final else "step-00000700"
    assert count > 3 and all(p.stat().st_size <= 8_000 for p in written)
    sha = written[0].name.split(".")[1]
    assert [p.name for p in written] == [f"drafter_d2_{kind}.{sha}.tar.{i:02d}-of-{count:02d}" for i in range(count)]
    calls = [parts.send(tmp_path / "parts", tmp_path / f"out{i}", max_parts=2) for i in range(-(-count // 2))]
    assert [p.name for sent in calls for p in sent] == [p.name for p in written]  # each once, in order
    assert not any((tmp_path / "parts").iterdir())
    carried, runs = tmp_path / "carried", tmp_path / "next"
    carried.mkdir()
    for sent in calls[:-1]:  # stashed call by call: unpacking waits for the whole set
        for p in sent:
            p.rename(carried / p.name)
    with pytest.raises(SystemExit, match=rf"drafter_d2_{kind}\.{sha}\.tar lacks parts .* of {count:02d}"):
        parts.unpack(carried, runs)
    for p in calls[-1]:
        p.rename(carried / p.name)
    (target,) = parts.unpack(carried, runs)
    if final:
        assert target == runs / "d2" / "drafter"
    else:
        assert target == latest_checkpoint(runs / "d2") == runs / "d2" / "checkpoints" / kind
        assert not (target / "trainer.pt").exists() and not (target / "state.json").exists()
    assert_bfloat16_of(target, model)
    assert parts.unpack(carried, runs) == []  # already there: left as it is


def test_a_part_cut_short_is_named(tmp_path: Path, monkeypatch) -> None:
    run, _ = trained_run(tmp_path / "gpu", final=True)
    monkeypatch.setattr(parts, "PART_BYTES", 8_000)
    written = parts.pack(run, tmp_path / "parts")
    written[1].write_bytes(written[1].read_bytes()[:100])
    with pytest.raises(SystemExit, match=r"drafter_d2_final\.[0-9a-f]{12}\.tar from \d+ parts: sha256 mismatch"):
        parts.unpack(tmp_path / "parts", tmp_path / "next")


def test_a_part_lost_on_the_way_is_packed_again_alike(tmp_path: Path, monkeypatch) -> None:
    """A call's return limits can drop a part that `send` already moved out: packing the same drafter
    again, seconds later, must give the same parts, or the ones that came back are no use."""
    run, model = trained_run(tmp_path / "gpu", final=False)
    monkeypatch.setattr(parts, "PART_BYTES", 8_000)
    first = parts.pack(run, tmp_path / "parts")
    arrived = tmp_path / "arrived"
    arrived.mkdir()
    for p in first[:-1]:  # the last one lost
        p.rename(arrived / p.name)
    time.sleep(1.1)  # a tar's times are whole seconds
    again = parts.pack(run, tmp_path / "parts2")
    assert [p.name for p in again] == [p.name for p in first]
    again[-1].rename(arrived / again[-1].name)
    (target,) = parts.unpack(arrived, tmp_path / "next")
    assert_bfloat16_of(target, model)
