"""`--device`, one rule for every CLI: `auto` (the default) is CUDA when there is a CUDA device, else
the CPU; an explicit `cuda` without one is refused rather than quietly run on the CPU; and the
first line each CLI prints says where it runs."""

from __future__ import annotations

import os

import click

DEVICE_HELP = "auto: CUDA when a CUDA device is available, else the CPU."


def device_option(choices: tuple[str, ...] | None = ("auto", "cuda", "cpu")):
    """The `--device` option; `choices=None` also takes an indexed device such as cuda:1."""
    return click.option("--device", type=click.Choice(choices) if choices else str, default="auto", help=DEVICE_HELP)


def resolve_device(cli: str, device: str) -> str:
    """The device to run on; says so on stderr (once under torchrun: rank 0)."""
    import torch

    has_cuda = torch.cuda.is_available()
    if device == "auto":
        device = "cuda" if has_cuda else "cpu"
    elif device.startswith("cuda") and not has_cuda:
        raise click.BadParameter(f"{device}: no CUDA device is available (use auto or cpu)", param_hint="'--device'")
    if os.environ.get("RANK", "0") == "0":
        click.echo(f"{cli}: running on {device}" + ("" if has_cuda else " (no CUDA device)"), err=True)
    return device


def gpus_on_cpu(gpus: tuple[int, ...], device: str) -> str | None:
    """Why `--gpus` cannot apply when the run is on the CPU (explicitly, or for want of CUDA); None if it can."""
    import torch

    if not gpus or (device != "cpu" and torch.cuda.is_available()):
        return None
    why = "--device cpu" if torch.cuda.is_available() else "no CUDA device"
    return f"--gpus {','.join(map(str, gpus))}: this run is on the CPU ({why})"
