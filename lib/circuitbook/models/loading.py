"""Load TransformerLens `HookedTransformer` checkpoints into the book's `ToyTransformer`.

Toy-model papers release the state dict of a TransformerLens `HookedTransformer`:
`embed.W_E` [d_vocab, d_model], `pos_embed.W_pos` [n_ctx, d_model],
`blocks.{i}.attn.W_Q|W_K|W_V` [n_heads, d_model, d_head], `blocks.{i}.attn.W_O`
[n_heads, d_head, d_model], `blocks.{i}.attn.b_*`, `blocks.{i}.mlp.W_in|W_out|b_in|b_out`,
`blocks.{i}.ln1|ln2.w|b`, `ln_final.w|b`, `unembed.W_U` [d_model, d_vocab_out], `unembed.b_U`,
and the buffers `blocks.{i}.attn.mask` / `IGNORE`. `ToyTransformer` uses the same names and
the same computation (scores scaled by 1/sqrt(d_head), causal mask, pre-norm LayerNorm when
present), so loading is a name-by-name copy with checks:

* buffers TransformerLens keeps (`mask`, `IGNORE`, rotary tables) are dropped;
* a `b_*` bias the config does not have must be zero (a bias-free model with a nonzero
  bias would compute different logits), and likewise a whole MLP that the config leaves
  out (e.g. the layer-1 MLP of a model that only has one in layer 2);
* a bias the config has but the checkpoint lacks is zero;
* every other weight must be present with the config's shape, and nothing may be left over.

Any failing check raises `ValueError` naming the key. Files are read with
`torch.load(..., weights_only=True)` (never unpickling code) or, for `.safetensors`,
with safetensors.
"""
from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path
from typing import Mapping

import torch

from .toy import ToyConfig, ToyTransformer

_DROPPED_BUFFERS = re.compile(r"(^|\.)(mask|IGNORE|rotary_sin|rotary_cos|rotary_dim)$")
_WRAPPERS = ("state_dict", "model_state_dict", "model")
_TL_CONFIG_NAMES = {"normalization_type", "attn_only", "positional_embedding_type"}


def read_state_dict(path_or_state_dict) -> dict[str, torch.Tensor]:
    """A flat {name: tensor} dict from a file path or a (possibly wrapped) mapping.

    Accepts the state dict itself or a dict that wraps it under 'state_dict',
    'model_state_dict' or 'model' (as training scripts often save it).
    """
    if isinstance(path_or_state_dict, (str, Path)):
        path = Path(path_or_state_dict).expanduser()
        if not path.is_file():
            raise ValueError(f"checkpoint {str(path)!r} is not a file")
        obj = _read_checkpoint_file(path)
    else:
        obj = path_or_state_dict
    if not isinstance(obj, Mapping):
        raise ValueError(f"a checkpoint must be a mapping of names to tensors, got {type(obj).__name__}")
    for wrapper in _WRAPPERS:
        inner = obj.get(wrapper)
        if isinstance(inner, Mapping) and "embed.W_E" not in obj:
            obj = inner
            break
    state = {}
    for name, value in obj.items():
        if not torch.is_tensor(value):
            if _DROPPED_BUFFERS.search(str(name)):
                continue
            raise ValueError(f"checkpoint entry {name!r} is a {type(value).__name__}, not a tensor")
        state[str(name)] = value.detach().cpu()
    if "embed.W_E" not in state:
        raise ValueError("checkpoint has no 'embed.W_E': not a TransformerLens HookedTransformer state dict "
                         f"(keys: {sorted(state)[:8]}...)")
    return state


CHECKPOINT_FORMATS = ("a PyTorch state dict saved with torch.save (.pt/.pth), tensors only",
                      "a safetensors file (.safetensors)")


