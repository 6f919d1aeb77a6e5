"""The one base of every settings object: unknown fields are errors, values are final."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator


class StrictModel(BaseModel):
    """A validated block of settings. A misspelt field is refused, not ignored, and a
    validated object never changes, so it can be handed to another process as it is.

    ``RENAMED``: old key -> new key, for keys this block has renamed; a YAML that still
    writes the old one is refused with the new one's name, not as merely unknown."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    RENAMED: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_renamed_keys(cls, data: Any) -> Any:
        refuse_renamed(cls.RENAMED, data)
        return data


def refuse_renamed(renamed: dict[str, str], data: Any) -> None:
    """Raise, naming the new key, where ``data`` still writes a renamed one. A block whose
    own before-validator reads keys first calls this itself: pydantic runs a subclass's
    before-validators ahead of its base's."""
    old = [key for key in renamed if key in data] if isinstance(data, dict) else []
    if old:
        renames = ", ".join(f"{key!r} is now {renamed[key]!r}" for key in old)
        raise ValueError(f"renamed: {renames}")
