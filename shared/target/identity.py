"""Which target a store or a drafter belongs to, checked wherever a target is named again.

A target of the same shape with other weights would otherwise pass (speculative decoding stays
lossless, only tau drops), and one of another architecture would fail deep inside the model. Two
values name a target, as the store's manifest records them: the config hash (what the network
computes) and the weights fingerprint (sha256 of the frozen head file the drafter uses, in the
store's dtype). A trained drafter carries them in `target_identity.json` beside its weights.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import PretrainedConfig

from dflash_pipeline.shared.model.config import DFlashConfig
from dflash_pipeline.shared.runtime.durable import write_bytes_durably
from dflash_pipeline.shared.runtime.errors import UserError
from dflash_pipeline.shared.store.layout import StoreLayout
from dflash_pipeline.shared.target.assets import save_target_head
from dflash_pipeline.shared.target.loading import text_config

# Config keys that describe how a checkpoint was saved or run, not what the network computes.
_VOLATILE_CONFIG_KEYS = {
    "_name_or_path",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "use_cache",
    "attn_implementation",
    "_attn_implementation",
    "_attn_implementation_autoset",
    "architectures",
    "output_hidden_states",
    "return_dict",
}

IDENTITY_FILE = "target_identity.json"


class TargetMismatch(UserError):
    """The target named now is not the one the store or drafter was made from."""


@dataclass(frozen=True)
class TargetIdentity:
    name_or_path: str  # as the extraction was given it; for messages only
    config_hash: str
    weights_fingerprint: str
    head_dtype: str  # the dtype the fingerprinted head file holds, e.g. "bfloat16"

    @classmethod
    def of_store(cls, store_root: str | Path, target: dict) -> TargetIdentity:
        """The identity a store's manifest records (`target`: `Manifest.target`)."""
        head = StoreLayout(store_root).target_head
        with safe_open(str(head), framework="pt") as f:
            dtype = str(f.get_slice("embed_tokens.weight").get_dtype())
        return cls(
            str(target.get("name_or_path", "")),
            target["config_hash"],
            target.get("weights_fingerprint", ""),
            {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}.get(dtype, dtype),
        )

    def save(self, folder: str | Path) -> None:
        write_bytes_durably(Path(folder) / IDENTITY_FILE, (json.dumps(asdict(self), indent=1) + "\n").encode())

    @classmethod
    def load(cls, folder: str | Path) -> TargetIdentity | None:
        """The identity saved beside a drafter; None for a drafter from elsewhere (none recorded)."""
        path = Path(folder) / IDENTITY_FILE
        if not path.exists():
            return None
        try:
            return cls(**json.loads(path.read_text()))
        except (ValueError, TypeError) as exc:
            raise TargetMismatch(f"{path}: unreadable target identity ({exc})") from exc


def check_config(identity: TargetIdentity, what: str, target: str, config_hash: str) -> None:
    """Refuse a target whose config differs from the one `what` (a store or drafter path) was made from."""
    if config_hash != identity.config_hash:
        raise TargetMismatch(
            f"{target}: not the target {what} was made from ({identity.name_or_path}): config hash "
            f"{config_hash[:12]} vs {identity.config_hash[:12]}"
        )


def check_weights(identity: TargetIdentity, what: str, target: str, model: nn.Module | None = None) -> None:
    """Refuse a target of the same config but other weights. `model`: the target, if already loaded
    (used when its dtype holds the head dtype exactly); otherwise only its first layer is loaded."""
    from dflash_pipeline.shared.target.loading import load_target_config, load_truncated_target

    if not identity.weights_fingerprint:
        return
    head_dtype = getattr(torch, identity.head_dtype)
    if model is None or next(model.parameters()).dtype not in (head_dtype, torch.float32):
        model = load_truncated_target(target, [0], device=torch.device("cpu"), dtype=head_dtype)
    fingerprint = model_weights_fingerprint(model, load_target_config(target), head_dtype)
    if fingerprint != identity.weights_fingerprint:
        raise TargetMismatch(
            f"{target}: same config but other weights than the target {what} was made from "
            f"({identity.name_or_path}): weights fingerprint {fingerprint[:12]} vs {identity.weights_fingerprint[:12]}"
        )


def check_drafter_fits(drafter: DFlashConfig, drafter_path: str, target: str, target_config: PretrainedConfig) -> None:
    """Refuse a drafter whose shape cannot read this target's hidden states (another architecture or
    size) - the check that still applies to a drafter with no recorded identity."""
    t = text_config(target_config)
    problems = []
    if max(drafter.target_layer_ids) >= t.num_hidden_layers:
        problems.append(f"reads target layers {drafter.target_layer_ids}, the target has {t.num_hidden_layers}")
    if drafter.hidden_size != t.hidden_size:
        problems.append(f"hidden size {drafter.hidden_size}, the target's is {t.hidden_size}")
    if drafter.vocab_size != t.vocab_size:
        problems.append(f"vocabulary {drafter.vocab_size}, the target's is {t.vocab_size}")
    if problems:
        raise TargetMismatch(f"{drafter_path}: made for another target than {target}: " + "; ".join(problems))


def config_hash(config: PretrainedConfig) -> str:
    """A hash of what the target computes: the config minus save/run-time keys."""
    items = {k: v for k, v in text_config(config).to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    blob = json.dumps(items, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def file_sha256(path: Path, chunk: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def weights_fingerprint(root: Path) -> str:
    """Identity of the target's weights as far as the drafter sees them (its frozen head)."""
    return file_sha256(StoreLayout(root).target_head)


def model_weights_fingerprint(model: nn.Module, target_config: PretrainedConfig, dtype: torch.dtype) -> str:
    """`weights_fingerprint` of a loaded target: the same bytes a store made from it holds, in the
    store's head dtype (a cast to a wider dtype and back is exact, so any load dtype works)."""
    with tempfile.TemporaryDirectory() as tmp:
        return file_sha256(save_target_head(model, target_config, Path(tmp) / StoreLayout.HEAD, dtype))
