"""A trained drafter brought back from the GPU machine and carried to the next one, so its evaluation
need not wait for training in the same session (a machine starts bare; training the issue 18 drafters
takes most of a session's device time).

A call brings back at most 8 files, 16 MiB each and 64 MiB in all, and carries at most 64 MiB; a 5-layer
DFlash-2 of SmolLM2's width is 182 MB in float32 (its selector's two codebooks, vocabulary x 256, are
more than half of it). `pack` writes the run's drafter (its final one, else its latest checkpoint's,
without the optimizer) with bfloat16 weights, as the reference serves drafters, as a tar cut into parts
of at most 15 MiB named `drafter_RUN_KIND.SHA.tar.NN-of-MM` (SHA: the tar's sha256, checked when joined)
in a folder on the machine; `send` moves the next few of them into $OUT, so a drafter that does not fit one
call's return comes back over several. `unpack` joins a complete set where `quality_scale evaluate` looks
for that run's drafter.

    python -m bench.drafter_parts pack --run RUN/NAME --parts DIR         # on the GPU machine
    python -m bench.drafter_parts send --parts DIR --out $OUT --max-parts 3
    python -m bench.drafter_parts unpack --parts DIR --runs RUN           # on the next one
"""

from __future__ import annotations

import argparse
import hashlib
import io
import re
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

import torch

from bench.quality_scale import run_drafter
from dflash_pipeline.shared.model.drafter import CONFIG_FILE, WEIGHTS_FILE, DFlashDrafter
from dflash_pipeline.train.checkpoint import LATEST, checkpoint_dir

PART_BYTES = 15 * 2**20
SKIPPED = {"trainer.pt", "state.json"}  # a checkpoint's optimizer and data position: not the drafter
PART_NAME = re.compile(
    r"drafter_(?P<run>.+)_(?P<kind>final|step-\d+)\.(?P<sha>[0-9a-f]{12})\.tar\.(?P<number>\d\d)-of-(?P<count>\d\d)"
)


def source(run: Path) -> tuple[Path, str]:
    """The run's drafter folder as `quality_scale evaluate` picks it, and its name in the parts: `final`, or
    the checkpoint's `step-N`."""
    if (found := run_drafter(run)) is None:
        sys.exit(f"drafter_parts pack: {run}: no drafter and no checkpoint")
    folder, tag = found
    return folder, folder.name if tag else "final"


def reproducible(member: tarfile.TarInfo) -> tarfile.TarInfo:
    """A member without the time and owner of its writing: a pack of the same drafter gives the same
    bytes again, so a part that did not come back can be packed again and sent beside the others."""
    member.mtime, member.uid, member.gid, member.uname, member.gname = 0, 0, 0, "", ""
    return member


