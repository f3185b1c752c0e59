"""Profiles and parameters: what a notebook runs with, validated before compute.

Each chapter folder (and `book/` for the tour) has a `profiles.yml`:

    parameters:            # every knob: type, allowed range, help
      steps: {type: int, min: 1, help: training steps}
    defaults: {...}        # values shared by all profiles
    smoke: {...}           # CI: seconds per notebook
    cpu: {...}             # a laptop CPU
    full: {...}            # the paper's scale, one GPU
    notebooks:
      02_training:
        needs: [01_task]   # notebooks whose runs this one reads (build order, cache keys); another
                           # chapter's as assign_add/02_training
        parameters: {...}  # knobs only this notebook has
        defaults: {...}
        smoke: {...}       # per-notebook, per-profile values
        estimate_s: {smoke: 10, cpu: 600, full: 3600}
        paper: {...}       # the paper's values of this notebook's knobs
        deviations: {cpu: [...]}
        runs_on: cpu       # needs no GPU and reads local files that cannot travel (pretrained weights):
                           # a GPU visit leaves it to a CPU machine (default `any`: wherever the build runs)
    paper: {...}           # the paper's value of each knob it fixes
    deviations:            # what differs from the paper and is not a knob's value
      cpu: ["samples are windows, not whole stories"]
    release:               # optional: the notebooks can evaluate a released training run
      parameter: checkpoint_path   # the path parameter they read it from (`circuitbook release`)
      history: [02_training]       # notebooks that need a folder of checkpoints, not one file
      training: [steps, lr]        # knobs of the book's own training: not shown on a release's rows

Values resolve defaults -> profile -> notebook defaults -> notebook profile ->
overrides. Every error names the parameter and what is allowed. A profile's
deviations from the paper (`deviations()`) are every knob whose value differs
from `paper` plus the `deviations` texts: generated, shown on the scorecard and
the chapter page.
"""
from __future__ import annotations

import copy
import difflib
import hashlib
import math
import os
import stat
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from .runs import repo_root

PROFILES = ("smoke", "cpu", "full")
SCALAR_TYPES = {"int": int, "float": float, "bool": bool, "str": str, "path": str}
TYPES = tuple(SCALAR_TYPES) + tuple(f"list[{t}]" for t in ("int", "float", "str"))
SPEC_KEYS = {"type", "min", "max", "choices", "nullable", "help", "env"}
TOP_SECTIONS = {"parameters", "defaults", "notebooks", "paper", "deviations", "release", *PROFILES}
RELEASE_KEYS = {"parameter", "history", "training"}
NOTEBOOK_SECTIONS = {"needs", "parameters", "defaults", "estimate_s", "paper", "deviations", "resources", "runs_on",
                     *PROFILES}
RUNS_ON = {"any": "wherever the build runs",
           "cpu": "needs no GPU and reads local files that cannot travel to a GPU machine: a GPU visit leaves it "
                  "to a CPU machine"}
INT_LIMIT = 2 ** 63  # what torch and numpy take as an integer (seeds, sizes)
BOOK_PSEUDO_CHAPTER = "book"  # the tour and other book-level notebooks


class ParameterError(ValueError):
    """A parameter, profile, chapter or notebook that is not allowed."""


