"""The errors a feature store raises; messages are one line naming the store or its file."""

from __future__ import annotations

from dflash_pipeline.shared.runtime.errors import UserError

RESUME_HINT = "rerun the same command to resume from the last committed batch"  # what a store's writer leaves


class StoreError(UserError):
    """Base of the errors a feature store raises."""


class ManifestError(StoreError):
    """The manifest is missing, unreadable, or of an unknown format version."""


class StoreIncomplete(StoreError):
    """The store has not been finished (an extraction is running, crashed, or was interrupted)."""


class StoreMismatch(StoreError):
    """The store was made from another target, layer set or layout than the one asked for."""
