"""The one base of every settings object: unknown fields are errors, values are final."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """A validated block of settings. A misspelt field is refused, not ignored, and a
    validated object never changes, so it can be handed to another process as it is."""

    model_config = ConfigDict(extra="forbid", frozen=True)
