"""Checkpoints that a crash cannot leave half-written: a folder is complete or it is not there.

`OUT/checkpoints/step-00000100/` holds the drafter (config.json + model.safetensors, loadable as
is), `trainer.pt` (optimizer, schedule) and `state.json` (step, data position, store identity).
It is written under a temporary name, fsynced and renamed; `OUT/checkpoints/latest` names the newest.
The final drafter, `OUT/drafter/`, is written the same way.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_pipeline.shared.model.config import CONFIG_FILE
from dflash_pipeline.shared.model.drafter import DFlashDrafter
from dflash_pipeline.shared.runtime.durable import filling_folder, replace_dir_durably, write_bytes_durably
from dflash_pipeline.shared.target.identity import TargetIdentity
from dflash_pipeline.train.config import RESUME_HINT

LATEST = "latest"


@dataclass
class TrainState:
    step: int  # optimizer steps done
    epoch: int
    step_in_epoch: int  # steps done within `epoch`
    store_identity: dict
    last_loss: float | None = None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def checkpoint_dir(out: Path) -> Path:
    return out / "checkpoints"


def save_checkpoint(
    out: Path, model: DFlashDrafter, optimizer, scheduler, state: TrainState, keep: int, target: TargetIdentity
) -> Path:
    root = checkpoint_dir(out)
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{state.step:08d}"
    final = root / name
    with filling_folder(root / f".{name}.tmp", f"the checkpoint of step {state.step}", resume_hint(out)) as tmp:
        model.save_pretrained(tmp)
        target.save(tmp)  # a checkpoint is a drafter dflash-eval can check against its target
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / "trainer.pt")
        (tmp / "state.json").write_text(json.dumps(state.to_dict(), indent=1))
        replace_dir_durably(tmp, final)
        write_bytes_durably(root / LATEST, name.encode())
    for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def save_drafter(model: DFlashDrafter, folder: Path, target: TargetIdentity) -> None:
    """The trained drafter with its target's identity, written whole or not at all."""
    with filling_folder(folder.with_name(f".{folder.name}.tmp"), "the drafter", resume_hint(folder.parent)) as tmp:
        model.save_pretrained(tmp)
        target.save(tmp)
        replace_dir_durably(tmp, folder)


def resume_hint(out: Path) -> str:
    """What to do after a write under `out` failed for space, naming the checkpoint training goes on from."""
    last = latest_checkpoint(out)
    return f"free space there, then {RESUME_HINT} ({last.name if last else 'none is complete yet'})"


def latest_checkpoint(out: Path) -> Path | None:
    pointer = checkpoint_dir(out) / LATEST
    if not pointer.exists():
        return None
    path = checkpoint_dir(out) / pointer.read_text().strip()
    return path if path.is_dir() else None


def run_folder_note(folder: Path) -> str | None:
    """If `folder`, given where a drafter belongs, is a dflash-train run: what to pass instead."""
    if (folder / "drafter" / CONFIG_FILE).is_file():
        return f"a dflash-train run, not a drafter: its drafter is {folder / 'drafter'}"
    if last := latest_checkpoint(folder):
        return f"a dflash-train run without its final drafter yet: its latest checkpoint, {last}, loads as one"
    return None


def load_state(path: Path) -> TrainState:
    return TrainState(**json.loads((path / "state.json").read_text()))


def load_trainer_state(path: Path, optimizer, scheduler) -> None:
    blob = torch.load(path / "trainer.pt", map_location="cpu", weights_only=True)
    optimizer.load_state_dict(blob["optimizer"])
    scheduler.load_state_dict(blob["scheduler"])
