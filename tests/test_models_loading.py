"""load_transformer_lens_checkpoint: hand-built HookedTransformer state dicts give identical logits."""
import math

import pytest
import torch

import circuitbook as cb
from circuitbook.models import load_transformer_lens_checkpoint
from circuitbook.models.loading import config_from_dict, infer_config, read_state_dict

PAPER = cb.ToyConfig(d_vocab=74, n_ctx=16, d_model=32, n_layers=2, n_heads=1, d_mlp=64, mlp=(False, True),
                     bias=False, d_vocab_out=59)


def tl_state_dict(n_layers=2, d_vocab=74, d_vocab_out=59, n_ctx=16, d_model=32, n_heads=1, d_head=32, d_mlp=64,
                  mlp_layers=(0, 1), zero_mlp_layers=(), bias_scale=0.0, ln=False, seed=0):
    """What HookedTransformer.state_dict() holds, built by hand (TransformerLens names and shapes)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) / math.sqrt(d_model)
    sd = {"embed.W_E": r(d_vocab, d_model), "pos_embed.W_pos": r(n_ctx, d_model),
          "unembed.W_U": r(d_model, d_vocab_out), "unembed.b_U": bias_scale * r(d_vocab_out)}
    for i in range(n_layers):
        p = f"blocks.{i}."
        sd.update({p + "attn.W_Q": r(n_heads, d_model, d_head), p + "attn.W_K": r(n_heads, d_model, d_head),
                   p + "attn.W_V": r(n_heads, d_model, d_head), p + "attn.W_O": r(n_heads, d_head, d_model),
                   p + "attn.b_Q": bias_scale * r(n_heads, d_head), p + "attn.b_K": bias_scale * r(n_heads, d_head),
                   p + "attn.b_V": bias_scale * r(n_heads, d_head), p + "attn.b_O": bias_scale * r(d_model),
                   p + "attn.mask": torch.tril(torch.ones(n_ctx, n_ctx, dtype=torch.bool)),
                   p + "attn.IGNORE": torch.tensor(-1e5)})
        if i in mlp_layers:
            z = 0.0 if i in zero_mlp_layers else 1.0
            sd.update({p + "mlp.W_in": z * r(d_model, d_mlp), p + "mlp.b_in": z * bias_scale * r(d_mlp),
                       p + "mlp.W_out": z * r(d_mlp, d_model), p + "mlp.b_out": z * bias_scale * r(d_model)})
        if ln:
            for name in ("ln1", "ln2"):
                sd[p + f"{name}.w"] = 1 + 0.1 * r(d_model)
                sd[p + f"{name}.b"] = 0.1 * r(d_model)
    if ln:
        sd["ln_final.w"], sd["ln_final.b"] = 1 + 0.1 * r(d_model), 0.1 * r(d_model)
    return sd


def reference_logits(sd, tokens, n_layers=2, ln=False):
    """HookedTransformer's forward, written out independently from the state dict."""
    def layer_norm(x, w, b):
        x = x - x.mean(-1, keepdim=True)
        return x / (x.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * w + b

    T = tokens.shape[1]
    x = sd["embed.W_E"][tokens] + sd["pos_embed.W_pos"][:T]
    for i in range(n_layers):
        p = f"blocks.{i}."
        h = layer_norm(x, sd[p + "ln1.w"], sd[p + "ln1.b"]) if ln else x
        q = torch.einsum("btd,hde->bthe", h, sd[p + "attn.W_Q"]) + sd[p + "attn.b_Q"]
        k = torch.einsum("btd,hde->bthe", h, sd[p + "attn.W_K"]) + sd[p + "attn.b_K"]
        v = torch.einsum("btd,hde->bthe", h, sd[p + "attn.W_V"]) + sd[p + "attn.b_V"]
        scores = torch.einsum("bqhe,bkhe->bhqk", q, k) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~torch.tril(torch.ones(T, T, dtype=torch.bool)), float("-inf"))
        z = torch.einsum("bhqk,bkhe->bqhe", scores.softmax(-1), v)
        x = x + torch.einsum("bqhe,hed->bqd", z, sd[p + "attn.W_O"]) + sd[p + "attn.b_O"]
        if p + "mlp.W_in" in sd:
            h = layer_norm(x, sd[p + "ln2.w"], sd[p + "ln2.b"]) if ln else x
            x = x + torch.relu(h @ sd[p + "mlp.W_in"] + sd[p + "mlp.b_in"]) @ sd[p + "mlp.W_out"] + sd[p + "mlp.b_out"]
    if ln:
        x = layer_norm(x, sd["ln_final.w"], sd["ln_final.b"])
    return x @ sd["unembed.W_U"] + sd["unembed.b_U"]


