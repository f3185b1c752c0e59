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
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Mapping

import numpy as np
import torch

from .toy import ToyConfig, ToyTransformer

_DROPPED_BUFFERS = re.compile(r"(^|\.)(mask|IGNORE|rotary_sin|rotary_cos|rotary_dim)$")
_WRAPPERS = ("state_dict", "model_state_dict", "model")
_TL_CONFIG_NAMES = {"normalization_type", "attn_only", "positional_embedding_type"}


def read_state_dict(path_or_state_dict, mmap: bool = False) -> dict[str, torch.Tensor]:
    """A flat {name: tensor} dict from a file path or a (possibly wrapped) mapping.

    Accepts the state dict itself or a dict that wraps it under 'state_dict',
    'model_state_dict' or 'model' (as training scripts often save it). mmap: map a PyTorch
    file's tensors instead of reading them (for their shapes; formats that cannot be mapped are read).
    """
    if isinstance(path_or_state_dict, (str, Path)):
        path = Path(path_or_state_dict).expanduser()
        if not path.is_file():
            raise ValueError(f"checkpoint {str(path)!r} is not a file")
        obj = _read_checkpoint_file(path, mmap)
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


def _read_checkpoint_file(path: Path, mmap: bool = False):
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
        if mmap:
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # a legacy (non-zip) file cannot be mapped: read it
                pass
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
    """{step: file} for the checkpoints of a released training run, the final model included
    (`read_release`)."""
    return read_release(directory).files


@dataclass(frozen=True)
class Release:
    """A released training run read from a folder (`read_release`).

    files: {step: file} in step order, the final model last; final: the step-less final model file
    (None when the folder holds step files only: the last of them is then the final model);
    final_step: the step the final model is placed at; n_step_files: files that carry a step.
    """

    path: Path
    files: dict
    final: Path | None
    final_step: int
    n_step_files: int
    final_step_source: str = ""  # how final_step was found (`final_model_step`)

    @property
    def name(self) -> str:
        return self.path.name

    def describe(self) -> str:
        """What the folder holds, for a reader: the step files and where the final model sits."""
        steps = [s for s, f in self.files.items() if f != self.final]
        text = f"{self.n_step_files} step checkpoints (steps {steps[0]}-{steps[-1]})" if steps else "no step checkpoints"
        if self.final is None:
            return text + f"; the last, step {self.final_step}, is the final model"
        if self.final_step in steps:
            return text + f" and the final model {self.final.name} (equal to step {self.final_step})"
        return text + f" and the final model {self.final.name} (placed at step {self.final_step}, " \
                      f"{self.final_step_source})"


# Keys of a training config beside the checkpoints (JSON or YAML, any depth) that give the run's step count.
STEP_COUNT_KEYS = ("steps", "num_steps", "n_steps", "max_steps", "total_steps", "train_steps", "training_steps",
                   "num_train_steps")


def _step_counts(data, found: dict, where: str = "") -> None:
    if isinstance(data, dict):
        for k, v in data.items():
            if k in STEP_COUNT_KEYS and isinstance(v, int) and not isinstance(v, bool):
                found.setdefault(k, v)
            _step_counts(v, found)
    elif isinstance(data, list):
        for v in data:
            _step_counts(v, found)


def final_model_step(step_files, directory) -> tuple[int, str]:
    """(step, how it was found) of a release's final model, which carries no step in its name.

    Read from a training config beside the checkpoints where one says it: a `.json`, `.yaml` or `.yml` file
    with one of `STEP_COUNT_KEYS` (at any depth; several files or keys must agree, and the step must come
    after the last step file). Otherwise assumed: the first multiple of the checkpoint interval (the most
    common spacing of the step files) after the last step file, since a run that checkpoints every k steps
    trains a multiple of k (the authors' 1, 101, ..., 39,901 ends at 40,000)."""
    import json

    import yaml

    steps = sorted(int(s) for s in step_files)
    last = steps[-1]
    said = {}
    for f in sorted(Path(directory).iterdir()):
        if not f.is_file() or f.suffix not in (".json", ".yaml", ".yml"):
            continue
        try:
            data = json.loads(f.read_text()) if f.suffix == ".json" else yaml.safe_load(f.read_text())
        except (ValueError, yaml.YAMLError, UnicodeDecodeError):
            continue  # not a config of ours to read
        keys: dict = {}
        _step_counts(data, keys)
        for k, v in keys.items():
            said[(f.name, k)] = v
    if said:
        values = set(said.values())
        if len(values) > 1:
            raise ValueError(f"checkpoint directory {str(directory)!r}: its configs disagree on the run's step count ("
                             + ", ".join(f"{n} {k} {v}" for (n, k), v in said.items()) + ")")
        (name, key), value = next(iter(said.items()))
        if value <= last:
            raise ValueError(f"checkpoint directory {str(directory)!r}: {name} says {key} {value}, which is not after "
                             f"the last step file {last}, so it cannot place the final model")
        return value, f"read from {name} ({key})"
    gaps = np.diff(steps) if len(steps) > 1 else np.array([1])
    values, counts = np.unique(gaps, return_counts=True)
    interval = int(values[counts.argmax()])
    return (last // interval + 1) * interval, (f"assumed: the first multiple of the checkpoint interval ({interval}) "
                                               "after the last step file")


