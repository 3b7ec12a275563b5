"""`--device`, one rule for every CLI: `auto` (the default) is CUDA when there is a CUDA device, else
the CPU; an explicit `cuda` without one is refused rather than quietly run on the CPU; and the
first line each CLI prints says where it runs."""

from __future__ import annotations

import os

import click

from dflash_pipeline.shared.runtime.errors import UserError

DEVICE_HELP = "auto: CUDA when a CUDA device is available, else the CPU."
DEVICE_CHOICES = ("auto", "cuda", "cpu")


def device_option(choices: tuple[str, ...] | None = DEVICE_CHOICES):
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
        raise click.BadParameter(
            f"{device}: no CUDA device is available (use auto or cpu)", param_hint="'--device'"
        ) from exc
    if os.environ.get("RANK", "0") == "0":
        click.echo(f"{cli}: running on {device}" + ("" if has_cuda else " (no CUDA device)"), err=True)
    return device


def resolve_devices(device: str, gpus: tuple[int, ...], default_gpus: int) -> tuple[str, tuple[int, ...]]:
    """The device and GPU ids a run uses: `auto` resolved, on CUDA the first `default_gpus` visible
    GPUs when none are named. Refused (`DeviceUnavailable`): `--gpus` on a run that is on the CPU
    (explicitly, or for want of CUDA), cuda without CUDA, a GPU id that does not exist."""
    import torch

    if gpus and (device == "cpu" or not torch.cuda.is_available()):
        why = "--device cpu" if torch.cuda.is_available() else "no CUDA device"
        raise DeviceUnavailable(f"--gpus {','.join(map(str, gpus))}: this run is on the CPU ({why})")
    device = pick_device(device)
    if device != "cuda":
        return device, ()
    visible = torch.cuda.device_count()
    if not gpus:
        return device, tuple(range(min(default_gpus, visible)))
    if bad := [g for g in gpus if g >= visible]:
        raise DeviceUnavailable(f"--gpus: GPU {bad[0]} does not exist ({visible} visible)")
    return device, tuple(gpus)