TOKENS = torch.randint(0, 74, (8, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("zero_layer0_mlp_present", [False, True])
def test_paper_config_identical_logits(zero_layer0_mlp_present):
    # the paper's model: no biases (zero b_* in the checkpoint), no layer-1 MLP
    sd = tl_state_dict(mlp_layers=(0, 1) if zero_layer0_mlp_present else (1,), zero_mlp_layers=(0,))
    model = load_transformer_lens_checkpoint(sd, PAPER)
    assert isinstance(model, cb.ToyTransformer) and not model.training
    torch.testing.assert_close(model(TOKENS), reference_logits(sd, TOKENS), rtol=1e-5, atol=1e-5)


def test_biases_and_layernorm_identical_logits():
    sd = tl_state_dict(bias_scale=1.0, ln=True)
    cfg = cb.ToyConfig(d_vocab=74, n_ctx=16, d_model=32, n_layers=2, n_heads=1, d_mlp=64, d_vocab_out=59,
                       bias=True, normalization="LN")
    model = load_transformer_lens_checkpoint(sd, cfg)
    torch.testing.assert_close(model(TOKENS), reference_logits(sd, TOKENS, ln=True), rtol=1e-5, atol=1e-5)


def test_multi_head_and_inferred_config(tmp_path):
    sd = tl_state_dict(n_heads=4, d_head=8, mlp_layers=(1,), bias_scale=0.5)
    cfg = infer_config(read_state_dict(sd))
    assert (cfg.n_heads, cfg.head_dim, cfg.d_mlp, cfg.mlp, cfg.bias, cfg.d_vocab_out) == (4, 8, 64, (False, True), True, 59)
    path = tmp_path / "ckpt.pt"
    torch.save({"state_dict": sd}, path)  # wrapped, read with weights_only=True
    model = load_transformer_lens_checkpoint(path, None)
    torch.testing.assert_close(model(TOKENS), reference_logits(sd, TOKENS), rtol=1e-5, atol=1e-5)


def test_safetensors_file_and_tl_style_config(tmp_path):
    from safetensors.torch import save_file

    sd = tl_state_dict(mlp_layers=(0, 1))
    path = tmp_path / "ckpt.safetensors"
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    tl_cfg = {"n_layers": 2, "d_model": 32, "d_head": 32, "n_heads": 1, "d_mlp": 64, "d_vocab": 74,
              "d_vocab_out": 59, "n_ctx": 16, "act_fn": "relu", "normalization_type": None, "attn_only": False,
              "positional_embedding_type": "standard", "bias": False}
    assert config_from_dict(tl_cfg).mlp is True
    model = load_transformer_lens_checkpoint(path, tl_cfg)
    torch.testing.assert_close(model(TOKENS), reference_logits(sd, TOKENS), rtol=1e-5, atol=1e-5)


def test_refuses_what_would_change_the_logits():
    with pytest.raises(ValueError, match=r"b_\w+ is nonzero"):
        load_transformer_lens_checkpoint(tl_state_dict(mlp_layers=(1,), bias_scale=1.0), PAPER)
    with pytest.raises(ValueError, match="MLP in layer 0"):
        load_transformer_lens_checkpoint(tl_state_dict(mlp_layers=(0, 1)), PAPER)
    bad = tl_state_dict(mlp_layers=(1,))
    bad["embed.W_E"] = bad["embed.W_E"][:, :16]
    with pytest.raises(ValueError, match="embed.W_E has shape"):
        load_transformer_lens_checkpoint(bad, PAPER)
    missing = tl_state_dict(mlp_layers=(1,))
    del missing["blocks.1.attn.W_K"]
    with pytest.raises(ValueError, match="lacks"):
        load_transformer_lens_checkpoint(missing, PAPER)
    with pytest.raises(ValueError, match="not a file"):
        load_transformer_lens_checkpoint("/nonexistent/ckpt.pt", PAPER)
    with pytest.raises(ValueError, match="no 'embed.W_E'"):
        load_transformer_lens_checkpoint({"foo": torch.zeros(1)}, PAPER)


# ---------------------------------------------------------------- a directory of step checkpoints

@pytest.mark.parametrize("name, step", [("checkpoint_step_5301.pth", 5301), ("model_seed42_step-900.pt", 900),
                                        ("STEP12.safetensors", 12), ("ckpt_700.pth", 700),
                                        ("run3_step_10_step_20.pt", 20)])
def test_step_of_reads_the_step_from_the_name(name, step):
    from circuitbook.models.loading import step_of

    assert step_of(name) == step


def test_step_of_refuses_a_name_without_one_step():
    from circuitbook.models.loading import step_of

    for name in ("final.pth", "seed42_epoch3.pt"):
        with pytest.raises(ValueError, match=f"checkpoint file '{name}': cannot read its step"):
            step_of(name)


def test_step_checkpoints_of_a_released_run(tmp_path):
    from circuitbook.models.loading import step_checkpoints

    for step in (5301, 0, 100):
        torch.save(tl_state_dict(mlp_layers=(1,), seed=step), tmp_path / f"checkpoint_step_{step}.pth")
    (tmp_path / "config.json").write_text("{}")  # other files are ignored
    (tmp_path / "sub").mkdir()
    found = step_checkpoints(tmp_path)
    assert list(found) == [0, 100, 5301] and found[100].name == "checkpoint_step_100.pth"
    model = load_transformer_lens_checkpoint(found[5301], PAPER)
    torch.testing.assert_close(model(TOKENS), reference_logits(tl_state_dict(mlp_layers=(1,), seed=5301), TOKENS),
                               rtol=1e-5, atol=1e-5)


def test_step_checkpoints_refuses_ambiguous_directories(tmp_path):
    from circuitbook.models.loading import step_checkpoints

    with pytest.raises(ValueError, match="is not a directory"):
        step_checkpoints(tmp_path / "missing")
    with pytest.raises(ValueError, match="holds no .pt/.pth/.safetensors files"):
        step_checkpoints(tmp_path)
    (tmp_path / "checkpoint_step_100.pth").write_bytes(b"")
    (tmp_path / "model_step-100.pt").write_bytes(b"")
    with pytest.raises(ValueError, match="'checkpoint_step_100.pth' and 'model_step-100.pt' both carry step 100"):
        step_checkpoints(tmp_path)


def test_a_release_folder_holds_its_final_model_as_the_last_checkpoint(tmp_path):
    """The authors' layout: step files plus `model_state_dict.pth` (no step), the final model. It is the run's
    last checkpoint, at the first multiple of the checkpoint interval after the last step file (a run of 400
    steps checkpointed at 1, 101, ..., 301 ends at 400, not 401), said to be assumed; unless it is that file."""
    from circuitbook.models.loading import read_release, step_checkpoints

    for step in (1, 101, 201, 301):
        torch.save(tl_state_dict(mlp_layers=(1,), seed=step), tmp_path / f"checkpoint_step_{step}.pth")
    torch.save(tl_state_dict(mlp_layers=(1,), seed=7), tmp_path / "model_state_dict.pth")
    found = step_checkpoints(tmp_path)
    assert list(found) == [1, 101, 201, 301, 400] and found[400].name == "model_state_dict.pth"
    release = read_release(tmp_path)
    assert release.final == tmp_path / "model_state_dict.pth" and release.final_step == 400
    assert release.n_step_files == 4 and "model_state_dict.pth" in release.describe()
    assert "steps 1-301" in release.describe() and "placed at step 400, assumed" in release.describe()
    # a final model equal to the last step file is that checkpoint, not a step of its own
    torch.save(tl_state_dict(mlp_layers=(1,), seed=301), tmp_path / "model_state_dict.pth")
    again = read_release(tmp_path)
    assert list(again.files) == [1, 101, 201, 301] and again.final_step == 301
    assert again.files[301].name == "model_state_dict.pth"
    # step files alone: the last one is the final model
    (tmp_path / "model_state_dict.pth").unlink()
    assert read_release(tmp_path).final is None and read_release(tmp_path).final_step == 301


def test_a_release_folder_refuses_what_it_cannot_order(tmp_path):
    from circuitbook.models.loading import step_checkpoints

    torch.save(tl_state_dict(mlp_layers=(1,), seed=0), tmp_path / "model_state_dict.pth")
    with pytest.raises(ValueError, match="holds no step checkpoints, only the final model 'model_state_dict.pth'"):
        step_checkpoints(tmp_path)
    torch.save(tl_state_dict(mlp_layers=(1,), seed=0), tmp_path / "checkpoint_step_5.pth")
    torch.save(tl_state_dict(mlp_layers=(1,), seed=1), tmp_path / "final.pt")
    with pytest.raises(ValueError, match="'final.pt' and 'model_state_dict.pth' both carry no step"):
        step_checkpoints(tmp_path)


def test_the_final_models_step_is_read_from_the_release_where_it_says_it(tmp_path):
    """The authors' run trained 40,000 steps and checkpointed at 1, 101, ..., 39,901: the final model is at
    40,000 (issue 37: it was placed at 40,001). A training config beside the checkpoints gives the step; else
    it is the first multiple of the interval after the last step file, said to be assumed."""
    import json

    from circuitbook.models.loading import final_model_step, read_release

    assert final_model_step([1, 101, 39901], tmp_path) == (40000, "assumed: the first multiple of the checkpoint "
                                                            "interval (100) after the last step file")
    assert final_model_step([0, 100, 39900], tmp_path)[0] == 40000
    assert final_model_step([5], tmp_path)[0] == 6  # one step file: an interval of 1
    (tmp_path / "training_config.json").write_text(json.dumps({"optim": {"lr": 1e-3}, "num_steps": 40000}))
    assert final_model_step([1, 101, 39901], tmp_path) == (40000, "read from training_config.json (num_steps)")
    (tmp_path / "training_config.json").write_text(json.dumps({"max_steps": 35000}))
    assert final_model_step([1, 101, 201], tmp_path) == (35000, "read from training_config.json (max_steps)")
    # a config step that is not after the last step file is not the final model's: refused by name
    with pytest.raises(ValueError, match="training_config.json.*max_steps 35000.*not after the last step file 39901"):
        final_model_step([1, 39901], tmp_path)
    (tmp_path / "training_config.json").write_text(json.dumps({"steps": 400, "total_steps": 500}))
    with pytest.raises(ValueError, match="disagree"):
        final_model_step([1, 101], tmp_path)
    (tmp_path / "training_config.json").unlink()
    for step in (1, 101, 201, 301):
        torch.save(tl_state_dict(mlp_layers=(1,), seed=step), tmp_path / f"checkpoint_step_{step}.pth")
    torch.save(tl_state_dict(mlp_layers=(1,), seed=7), tmp_path / "model_state_dict.pth")
    (tmp_path / "config.json").write_text(json.dumps({"n_steps": 350}))
    release = read_release(tmp_path)
    assert release.final_step == 350 and "placed at step 350, read from config.json (n_steps)" in release.describe()
