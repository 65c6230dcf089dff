"""The errors a user's configuration raises (before any collective), each naming the key and the fix."""

from __future__ import annotations

__all__ = ["MissingFileError", "SeqParConfigError"]


class SeqParConfigError(ValueError):
    """A ``sequence_parallel`` setting is invalid; the message names the key and a fix."""


class MissingFileError(SeqParConfigError, FileNotFoundError):
    """A path the user gave (config, data, checkpoint) does not exist; the message names it and the fix."""