def read_release(directory) -> Release:
    """The checkpoints of a released training run: every `.pt`, `.pth` or `.safetensors` file directly
    in `directory` (other files are ignored).

    A file whose name carries a step (`step_of`) is a checkpoint at that step. One file whose name
    carries no number at all (`model_state_dict.pth`, `final.pt`) is the final model: the last
    checkpoint, at the step a training config beside it gives, else at the first multiple of the
    checkpoint interval after the last step file, said to be assumed (`final_model_step`) - or at that
    step file's step, when it holds the same tensors. Refused, naming the directory
    and the files: two files at one step, two step-less files, a name with several numbers and no
    `step`, a folder without step files, a checkpoint's name on something that is not a regular file (a
    folder, a FIFO, a symlink loop), and files of different configurations (`check_same_shapes`: every
    checkpoint of one run has the same parameters and shapes)."""
    path = Path(directory).expanduser()
    if not path.is_dir():
        raise ValueError(f"checkpoint directory {str(path)!r} is not a directory")
    found: dict[int, Path] = {}
    final: Path | None = None
    for f in sorted(path.iterdir()):
        if not f.name.endswith(CHECKPOINT_SUFFIXES):
            continue
        _check_checkpoint_file(path, f)
        if not re.search(r"\d", f.name):
            if final is not None:
                raise ValueError(f"checkpoint directory {str(path)!r}: {final.name!r} and {f.name!r} both carry no "
                                 f"step, so neither can be told to be the final model; name the others with their step "
                                 f"(e.g. checkpoint_step_5301.pth)")
            final = f
            continue
        step = step_of(f.name)
        if step in found:
            raise ValueError(f"checkpoint directory {str(path)!r}: {found[step].name!r} and {f.name!r} both "
                             f"carry step {step}")
        found[step] = f
    if not found:
        if final is not None:
            raise ValueError(f"checkpoint directory {str(path)!r} holds no step checkpoints, only the final model "
                             f"{final.name!r}: one model has no training history; pass the file itself")
        raise ValueError(f"checkpoint directory {str(path)!r} holds no {'/'.join(CHECKPOINT_SUFFIXES)} files")
    found = dict(sorted(found.items()))
    check_same_shapes(path, [*found.values(), *([final] if final else [])])
    n_step_files, last = len(found), max(found)
    final_step, source = last, "the last step file"
    if final is not None:
        if _same_tensors(final, found[last]):
            found[last], source = final, f"equal to step file {last}"
        else:
            final_step, source = final_model_step(found, path)
            found[final_step] = final
    return Release(path, found, final, final_step, n_step_files, source)


def _check_checkpoint_file(directory: Path, f: Path) -> None:
    """A file named as a checkpoint must be one (a regular file, or a link to one): a folder, a FIFO, a
    device or a symlink loop under a checkpoint's name is refused, naming it, never silently dropped (the
    release would then read as if it had fewer checkpoints)."""
    import errno
    import stat

    try:
        mode = f.stat().st_mode
    except OSError as e:
        what = "is a symlink loop" if e.errno == errno.ELOOP else f"cannot be read ({e.strerror or e})"
        raise ValueError(f"checkpoint directory {str(directory)!r}: {f.name!r} {what}; a checkpoint is a regular "
                         f"file") from None
    if stat.S_ISDIR(mode):
        raise ValueError(f"checkpoint directory {str(directory)!r}: {f.name!r} is a folder, not a checkpoint file; "
                         "a release's checkpoints are files directly in its folder")
    if not stat.S_ISREG(mode):
        raise ValueError(f"checkpoint directory {str(directory)!r}: {f.name!r} is not a regular file (a FIFO, a "
                         "device or a socket); a checkpoint is a regular file")


def state_dict_shapes(path: Path) -> dict[str, tuple]:
    """{name: shape} of a checkpoint file's tensors (buffers TransformerLens keeps left out), read
    without loading the tensors where the format allows."""
    state = read_state_dict(path, mmap=True)
    return {k: tuple(v.shape) for k, v in state.items() if not _DROPPED_BUFFERS.search(k)}


def check_same_shapes(directory: Path, files: list[Path]) -> None:
    """Every file holds the same parameters with the same shapes, or a ValueError naming the odd
    file(s), the first parameter that differs and its shape in the other files."""
    shapes = {f: state_dict_shapes(f) for f in files}
    groups: dict[tuple, list[Path]] = {}
    for f, s in shapes.items():
        groups.setdefault(tuple(sorted(s.items())), []).append(f)
    if len(groups) == 1:
        return
    common = max(groups.values(), key=len)  # the configuration most files share
    ref = shapes[common[0]]
    odd = [f for f in files if f not in common]
    lines = []
    for f in odd[:5]:
        s = shapes[f]
        key = next(k for k in [*ref, *s] if s.get(k) != ref.get(k))  # in the file's own order
        lines.append(f"{f.name} has {key} {_shape(s.get(key))}, the other {len(common)} files {_shape(ref.get(key))}")
    more = f" (and {len(odd) - 5} more files)" if len(odd) > 5 else ""
    raise ValueError(f"checkpoint directory {str(directory)!r}: every checkpoint of one run must have the same "
                     f"configuration, but " + "; ".join(lines) + more)


def _shape(shape) -> str:
    return "(absent)" if shape is None else "[" + ", ".join(map(str, shape)) + "]"


def _same_tensors(a: Path, b: Path) -> bool:
    sa, sb = read_state_dict(a), read_state_dict(b)
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
