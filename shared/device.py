"""`--device`, one rule for every CLI: `auto` (the default) is CUDA when there is a CUDA device, else
the CPU; an explicit `cuda` without one is refused rather than quietly run on the CPU; and the
first line each CLI prints says where it runs."""

from __future__ import annotations

import os

import click

from dflash_pipeline.shared.errors import UserError

DEVICE_HELP = "auto: CUDA when a CUDA device is available, else the CPU."


def device_option(choices: tuple[str, ...] | None = ("auto", "cuda", "cpu")):
    """The `--device` option; `choices=None` also takes an indexed device such as cuda:1."""
    return click.option("--device", type=click.Choice(choices) if choices else str, default="auto", help=DEVICE_HELP)


class DeviceUnavailable(UserError):
    """A CUDA device was asked for on a machine without one."""


def pick_device(device: str) -> str:
    """`auto` -> cuda or cpu; an explicit cuda without CUDA is refused, never quietly the CPU (the
    rule for library callers too: the configs' default is `auto`)."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise DeviceUnavailable(f"device {device}: no CUDA device is available (use auto or cpu)")
    return device


def resolve_device(cli: str, device: str) -> str:
    """The device to run on; says so on stderr (once under torchrun: rank 0)."""
    import torch

    has_cuda = torch.cuda.is_available()
    try:
        device = pick_device(device)
    except DeviceUnavailable as exc:
        raise click.BadParameter(f"{device}: no CUDA device is available (use auto or cpu)", param_hint="'--device'") from exc
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
