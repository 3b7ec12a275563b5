"""The frozen target pieces the drafter reuses (embedding, LM head, final norm) and their file,
`target_head.safetensors` in a store's `target/` folder, never part of the drafter's weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, safe_open, save_file
from torch import nn

from dflash_pipeline.shared.runtime.errors import UserError
from dflash_pipeline.shared.store.layout import StoreLayout


def sort_safetensors_metadata(file: Path) -> None:
    """Rewrite the header of a safetensors file with its `__metadata__` keys sorted, in place.

    safetensors writes the metadata from a Rust HashMap, in an order that changes from run to run;
    the store's `weights_fingerprint` hashes this file, so identical runs must write identical bytes.
    Tensor entries keep their (deterministic) order; the header keeps its length (space padded).
    """
    with open(file, "r+b") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        if "__metadata__" in header:
            header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        body = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if len(body) > size:
            raise ValueError(f"{file}: sorted safetensors header is longer than the original")
        f.seek(8)
        f.write(body.ljust(size, b" "))


class TargetHeadMissing(UserError, FileNotFoundError):
    """A store's target head file, or a tensor in it, is missing."""


class TargetHead(nn.Module):
    """Frozen target pieces the drafter reuses: input embedding, LM head (may be tied: the same
    tensor), final norm. Buffers, never trained, never saved with the drafter."""

    def __init__(
        self,
        embed_tokens: torch.Tensor,
        lm_head: torch.Tensor | None = None,
        norm: torch.Tensor | None = None,
        norm_eps: float = 1e-6,
    ):
        super().__init__()
        self.tied = lm_head is None or lm_head is embed_tokens
        self.register_buffer("embed_tokens", embed_tokens.detach(), persistent=False)
        self.register_buffer("_untied_lm_head", None if self.tied else lm_head.detach(), persistent=False)
        self.register_buffer("norm_weight", None if norm is None else norm.detach(), persistent=False)
        self.norm_eps = norm_eps

    @property
    def lm_head(self) -> torch.Tensor:
        """LM-head weight [vocab, hidden]; the embedding tensor itself when tied."""
        return self.embed_tokens if self.tied else self._untied_lm_head

    def embed(self, ids: torch.Tensor, scale: float = 1.0, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Block embeddings: target input embedding of `ids` times `input_embedding_scale`."""
        out = F.embedding(ids, self.embed_tokens)
        out = out if dtype is None else out.to(dtype)
        return out * scale if scale != 1.0 else out

    @staticmethod
    def _file(path: str | Path) -> Path:
        path = Path(path)
        return path if path.suffix == ".safetensors" else path / StoreLayout.HEAD

    @staticmethod
    def save(
        path: str | Path,
        *,
        embed_tokens: torch.Tensor,
        lm_head: torch.Tensor | None = None,
        norm: torch.Tensor | None = None,
        norm_eps: float = 1e-6,
        metadata: dict[str, str] | None = None,
    ) -> Path:
        """Write `target_head.safetensors` (path = that file or its folder); `lm_head` None or the
        embedding tensor itself means tied: no `lm_head.weight` key, `tied: true` in metadata."""
        file = TargetHead._file(path)
        file.parent.mkdir(parents=True, exist_ok=True)
        tied = lm_head is None or lm_head is embed_tokens
        tensors = {"embed_tokens.weight": embed_tokens}
        if not tied:
            tensors["lm_head.weight"] = lm_head
        if norm is not None:
            tensors["norm.weight"] = norm
        tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
        meta = {**(metadata or {}), "tied": "true" if tied else "false", "norm_eps": repr(float(norm_eps))}
        save_file(tensors, str(file), metadata=meta)
        sort_safetensors_metadata(file)
        return file

    @classmethod
    def load(
        cls, path: str | Path, *, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
    ) -> TargetHead:
        file = cls._file(path)
        if not file.exists():
            raise TargetHeadMissing(
                f"{file}: target head not found (stage one writes it to the store's target/ folder)"
            )
        with safe_open(str(file), framework="pt") as f:
            meta = f.metadata() or {}
            names = set(f.keys())
        tied = meta.get("tied", "false") == "true"
        need = {"embed_tokens.weight"} | (set() if tied else {"lm_head.weight"})
        if need - names:
            raise TargetHeadMissing(f"{file}: missing {sorted(need - names)} (tied={tied})")
        t = load_file(str(file), device=str(device))
        if dtype is not None:
            t = {k: v.to(dtype) for k, v in t.items()}
        embed = t["embed_tokens.weight"]
        return cls(
            embed, None if tied else t["lm_head.weight"], t.get("norm.weight"), float(meta.get("norm_eps", 1e-6))
        )