def _read_checkpoint_file(path: Path):
    """The object stored in a checkpoint file; a ValueError naming the path and the formats the book
    reads for anything else (a text file, an empty or truncated file, a damaged safetensors file).
    Never unpickles code: a pickle that holds more than tensors is refused, not loaded."""
    expected = " or ".join(CHECKPOINT_FORMATS)
    if path.stat().st_size == 0:
        raise ValueError(f"checkpoint {str(path)!r} is empty; expected {expected}")
    with open(path, "rb") as f:
        head = f.read(512)
    if not head.startswith((b"PK", b"\x80")) and path.suffix != ".safetensors" and _is_text(head):
        raise ValueError(f"checkpoint {str(path)!r} is a text file, not a checkpoint; expected {expected}")
    head = head[:8]
    try:
        if path.suffix == ".safetensors" or (len(head) == 8 and 0 < int.from_bytes(head, "little") < 100_000_000
                                             and path.suffix not in (".pt", ".pth", ".bin")):
            from safetensors.torch import load

            return load(path.read_bytes())
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - every reader error means the same thing to the user
        kind = type(e).__name__
        if "weights_only" in str(e) or kind == "UnpicklingError":
            why = "it holds objects other than tensors, or is not a PyTorch file at all"
        else:
            why = f"it cannot be read ({kind}: {str(e).splitlines()[0][:120] if str(e) else 'truncated?'})"
        raise ValueError(f"checkpoint {str(path)!r} is not a readable state dict: {why}; expected {expected}") from None


def _is_text(data: bytes) -> bool:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return all(c.isprintable() or c in "\n\r\t" for c in text)


def infer_config(state: Mapping[str, torch.Tensor], **overrides) -> ToyConfig:
    """The ToyConfig a HookedTransformer state dict implies (shapes; nonzero biases; present MLPs).

    act_fn cannot be read from weights (default relu): pass act_fn="gelu" in overrides if needed.
    """
    layers = sorted({int(m.group(1)) for k in state if (m := re.match(r"blocks\.(\d+)\.", k))})
    if not layers or "blocks.0.attn.W_Q" not in state:
        raise ValueError("checkpoint has no 'blocks.0.attn.W_Q'")
    n_heads, d_model, d_head = _as_3d(state["blocks.0.attn.W_Q"], "blocks.0.attn.W_Q").shape
    mlp = tuple(f"blocks.{i}.mlp.W_in" in state and bool(state[f"blocks.{i}.mlp.W_in"].any()) for i in layers)
    d_mlp = next((state[f"blocks.{i}.mlp.W_in"].shape[1] for i in layers if mlp[i]), 0)
    bias = any(k.rsplit(".", 1)[-1].startswith("b_") and bool(v.any()) for k, v in state.items())
    cfg = dict(d_vocab=state["embed.W_E"].shape[0], n_ctx=state["pos_embed.W_pos"].shape[0]
               if "pos_embed.W_pos" in state else 1, d_model=d_model, n_layers=len(layers), n_heads=n_heads,
               d_head=d_head, d_mlp=d_mlp, mlp=mlp if d_mlp else False, d_vocab_out=state["unembed.W_U"].shape[1],
               bias=bias, normalization="LN" if "ln_final.w" in state else None,
               positional="learned" if "pos_embed.W_pos" in state else "none")
    cfg.update(overrides)
    return ToyConfig(**cfg)


def config_from_dict(d: Mapping) -> ToyConfig:
    """A ToyConfig from ToyConfig fields or from HookedTransformerConfig-style fields."""
    d = dict(d)
    if not (_TL_CONFIG_NAMES & set(d)):
        return ToyConfig.from_dict(d)
    norm = d.get("normalization_type")
    if norm not in (None, "LN"):
        raise ValueError(f"normalization_type={norm!r} is not supported; expected None or 'LN'")
    pos = d.get("positional_embedding_type", "standard")
    if pos not in ("standard",):
        raise ValueError(f"positional_embedding_type={pos!r} is not supported; expected 'standard'")
    known = {f.name for f in fields(ToyConfig)}
    out = {k: v for k, v in d.items() if k in known and k not in ("normalization",)}
    out["normalization"] = norm
    out["positional"] = "learned"
    if d.get("attn_only"):
        out["mlp"] = False
    return ToyConfig.from_dict(out)