def _suggest(name: str, allowed) -> str:
    close = difflib.get_close_matches(name, list(allowed), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def chapters() -> list[str]:
    """Chapter slugs: folders of chapters/ with a profiles.yml, plus 'book'."""
    root = repo_root()
    found = sorted(p.parent.name for p in (root / "chapters").glob("*/profiles.yml"))
    return [BOOK_PSEUDO_CHAPTER] + found if (root / "book" / "profiles.yml").exists() else found


def chapter_dir(chapter: str) -> Path:
    known = chapters()
    if chapter not in known:
        raise ParameterError(f"unknown chapter {chapter!r}{_suggest(chapter, known)}; chapters: {', '.join(known)}")
    root = repo_root()
    return root / "book" if chapter == BOOK_PSEUDO_CHAPTER else root / "chapters" / chapter


def notebooks(chapter: str) -> list[str]:
    return sorted(p.stem for p in chapter_dir(chapter).glob("*.ipynb"))


def check_profile(profile: str) -> str:
    if profile not in PROFILES:
        raise ParameterError(f"unknown profile {profile!r}{_suggest(str(profile), PROFILES)}; "
                             f"profiles: {', '.join(PROFILES)}")
    return profile


class _StrictLoader(yaml.SafeLoader):
    """safe_load that refuses duplicate keys (PyYAML silently keeps the last one)."""


def _no_duplicates(loader, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicates)


def load_yaml(path: Path):
    """Parse a YAML file; any syntax error or duplicate key is a ParameterError naming the file. Parsed
    once per content (PyYAML takes ~0.1 s for a chapter's profiles.yml, read hundreds of times per build)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ParameterError(f"{path}: cannot be read ({e.strerror or e})") from None
    return copy.deepcopy(_parse_yaml(text, str(path)))


@lru_cache(maxsize=128)
def _parse_yaml(text: str, path: str):
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as e:
        raise ParameterError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None


def _mapping(value, where: str, what: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ParameterError(f"{where}: {what} must be a mapping, got {type(value).__name__} ({value!r:.60})")
    return value


def load_profiles(chapter: str) -> dict:
    path = chapter_dir(chapter) / "profiles.yml"
    data = _mapping(load_yaml(path), str(path), "the file")
    extra = set(data) - TOP_SECTIONS
    if extra:
        raise ParameterError(f"{path}: unknown sections {sorted(extra)}; allowed: {sorted(TOP_SECTIONS)}")
    for section in ("parameters", "defaults", "notebooks", "paper", "deviations", *PROFILES):
        _mapping(data.get(section), str(path), f"section {section!r}")
    _check_deviations(data.get("deviations"), f"{path}: deviations")
    _check_release(data.get("release"), f"{path}: release")
    for name, nb in (data.get("notebooks") or {}).items():
        nb = _mapping(nb, str(path), f"notebooks.{name}")
        extra = set(nb) - NOTEBOOK_SECTIONS
        if extra:
            raise ParameterError(f"{path}: notebooks.{name} has unknown keys {sorted(extra)}; "
                                 f"allowed: {sorted(NOTEBOOK_SECTIONS)}")
        for section in ("parameters", "defaults", "estimate_s", "paper", "deviations", "resources", *PROFILES):
            _mapping(nb.get(section), str(path), f"notebooks.{name}.{section}")
        if not isinstance(nb.get("needs") or [], list):
            raise ParameterError(f"{path}: notebooks.{name}.needs must be a list of notebook names")
        _check_deviations(nb.get("deviations"), f"{path}: notebooks.{name}.deviations")
        _check_resources(nb.get("resources"), f"{path}: notebooks.{name}.resources")
        if not isinstance(nb.get("runs_on", "any"), str) or nb.get("runs_on", "any") not in RUNS_ON:
            raise ParameterError(f"{path}: notebooks.{name}.runs_on is {nb['runs_on']!r}; allowed: 'any' "
                                 f"({RUNS_ON['any']}) or 'cpu' ({RUNS_ON['cpu']})")
    return data


RESOURCE_KEYS = {"num_cpus": 0.0, "num_gpus": 0.0, "memory_gb": 0.0}  # name -> exclusive lower bound (cpus > 0)
DEFAULT_RESOURCES = {"num_cpus": 1}


def _check_resources(res, where: str) -> None:
    """`resources:` is {num_cpus, num_gpus, memory_gb} for every profile, or {PROFILE: {...}} per profile."""
    if not res:
        return
    per_profile = set(res) <= set(PROFILES)
    for profile, mapping in (res.items() if per_profile else [(None, res)]):
        at = f"{where}.{profile}" if profile else where
        if not isinstance(mapping, dict) or not mapping:
            raise ParameterError(f"{at} must be a mapping of {sorted(RESOURCE_KEYS)} (or of profiles to one)")
        for key, value in mapping.items():
            if key not in RESOURCE_KEYS:
                raise ParameterError(f"{at}: unknown resource {key!r}{_suggest(str(key), RESOURCE_KEYS)}; resources: "
                                     f"{', '.join(sorted(RESOURCE_KEYS))}; or a mapping per profile ({', '.join(PROFILES)})")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 \
                    or (key == "num_cpus" and value == 0):
                raise ParameterError(f"{at}: {key} must be a finite number >= 0 (num_cpus > 0), got {value!r}")


def resources(chapter: str, notebook: str, profile: str) -> dict:
    """What one execution of the notebook (and each part of its runs) asks a Ray cluster for at `profile`."""
    res = _notebook_section(load_profiles(chapter), chapter, notebook).get("resources") or {}
    if res and set(res) <= set(PROFILES):
        res = res.get(profile) or {}
    return {**DEFAULT_RESOURCES, **res}


def runs_on(chapter: str, notebook: str) -> str:
    """Where the notebook executes: 'any' (wherever the build runs) or 'cpu' (it needs no GPU and reads local
    files that cannot travel, such as pretrained weights installed here: a GPU visit leaves it to a CPU machine)."""
    return _notebook_section(load_profiles(chapter), chapter, notebook).get("runs_on", "any")


def _check_release(release, where: str) -> None:
    """`release:` is {parameter: NAME, history: [notebooks], training: [parameters]} (names checked
    against the chapter by `release_spec`)."""
    if release is None:
        return
    if not isinstance(release, dict) or set(release) - RELEASE_KEYS or not isinstance(release.get("parameter"), str):
        raise ParameterError(f"{where} must be a mapping with 'parameter' (a parameter name) and optionally "
                             f"'history' and 'training' (lists of names); got {release!r:.80}")
    for key in ("history", "training"):
        if not isinstance(release.get(key) or [], list) or not all(isinstance(v, str) for v in release.get(key) or []):
            raise ParameterError(f"{where}.{key} must be a list of names")


def release_spec(chapter: str) -> dict | None:
    """The chapter's `release:` section with its names checked, or None when no notebook of it reads
    a released run: {parameter, notebooks (those that have the parameter, in name order), history,
    training}."""
    data = load_profiles(chapter)
    release = data.get("release")
    if release is None:
        return None
    where = f"{chapter}/profiles.yml release"
    readers = [nb for nb in notebooks(chapter) if release["parameter"] in specs(chapter, nb)]
    if not readers:
        raise ParameterError(f"{where}: no notebook has the parameter {release['parameter']!r}")
    history = list(release.get("history") or [])
    if set(history) - set(readers):
        raise ParameterError(f"{where}.history: {sorted(set(history) - set(readers))} are not notebooks that read "
                             f"{release['parameter']!r} ({', '.join(readers)})")
    known = set().union(*(specs(chapter, nb) for nb in readers))
    training = list(release.get("training") or [])
    if set(training) - known:
        raise ParameterError(f"{where}.training: {sorted(set(training) - known)} are not parameters"
                             f"{_suggest(sorted(set(training) - known)[0], known)}")
    return {"parameter": release["parameter"], "notebooks": readers, "history": history, "training": training}


def _check_deviations(devs, where: str) -> None:
    for profile, texts in (devs or {}).items():
        if profile not in PROFILES:
            raise ParameterError(f"{where}: {profile!r} is not a profile; profiles: {', '.join(PROFILES)}")
        if not isinstance(texts, list) or not all(isinstance(t, str) and t.strip() for t in texts):
            raise ParameterError(f"{where}.{profile} must be a list of non-empty strings")


@dataclass(frozen=True)
class ParamSpec:
    name: str
    type: str
    min: float | None = None
    max: float | None = None
    choices: tuple | None = None
    nullable: bool = False
    help: str = ""
    env: str | None = None  # a path parameter whose null means "the file this environment variable names"

    @classmethod
    def parse(cls, name: str, raw: dict, where: str) -> "ParamSpec":
        if not isinstance(raw, dict) or "type" not in raw:
            raise ParameterError(f"{where}: parameter {name!r} needs a mapping with a 'type'")
        if set(raw) - SPEC_KEYS:
            raise ParameterError(f"{where}: parameter {name!r} has unknown keys {sorted(set(raw) - SPEC_KEYS)}")
        if raw["type"] not in TYPES:
            raise ParameterError(f"{where}: parameter {name!r} has type {raw['type']!r}; types: {', '.join(TYPES)}")
        for bound in ("min", "max"):
            v = raw.get(bound)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
                raise ParameterError(f"{where}: parameter {name!r} has {bound} {v!r}; it must be a finite number")
        if raw.get("choices") is not None and not isinstance(raw["choices"], list):
            raise ParameterError(f"{where}: parameter {name!r} has choices {raw['choices']!r}; it must be a list")
        if not isinstance(raw.get("help", ""), str) or not isinstance(raw.get("nullable", False), bool):
            raise ParameterError(f"{where}: parameter {name!r}: help must be a string and nullable true or false")
        env = raw.get("env")
        if env is not None and (raw["type"] != "path" or not raw.get("nullable") or not isinstance(env, str)
                                or not env.isidentifier()):
            raise ParameterError(f"{where}: parameter {name!r} has env {env!r}; env names the environment variable "
                                 "a nullable path parameter falls back to (e.g. CIRCUITBOOK_TINYSTORIES)")
        choices = tuple(raw["choices"]) if raw.get("choices") is not None else None
        return cls(name, raw["type"], raw.get("min"), raw.get("max"), choices, bool(raw.get("nullable")),
                   raw.get("help", ""), env)

    def allowed(self) -> str:
        """Human-readable description of the allowed values."""
        base = self.type
        if self.choices is not None:
            base += " in {" + ", ".join(map(repr, self.choices)) + "}"
        elif self.min is not None or self.max is not None:
            lo = "-inf" if self.min is None else self.min
            hi = "inf" if self.max is None else self.max
            base += f" in [{lo}, {hi}]" + (" (each element)" if self.type.startswith("list") else "")
        return base + (" or null" if self.nullable else "")

    def validate(self, value: Any, where: str) -> Any:
        """Return the value coerced to the declared type, or raise ParameterError."""
        def fail():
            return ParameterError(f"{where}: parameter {self.name!r} must be {self.allowed()}, "
                                  f"got {value!r} ({type(value).__name__}){_why_not(value)}")

        if value is None:
            if self.nullable:
                return None
            raise fail()
        if self.type.startswith("list["):
            if not isinstance(value, (list, tuple)) or not value:
                raise fail()
            elem = self.type[5:-1]
            try:
                return [self._scalar(v, elem) for v in value]
            except ValueError:
                raise fail() from None
        try:
            return self._scalar(value, self.type)
        except ValueError:
            raise fail() from None

    def _scalar(self, v: Any, kind: str) -> Any:
        if kind == "bool":
            if not isinstance(v, bool):
                raise ValueError
            return v
        if kind == "int":
            if isinstance(v, bool) or not (isinstance(v, int) or (isinstance(v, float) and v.is_integer())):
                raise ValueError
            v = int(v)
            if not -INT_LIMIT < v < INT_LIMIT:  # beyond int64: torch and numpy would fail inside the kernel
                raise ValueError
        elif kind == "float":
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError  # NaN and infinities pass every range check, so refuse them here
            v = float(v)
        elif not isinstance(v, str):
            raise ValueError
        if self.choices is not None and v not in self.choices:
            raise ValueError
        if kind in ("int", "float"):
            if (self.min is not None and v < self.min) or (self.max is not None and v > self.max):
                raise ValueError
        return v


def _why_not(value) -> str:
    """What makes a number unusable although it may look in range."""
    values = value if isinstance(value, (list, tuple)) else [value]
    if any(isinstance(v, float) and not math.isfinite(v) for v in values):
        return "; NaN and infinities are never allowed"
    if any(isinstance(v, int) and not isinstance(v, bool) and not -INT_LIMIT < v < INT_LIMIT for v in values):
        return "; integers must fit in 64 bits"
    return ""


class Params(dict):
    """Resolved parameters of one notebook: a dict with attribute access."""

    def __init__(self, values: dict, *, chapter: str, notebook: str, profile: str, overrides: dict):
        super().__init__(values)
        self.chapter, self.notebook, self.profile, self.overrides = chapter, notebook, profile, overrides

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"no parameter {name!r}; parameters: {', '.join(sorted(self))}") from None


def specs(chapter: str, notebook: str | None = None) -> dict[str, ParamSpec]:
    data = load_profiles(chapter)
    where = f"{chapter}/profiles.yml"
    out = {n: ParamSpec.parse(n, raw, where) for n, raw in (data.get("parameters") or {}).items()}
    if notebook is not None:
        nb = _notebook_section(data, chapter, notebook)
        out.update({n: ParamSpec.parse(n, raw, where) for n, raw in (nb.get("parameters") or {}).items()})
    return out


def _notebook_section(data: dict, chapter: str, notebook: str) -> dict:
    known = notebooks(chapter)
    if notebook not in known:
        raise ParameterError(f"unknown notebook {notebook!r} in chapter {chapter!r}{_suggest(notebook, known)}; "
                             f"notebooks: {', '.join(known) or '(none)'}")
    return (data.get("notebooks") or {}).get(notebook) or {}


def needs(chapter: str, notebook: str) -> list[str]:
    """The notebooks whose runs this one reads, as `chapter/notebook` labels: `needs:` names a notebook of
    the same chapter (`02_training`) or of another (`assign_add/02_training`)."""
    out = []
    for need in _notebook_section(load_profiles(chapter), chapter, notebook).get("needs") or []:
        other, _, name = str(need).rpartition("/")
        other = other or chapter
        where = f"{chapter}/profiles.yml: notebooks.{notebook}.needs"
        if other not in chapters():
            raise ParameterError(f"{where}: {need!r} names chapter {other!r}, which is not a chapter; chapters: "
                                 f"{', '.join(chapters())}")
        if name not in notebooks(other):
            raise ParameterError(f"{where}: {need!r} is not a notebook of chapter {other!r}; notebooks: "
                                 f"{', '.join(notebooks(other))}")
        out.append(f"{other}/{name}")
    return out


def paper_values(chapter: str, notebook: str) -> dict:
    """The paper's value of each knob it fixes (chapter `paper:`, then the notebook's), validated."""
    data = load_profiles(chapter)
    spec = specs(chapter, notebook)
    where = f"{chapter}/profiles.yml paper"
    out = {}
    for name, value in {**(data.get("paper") or {}), **(_notebook_section(data, chapter, notebook).get("paper") or {})}.items():
        if name not in spec:
            raise ParameterError(f"{where}: {name!r} is not a parameter{_suggest(name, spec)}; "
                                 f"parameters: {', '.join(sorted(spec))}")
        out[name] = spec[name].validate(value, where)
    return out


def deviations(chapter: str, notebook: str, profile: str, overrides: dict | None = None,
               release: bool = False) -> list[str]:
    """How `profile` differs from the paper for this notebook: every knob whose value is not the
    paper's (`name = value (paper: value)`), then the profile's `deviations` texts.

    release: the notebook evaluated a released run, not the book's own: the knobs of the book's
    training (the chapter's `release.training`) and the deviation texts, which describe that
    training, do not apply; the knobs of the evaluation (pool sizes, pair split, ...) still do."""
    data = load_profiles(chapter)
    values = resolve(chapter, notebook, profile, overrides)
    skip = set((release_spec(chapter) or {}).get("training", [])) if release else set()
    out = [f"{name} = {_show(values[name])} (paper: {_show(paper)})"
           for name, paper in paper_values(chapter, notebook).items() if values.get(name) != paper and name not in skip]
    if release:
        return out
    texts = list((data.get("deviations") or {}).get(profile) or [])
    texts += list((_notebook_section(data, chapter, notebook).get("deviations") or {}).get(profile) or [])
    return out + texts


def _show(value) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]" if len(value) <= 8 else \
            f"[{_show(value[0])}, ..., {_show(value[-1])}] ({len(value)} values)"
    return str(value)


def estimate_seconds(chapter: str, notebook: str, profile: str) -> float | None:
    est = _notebook_section(load_profiles(chapter), chapter, notebook).get("estimate_s") or {}
    return est.get(profile)


def resolve(chapter: str, notebook: str, profile: str, overrides: dict | None = None) -> Params:
    """The validated parameters of `chapter/notebook` at `profile` with `overrides`."""
    check_profile(profile)
    data = load_profiles(chapter)
    nb = _notebook_section(data, chapter, notebook)
    spec = specs(chapter, notebook)
    where = f"{chapter}/{notebook} [{profile}]"
    layers = [("defaults", data.get("defaults")), (profile, data.get(profile)),
              (f"notebooks.{notebook}.defaults", nb.get("defaults")), (f"notebooks.{notebook}.{profile}", nb.get(profile)),
              ("overrides", overrides)]
    values: dict[str, Any] = {}
    for layer, mapping in layers:
        for name, value in (mapping or {}).items():
            if name not in spec:
                raise ParameterError(f"{where}: unknown parameter {name!r} (from {layer}){_suggest(name, spec)}; "
                                     f"parameters: {', '.join(sorted(spec))}")
            source = "the overrides" if layer == "overrides" else f"{chapter}/profiles.yml {layer}"
            values[name] = spec[name].validate(value, f"{where}, value from {source}")
            if layer == "overrides" and spec[name].type == "path" and values[name] is not None:
                _check_path(name, values[name], where)
    missing = [n for n, s in spec.items() if n not in values and not s.nullable]
    if missing:
        raise ParameterError(f"{where}: parameters {missing} have no value in profiles.yml")
    for n, s in spec.items():
        values.setdefault(n, None)
    return Params(values, chapter=chapter, notebook=notebook, profile=profile, overrides=dict(overrides or {}))


def _check_path(name: str, value: str, where: str) -> None:
    """A path a user passes must exist (a file or a folder) and be one the book reads (`readable_files`), so a
    typo or a path outside the limits fails before the kernel starts."""
    path = Path(value).expanduser()
    if not path.exists():
        raise ParameterError(f"{where}: parameter {name!r} is {value!r}, which does not exist "
                             f"(give an existing file or folder)")
    try:
        readable_files(path)
    except ParameterError as e:
        raise ParameterError(f"{where}: parameter {name!r}: {e}") from None


def file_inputs(chapter: str, notebook: str, values: dict) -> dict[str, str]:
    """The content digests of the files and folders a notebook's parameters name: {label: digest}.

    A `path` parameter, a `str` parameter whose value is an existing file or folder (e.g. a
    pair_split file), and a null path parameter with `env:` (the file that environment variable
    names, labelled `name ($VAR)`) enter a notebook's inputs by content and size, never by name: a
    file edited or replaced after a run makes its results stale, the same file elsewhere does not.
    """
    out = {}
    for name, spec in specs(chapter, notebook).items():
        if spec.type not in ("path", "str"):
            continue
        value, label = values.get(name), name
        if value is None and spec.env and os.environ.get(spec.env):
            value, label = os.environ[spec.env], f"{name} (${spec.env})"
        if isinstance(value, str) and value and _names_file(spec, value):
            out[label] = content_digest(Path(value))
    return out


def absolute_paths(chapter: str, notebook: str, overrides: dict) -> dict:
    """Overrides with every path they name made absolute (relative to the caller's folder), so the
    kernel, which runs in the notebook's folder, reads the file the caller meant."""
    spec = specs(chapter, notebook)
    out = dict(overrides)
    for name, value in overrides.items():
        if name in spec and spec[name].type in ("path", "str") and isinstance(value, str) and value \
                and _names_file(spec[name], value):
            out[name] = str(Path(value).expanduser().resolve())
    return out


def _names_file(spec, value: str) -> bool:
    """Whether a parameter's value names a file to read: a `path` parameter always; a `str` one (e.g.
    pair_split: 'authors', 'book' or a file of pairs) when the value is an existing file, never a folder
    (a word such as 'book' is not the book's folder of the caller's current directory)."""
    return spec.type == "path" or Path(value).expanduser().is_file()


MAX_FOLDER_ENTRIES = 20_000  # a folder a parameter names is read only up to these limits
MAX_FOLDER_BYTES = 20 * 2 ** 30
NOT_DATA = ("/proc", "/sys", "/dev")  # the kernel's and the devices' files: never data
_LIMITS = (f"a file a parameter names is read only when it is a regular file, or a folder of at most "
           f"{MAX_FOLDER_ENTRIES:,} entries and {MAX_FOLDER_BYTES // 2 ** 30} GiB of regular files, outside "
           f"{', '.join(NOT_DATA)}")


def _refuse(what: str):
    raise ParameterError(f"{what}; it is not read ({_LIMITS})")


def readable_files(path: Path) -> list[tuple[tuple, Path]] | None:
    """[(relative name parts, file)] of what a parameter naming `path` may read, checked before anything is
    read or hashed: None if it does not exist; a ParameterError for the whole filesystem, a path under
    /proc, /sys or /dev, a device, FIFO or socket (there or inside a folder), a symlink loop, or a folder of
    more than MAX_FOLDER_ENTRIES entries or MAX_FOLDER_BYTES. Links to folders inside a folder are not
    followed (as before)."""
    path = Path(path).expanduser()
    try:
        real = path.resolve(strict=True)
    except FileNotFoundError:
        return None
    except (RuntimeError, OSError) as e:  # Python raises RuntimeError (3.11) or OSError ELOOP for a loop
        if isinstance(e, RuntimeError) or getattr(e, "errno", None) == 40:
            _refuse(f"{path} is a symlink loop")
        _refuse(f"{path} cannot be read ({getattr(e, 'strerror', None) or e})")
    if real == Path(real.anchor):
        _refuse(f"{path} is the whole filesystem")
    for root in NOT_DATA:
        if real == Path(root) or Path(root) in real.parents:
            _refuse(f"{path} is under {root}, whose files are the system's, not data")
    mode = real.stat().st_mode
    if stat.S_ISREG(mode):
        return [((), real)]
    if not stat.S_ISDIR(mode):
        _refuse(f"{path} is not a regular file or folder (a device, a FIFO or a socket)")
    return _folder_files(path, real)


def _folder_files(path: Path, real: Path) -> list[tuple[tuple, Path]]:
    files, entries, size, todo = [], 0, 0, [((), real)]
    while todo:
        rel, folder = todo.pop()
        with os.scandir(folder) as it:
            for entry in it:
                entries += 1
                if entries > MAX_FOLDER_ENTRIES:
                    _refuse(f"{path} is a folder of more than {MAX_FOLDER_ENTRIES:,} entries")
                name = (*rel, entry.name)
                try:
                    st = os.stat(entry.path)  # a link: what it points at
                except OSError as e:
                    if getattr(e, "errno", None) == 40:
                        _refuse(f"{entry.path} is a symlink loop")
                    continue  # a dangling link: nothing to read (as before)
                if stat.S_ISDIR(st.st_mode):
                    if not entry.is_symlink():
                        todo.append((name, Path(entry.path)))
                elif stat.S_ISREG(st.st_mode):
                    if entry.is_symlink():
                        readable_files(Path(entry.path))  # where it points is checked too
                    size += st.st_size
                    if size > MAX_FOLDER_BYTES:
                        _refuse(f"{path} is a folder of more than {MAX_FOLDER_BYTES // 2 ** 30} GiB")
                    files.append((name, Path(entry.path)))
                else:
                    _refuse(f"{entry.path} is not a regular file (a device, a FIFO or a socket)")
    return sorted(files)


def content_digest(path: Path) -> str:
    """`sha256:<hex>:<bytes>` of a file, or of a folder's files (relative names and contents);
    `missing` for a path that does not exist. Nothing is read before `readable_files` allows it."""
    files = readable_files(path)
    if files is None:
        return "missing"
    if files and files[0][0] == ():
        return _file_digest(files[0][1])
    h, size = hashlib.sha256(), 0
    for name, f in files:
        digest = _file_digest(f)
        h.update(f"{'/'.join(name)}\0{digest}\n".encode())
        size += int(digest.rsplit(":", 1)[1])
    return f"sha256:{h.hexdigest()}:{size}"


_digests: dict[tuple, str] = {}


def _file_digest(path: Path) -> str:
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    if key not in _digests:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        _digests[key] = f"sha256:{h.hexdigest()}:{st.st_size}"
    return _digests[key]


def table(chapter: str, notebook: str | None = None) -> list[dict]:
    """Every parameter with its type, range, help and value per profile."""
    nbs = [notebook] if notebook else [None]
    rows = []
    for nb in nbs:
        spec = specs(chapter, nb)
        per_profile = {}
        for profile in PROFILES:
            if nb is None:
                data = load_profiles(chapter)
                vals = {**(data.get("defaults") or {}), **(data.get(profile) or {})}
            else:
                vals = resolve(chapter, nb, profile)
            per_profile[profile] = vals
        for name, s in spec.items():
            rows.append({"name": name, "type": s.type, "allowed": s.allowed(), "help": s.help,
                         **{p: per_profile[p].get(name) for p in PROFILES}})
    return rows