def pack(run: Path, parts_dir: Path) -> list[Path]:
    """The run's drafter, bfloat16, as a tar in parts of at most PART_BYTES in `parts_dir` (replacing the
    parts of an earlier pack of the run still there)."""
    folder, kind = source(run)
    blob = io.BytesIO()
    with tempfile.TemporaryDirectory() as tmp, tarfile.open(fileobj=blob, mode="w") as tar:
        drafter = DFlashDrafter.from_pretrained(folder, attention_backend="sdpa_dense")
        written = drafter.save_pretrained(tmp, dtype=torch.bfloat16)
        for p in sorted(folder.iterdir()):
            if p.is_file() and p.name not in {CONFIG_FILE, WEIGHTS_FILE, *SKIPPED}:
                shutil.copy2(p, written / p.name)
        for p in sorted(written.iterdir()):
            tar.add(p, arcname=p.name, filter=reproducible)
    data = blob.getvalue()
    count, sha = -(-len(data) // PART_BYTES), hashlib.sha256(data).hexdigest()[:12]
    parts_dir.mkdir(parents=True, exist_ok=True)
    for stale in parts_dir.glob(f"drafter_{run.name}_*"):  # an earlier pack of this run: never sent beside this one
        stale.unlink()
    parts = []
    for i in range(count):
        part = parts_dir / f"drafter_{run.name}_{kind}.{sha}.tar.{i:02d}-of-{count:02d}"
        part.write_bytes(data[i * PART_BYTES : (i + 1) * PART_BYTES])
        parts.append(part)
    print(f"{run.name}: {kind} drafter, {len(data) / 2**20:.1f} MiB in {count} parts in {parts_dir}")
    return parts


def send(parts_dir: Path, out: Path, max_parts: int) -> list[Path]:
    """The first `max_parts` parts still in `parts_dir` moved into `out` (what a call brings back)."""
    waiting = sorted(p for p in parts_dir.glob("drafter_*") if PART_NAME.fullmatch(p.name))
    out.mkdir(parents=True, exist_ok=True)
    sent = [Path(shutil.move(p, out / p.name)) for p in waiting[:max_parts]]
    left = waiting[max_parts:]
    print(
        f"sent {len(sent)} parts: {', '.join(p.name for p in sent) or 'none'}"
        + (f"; {len(left)} left in {parts_dir}: run the send_parts step in the next call" if left else "")
    )
    return sent


def unpack(parts_dir: Path, runs: Path) -> list[Path]:
    """Every drafter whose parts are in `parts_dir`, joined and unpacked into its run folder in `runs`:
    RUN/drafter for a final one, else RUN/checkpoints/step-N with `latest` naming it (evaluate tags its
    reports with the step). A drafter already there is left as it is; an incomplete set is an error."""
    drafters: dict[tuple[str, str, str, int], list[Path]] = {}
    for part in sorted(parts_dir.iterdir()):
        if m := PART_NAME.fullmatch(part.name):
            drafters.setdefault((m["run"], m["kind"], m["sha"], int(m["count"])), []).append(part)
    if not drafters:
        sys.exit(f"drafter_parts unpack: no drafter_RUN_KIND.SHA.tar.NN-of-MM in {parts_dir}")
    unpacked = []
    for (name, kind, sha, count), parts in drafters.items():
        stem = f"drafter_{name}_{kind}.{sha}.tar"
        if missing := sorted({f"{i:02d}" for i in range(count)} - {p.name.split(".tar.")[1][:2] for p in parts}):
            sys.exit(f"drafter_parts unpack: {parts_dir}: {stem} lacks parts {', '.join(missing)} of {count:02d}")
        run = runs / name
        target = run / "drafter" if kind == "final" else checkpoint_dir(run) / kind
        if (target / CONFIG_FILE).exists():
            print(f"{name}: {target} is there, left as it is")
            continue
        data = b"".join(p.read_bytes() for p in parts)
        if hashlib.sha256(data).hexdigest()[:12] != sha:
            sys.exit(f"drafter_parts unpack: {stem} from {count} parts: sha256 mismatch (a part cut short or changed?)")
        try:
            with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
                target.mkdir(parents=True, exist_ok=True)
                tar.extractall(target, filter="data")
        except tarfile.TarError as exc:
            sys.exit(f"drafter_parts unpack: {stem} from {count} parts: {exc}")
        if kind != "final":
            (checkpoint_dir(run) / LATEST).write_text(kind)
        print(f"{name}: {kind} drafter unpacked into {target}")
        unpacked.append(target)
    return unpacked


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack")
    p.add_argument("--run", type=Path, required=True, help="the run folder (RUN/NAME of quality_scale train)")
    p.add_argument("--parts", type=Path, required=True, help="the folder to write the parts into")
    s = sub.add_parser("send")
    s.add_argument("--parts", type=Path, required=True, help="the folder pack wrote the parts into")
    s.add_argument("--out", type=Path, required=True, help="the folder a call brings back ($OUT)")
    s.add_argument("--max-parts", type=int, required=True, help="parts to move (15 MiB each)")
    u = sub.add_parser("unpack")
    u.add_argument("--parts", type=Path, required=True, help="the folder holding the parts")
    u.add_argument("--runs", type=Path, required=True, help="the folder of run folders (quality_scale --out)")
    args = ap.parse_args(argv)
    if args.command == "pack":
        pack(args.run, args.parts)
    elif args.command == "send":
        send(args.parts, args.out, args.max_parts)
    else:
        unpack(args.parts, args.runs)


if __name__ == "__main__":
    main()
