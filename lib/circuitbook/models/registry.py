"""Which model class a stored model config builds.

The training loop trains any model whose config is registered here: a frozen
dataclass with `to_dict()`, classmethod `from_dict(d)` and `build(seed)`, whose
module has `forward(tokens, last_only=False) -> logits`, `trainable_names()`
and `init_weights(seed)`, with no data-dependent Python control flow (the
ensemble runs it under `torch.func.vmap`). A run stores its config with the
class name under `kind`, so `Run.model()` rebuilds the right class.
"""
from __future__ import annotations

from typing import Any

_CONFIGS: dict[str, type] = {}
KIND_KEY = "kind"


def register_model(config_cls: type) -> type:
    """Class decorator: make `config_cls` trainable by `circuitbook.train`."""
    for attr in ("to_dict", "from_dict", "build"):
        if not hasattr(config_cls, attr):
            raise TypeError(f"{config_cls.__name__} cannot be registered as a model config: it has no {attr}()")
    _CONFIGS[config_cls.__name__] = config_cls
    return config_cls


def config_to_dict(config: Any) -> dict:
    """The stored form of a model config: its fields plus its class name."""
    kind = type(config).__name__
    if _CONFIGS.get(kind) is not type(config):
        raise TypeError(f"{kind} is not a registered model config; register it with "
                        f"circuitbook.models.register_model (registered: {', '.join(sorted(_CONFIGS))})")
    return {KIND_KEY: kind, **config.to_dict()}


def config_from_dict(d: dict) -> Any:
    """Rebuild a model config stored by `config_to_dict` (no `kind`: a ToyConfig of an older run)."""
    d = dict(d)
    kind = d.pop(KIND_KEY, "ToyConfig")
    if kind not in _CONFIGS:
        _import_known_models()
    if kind not in _CONFIGS:
        raise ValueError(f"model config kind {kind!r} is not registered; registered: {', '.join(sorted(_CONFIGS))}")
    return _CONFIGS[kind].from_dict(d)


def _import_known_models() -> None:
    """Configs register themselves on import: import the library's model modules."""
    import importlib
    import pkgutil

    from . import __path__ as models_path

    for info in pkgutil.iter_modules(models_path):
        if info.name not in ("registry", "loading", "pretrained"):
            importlib.import_module(f"{__package__}.{info.name}")