def _as_3d(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dim() == 2:  # a single head stored without its head axis
        return t.unsqueeze(0)
    if t.dim() != 3:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected [n_heads, ., .]")
    return t


def load_transformer_lens_checkpoint(path_or_state_dict, config: ToyConfig | Mapping | None = None) -> ToyTransformer:
    """A ToyTransformer (eval mode) holding a TransformerLens HookedTransformer's weights.

    path_or_state_dict: a `.pt`/`.pth` file (read with `torch.load(weights_only=True)`), a
    `.safetensors` file, or the state dict itself. config: a ToyConfig, a dict of ToyConfig or
    HookedTransformerConfig fields, or None to infer it from the weights (`infer_config`).
    The model computes the same logits as the HookedTransformer it came from.
    """
    state = read_state_dict(path_or_state_dict)
    if config is None:
        cfg = infer_config(state)
    elif isinstance(config, ToyConfig):
        cfg = config
    elif isinstance(config, Mapping):
        cfg = config_from_dict(config)
    else:
        raise ValueError(f"config must be a ToyConfig, a dict or None, got {type(config).__name__}")
    if cfg.merged_qk or cfg.one_hot_embed or cfg.positional == "relative":
        raise ValueError("a HookedTransformer checkpoint has separate W_Q/W_K, a learned W_E and absolute "
                         "positions; the config asks for merged_qk, one_hot_embed or relative positions")

    model = ToyTransformer(cfg, seed=None)
    target = model.state_dict()
    loaded: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        if _DROPPED_BUFFERS.search(name):
            continue
        if name in target:
            want = target[name].shape
            if name.endswith(("attn.W_Q", "attn.W_K", "attn.W_V", "attn.W_O")) and value.dim() == 2:
                value = value.unsqueeze(0)
            if tuple(value.shape) != tuple(want):
                raise ValueError(f"checkpoint {name} has shape {tuple(value.shape)}; the config expects {tuple(want)}")
            loaded[name] = value.to(target[name].dtype)
            continue
        # Not a parameter of this config: allowed only if it cannot change the output.
        leaf = name.rsplit(".", 1)[-1]
        layer = re.match(r"blocks\.(\d+)\.mlp\.", name)
        if leaf.startswith("b_") or (layer and not cfg.has_mlp(int(layer.group(1)))):
            if value.any():
                what = "biases" if leaf.startswith("b_") else f"an MLP in layer {layer.group(1)}"
                raise ValueError(f"checkpoint {name} is nonzero but the config has no {what} "
                                 f"(bias={cfg.bias}, mlp={cfg.mlp}); the logits would differ")
            continue
        raise ValueError(f"checkpoint has {name!r}, which the config has no place for; "
                         f"parameters: {sorted(target)}")
    missing = [n for n in target if n not in loaded]
    missing_weights = [n for n in missing if not n.rsplit(".", 1)[-1].startswith("b_")]
    if missing_weights:
        raise ValueError(f"checkpoint lacks {missing_weights} required by the config")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(loaded[name] if name in loaded else torch.zeros_like(p))  # absent biases are zero
    return model.eval()


# ---------------------------------------------------------------- a released training run

CHECKPOINT_SUFFIXES = (".pt", ".pth", ".safetensors")
_STEP_IN_NAME = re.compile(r"step[_-]?(\d+)", re.IGNORECASE)


def step_of(name: str) -> int:
    """The training step a checkpoint's file name carries: the number after `step` (`step_5301`,
    `step-5301`, `step5301`, any case; the last one if several), else the only number in the name."""
    stem = Path(name).name
    for suffix in CHECKPOINT_SUFFIXES:
        if stem.endswith(suffix):
            stem = stem[: -len(suffix)]
    tagged = _STEP_IN_NAME.findall(stem)
    if tagged:
        return int(tagged[-1])
    numbers = re.findall(r"\d+", stem)
    if len(numbers) != 1:
        raise ValueError(f"checkpoint file {name!r}: cannot read its step from the name (expected e.g. "
                         f"'checkpoint_step_5301.pth': 'step' and a number, or exactly one number)")
    return int(numbers[0])


def step_checkpoints(directory) -> dict[int, Path]:
    """{step: file} for the checkpoints of a released training run: every `.pt`, `.pth` or
    `.safetensors` file directly in `directory` (other files are ignored), the step read from the
    file name (`step_of`). Two files with the same step, a checkpoint whose name carries no step,
    or a directory without checkpoints is an error naming the directory and the files."""
    path = Path(directory).expanduser()
    if not path.is_dir():
        raise ValueError(f"checkpoint directory {str(path)!r} is not a directory")
    found: dict[int, Path] = {}
    for f in sorted(path.iterdir()):
        if not f.is_file() or not f.name.endswith(CHECKPOINT_SUFFIXES):
            continue
        step = step_of(f.name)
        if step in found:
            raise ValueError(f"checkpoint directory {str(path)!r}: {found[step].name!r} and {f.name!r} both "
                             f"carry step {step}")
        found[step] = f
    if not found:
        raise ValueError(f"checkpoint directory {str(path)!r} holds no {'/'.join(CHECKPOINT_SUFFIXES)} files")
    return dict(sorted(found.items()))
