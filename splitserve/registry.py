"""Name -> class registries: the extension points (replica choice, PD prefill policy,
KV backend, engine backend, workload kind, arrival process).

Adding one is one new file with a class and a ``@REGISTRY.register("name")`` line;
configs name it, and an unknown name is refused with the registered ones listed. The
modules that hold the built-in entries are imported by the registry's owner, so the
built-ins are always there; anything else is imported by whoever registers it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from pydantic import ValidationError

from splitserve.config_base import StrictModel

T = TypeVar("T")


class UnknownNameError(ValueError):
    """A config named something nobody registered."""


_REGISTRIES: dict[str, Registry[Any]] = {}


class Registry(Generic[T]):
    """Classes of one kind by name. ``home``: the module that defines the registry (its
    ``__name__``); ``builtins``: modules whose import registers the entries every
    install has, imported the first time the registry is read."""

    def __init__(self, kind: str, home: str, builtins: tuple[str, ...] = ()) -> None:
        self.kind = kind
        self._home = home
        self._entries: dict[str, T] = {}
        self._builtins = builtins
        self._loaded = not builtins
        _REGISTRIES[kind] = self

    def __reduce__(self) -> tuple[Any, ...]:
        # By reference, never by value: Ray pickles some classes by value (a Serve
        # ingress class among them) with the globals they use, and a copied registry
        # would miss every entry registered in the receiving process.
        return (_registry, (self._home, self.kind))

    def register(self, name: str) -> Callable[[T], T]:
        def add(entry: T) -> T:
            if name in self._entries and self._entries[name] is not entry:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = entry
            return entry

        return add

    def get(self, name: str) -> T:
        self._load_builtins()
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownNameError(
                f"unknown {self.kind} {name!r}; registered: {', '.join(self.names())}"
            ) from None

    def check(self, name: str) -> str:
        """``name`` if registered; for pydantic validators."""
        self.get(name)
        return name

    def names(self) -> list[str]:
        self._load_builtins()
        return sorted(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def _load_builtins(self) -> None:
        if not self._loaded:
            self._loaded = True
            for module in self._builtins:
                importlib.import_module(module)


def _registry(home: str, kind: str) -> Registry[Any]:
    importlib.import_module(home)
    return _REGISTRIES[kind]


def validate_settings(registry: Registry[Any], name: str, raw: Any, where: str) -> StrictModel:
    """``raw`` validated by the ``settings_model`` that entry ``name`` declares; errors
    name each field as ``where.field``."""
    model: type[StrictModel] = registry.get(name).settings_model
    try:
        return model.model_validate(raw or {})
    except ValidationError as error:
        problems = "; ".join(
            f"{where}.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors()
        )
        raise ValueError(problems) from None


def split_named_block(
    data: Any, key: str, default: str, registry: Registry[Any], where: str
) -> Any:
    """A flat YAML block that names an entry under ``key`` beside that entry's own fields
    (``{name: conditional, prompt_length_threshold: 256}``), as ``{key: name, "settings":
    its validated settings model}``; anything else is returned for pydantic to judge."""
    if not isinstance(data, dict) or "settings" in data:
        return data
    fields = dict(data)
    name = fields.pop(key, default)
    if not isinstance(name, str):
        raise ValueError(f"{key} must name a registered {registry.kind}, not {name!r}")
    registry.check(name)
    return {key: name, "settings": validate_settings(registry, name, fields, where)}
