"""Which model class a stored model config builds.

The training loop trains any model whose config is registered here: a frozen
dataclass with `to_dict()`, classmethod `from_dict(d)` and `build(seed)`, whose
module has `forward(tokens, last_only=False) -> logits`, `trainable_names()`
and `init_weights(seed)`, with no data-dependent Python control flow (the
ensemble runs it under `torch.func.vmap`). A run stores its config with the
class name under `kind`, so `Run.model()` rebuilds the right class.

The library's own model classes are listed in `LIBRARY_MODELS` (kind -> module), imported when first
needed: a run's model is rebuilt whatever the notebook imported before (nothing registers itself on
import). `register_model` adds a class from outside the library (a reader's own model).
"""
from __future__ import annotations

from typing import Any

import importlib

_CONFIGS: dict[str, type] = {}
KIND_KEY = "kind"
LIBRARY_MODELS = {"ToyConfig": "circuitbook.models.toy", "OneHotConfig": "circuitbook.models.onehot",
                  "IMIRConfig": "circuitbook.models.imir"}


def register_model(config_cls: type) -> type:
    """Class decorator: make `config_cls` trainable by `circuitbook.train`."""
    for attr in ("to_dict", "from_dict", "build"):
        if not hasattr(config_cls, attr):
            raise TypeError(f"{config_cls.__name__} cannot be registered as a model config: it has no {attr}()")
    _CONFIGS[config_cls.__name__] = config_cls
    return config_cls


def from_known_fields(cls: type, d: dict):
    """`cls(**d)` for a dataclass config, refusing a field it does not have (a config of another version)."""
    from dataclasses import fields

    known = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields {unknown}; allowed: {sorted(known)}")
    return cls(**d)


def config_class(kind: str) -> type | None:
    """The config class stored as `kind`: a library model (imported now) or a registered one; None if neither."""
    if kind in LIBRARY_MODELS:
        return getattr(importlib.import_module(LIBRARY_MODELS[kind]), kind)
    return _CONFIGS.get(kind)


def known_kinds() -> list[str]:
    return sorted({*LIBRARY_MODELS, *_CONFIGS})


def config_to_dict(config: Any) -> dict:
    """The stored form of a model config: its fields plus its class name."""
    kind = type(config).__name__
    if config_class(kind) is not type(config):
        raise TypeError(f"{kind} is not a registered model config; register it with "
                        f"circuitbook.models.register_model (known: {', '.join(known_kinds())})")
    return {KIND_KEY: kind, **config.to_dict()}


def config_from_dict(d: dict) -> Any:
    """Rebuild a model config stored by `config_to_dict` (no `kind`: a ToyConfig of an older run)."""
    d = dict(d)
    kind = d.pop(KIND_KEY, "ToyConfig")
    cls = config_class(kind)
    if cls is None:
        raise ValueError(f"model config kind {kind!r} is not registered; known: {', '.join(known_kinds())}")
    return cls.from_dict(d)
