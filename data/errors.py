"""The one exception type for bad input data, shared by every reader and the tokenizer."""

from __future__ import annotations

from dflash_pipeline.shared.runtime.errors import UserError


class DataError(UserError, ValueError):
    """A record or file that cannot be used, with a one-line message naming file and line/record.

    `reason` is a short code (e.g. ``"bad_json"``, ``"unknown_role"``) so that callers running with
    ``skip_bad`` can count skipped records per cause instead of dropping them silently.
    """

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(" ".join(message.split("\n")))
        self.reason = reason


class TokenizerError(UserError, ValueError):
    """The target's tokenizer cannot render the data (e.g. conversations but no chat template)."""
