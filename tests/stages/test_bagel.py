"""BAGEL's backbone (stages/models/modules/bagel.py) against the published modeling code.

The fixture tests/fixtures/bagel_tiny.safetensors was made outside this repository with
ByteDance-Seed/Bagel at commit 056b5fd (modeling/bagel/bagel.py, qwen2_navit.py, data/data_utils.py),
run unchanged on CPU in fp32 with transformers 4.49.0 (its pinned version) and a stub `flash_attn`
module (only its inference path calls flash_attn_varlen_func; this is its train path). The script:
a tiny `Qwen2Config` (vocab 64, hidden 32, intermediate 48, 2 layers, 4 heads, 2 kv heads,
qk_norm, layer_module Qwen2MoTDecoderLayer, rope_theta 1e4) in their `Qwen2ForCausalLM`, wrapped
in their `Bagel` (visual_gen, no ViT, z_channels 4, latent_patch_size 2, max_latent_size 8);
torch.manual_seed(0), then every parameter but the latent position table drawn N(0, 0.3) (norms
1 + N(0, 0.1)); one sample of 5 text tokens (causal), a 2x3-patch noisy latent x_t = (1-t) x0 +
t noise at t = 0.37 (split mode `noise`), 3 more text tokens; positions 0-4, 5 for every patch,
6-8; the sequence embedded as `Bagel.forward` does (embed_tokens; vae2llm + time_embedder +
latent_pos_embed), then `language_model.forward_train` with `create_sparse_mask`'s flex-attention
block mask; saved: the state dict (their names, `weights/...`), the inputs, the last hidden
states, `lm_head` on the text tokens and `llm2vae` on the latent tokens.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from unirl.stages.models.modules.bagel import (
    AutoencoderGeometry,
    BagelBackbone,
    BagelGeometry,
    Split,
    attention_mask,
    autoencoder,
    decode_latents,
    encode_latents,
    llm_config,
    load_folder,
    save_folder,
)

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "bagel_tiny.safetensors"
LLM = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 128,
       "qk_norm": True, "layer_module": "Qwen2MoTDecoderLayer", "tie_word_embeddings": False}


def test_text_logits_and_the_latent_velocity_match_the_published_code():
    saved = load_file(str(FIXTURE))
    model = BagelBackbone(llm_config(LLM), BagelGeometry(latent_patch_size=2, max_latent_size=8, latent_channels=4)).eval()
    weights = {k.removeprefix("weights/"): v for k, v in saved.items() if k.startswith("weights/")}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all("rotary_emb" in k for k in missing), (missing, unexpected)  # released names, all of them
    # the fixed latent position table is ours, computed: it equals the published one
    torch.testing.assert_close(model.latent_pos_embed.pos_embed, weights["latent_pos_embed.pos_embed"])

    text = torch.cat([saved["in/text_a"], saved["in/text_b"]])
    with torch.no_grad():
        tokens = model.language_model.model.embed_tokens(text)
        latents = model.embed_latents(saved["in/xt"], saved["in/t"], rows=2, cols=3)
        embeds = torch.cat([tokens[:5], latents, tokens[5:]])[None]
        gen = torch.zeros(1, 14, dtype=torch.bool)
        gen[0, 5:11] = True
        positions = torch.tensor([[0, 1, 2, 3, 4, 5, 5, 5, 5, 5, 5, 6, 7, 8]])
        mask = attention_mask([Split(5, "causal"), Split(6, "noise"), Split(3, "causal")])[None]
        hidden = model(embeds, gen, positions, mask)[0]
    torch.testing.assert_close(hidden, saved["out/hidden"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.text_logits(hidden[~gen[0]]), saved["out/logits"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.velocity(hidden[gen[0]]), saved["out/velocity"], rtol=1e-5, atol=1e-5)


def test_the_attention_pattern():
    """Text is causal; a noisy image sees itself whole and what came before it, and nothing else sees it."""
    m = attention_mask([Split(2, "causal"), Split(2, "noise"), Split(1, "causal"), Split(2, "full")], total=9)
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0, 0],  # the noisy image: whole, and the text before it
        [1, 1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 0, 0],  # text after it does not see it
        [1, 1, 0, 0, 1, 1, 1, 0, 0],  # a clean (full) image: whole, and all before it but the noise
        [1, 1, 0, 0, 1, 1, 1, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 1, 0],  # padding: itself alone
        [0, 0, 0, 0, 0, 0, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(m, expected)


def seeded_state(shapes: dict[str, list[int]], base: int) -> dict[str, torch.Tensor]:
    """A fixture's weights, drawn as its script drew them: tensor i of the sorted names from a
    generator seeded base + i; norm weights 1 + 0.1 N, other vectors 0.1 N, matrices N / sqrt(fan-in)."""
    out = {}
    for i, (name, shape) in enumerate(sorted(shapes.items())):
        w = torch.randn(shape, generator=torch.Generator().manual_seed(base + i))
        if len(shape) == 1 and "norm" in name:
            w = 1.0 + 0.1 * w if name.endswith("weight") else 0.1 * w
        elif len(shape) == 1:
            w = 0.1 * w
        else:
            w = w / torch.tensor(shape[1:]).prod().float().sqrt()
        out[name] = w
    return out


def test_the_vae_round_trip_matches_the_published_autoencoder():
    """tests/fixtures/bagel_vae_tiny.safetensors: BAGEL's modeling/autoencoder.py (FLUX.1's AE) at
    056b5fd, `AutoEncoder(AutoEncoderParams(resolution=16, in_channels=3, downsample=4, ch=32,
    out_ch=3, ch_mult=[1, 2], num_res_blocks=1, z_channels=4, scale_factor=0.3611,
    shift_factor=0.1159))`, weights `seeded_state(.., 1000)` of its state dict's names and shapes
    (stored in the file's metadata), `reg.sample = False`, an image drawn U(-1, 1) from
    torch.Generator().manual_seed(7); saved: `encode(x)` and `decode(encode(x))`, CPU fp32."""

    path = str(FIXTURE.with_name("bagel_vae_tiny.safetensors"))
    with safe_open(path, "pt") as f:
        shapes = json.loads(f.metadata()["shapes"])
    saved = load_file(path)
    vae = autoencoder(seeded_state(shapes, 1000), AutoencoderGeometry(ch=32, ch_mult=(1, 2), num_res_blocks=1, z_channels=4)).eval()
    with torch.no_grad():
        z = encode_latents(vae, saved["in/image"])
        torch.testing.assert_close(z, saved["out/latent"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(decode_latents(vae, z), saved["out/decoded"], rtol=1e-5, atol=1e-5)


def test_understanding_images_match_the_published_vit_and_connector():
    """tests/fixtures/bagel_vit_tiny.safetensors: BAGEL's SigLIP NaViT (modeling/bagel/siglip_navit.py
    at 056b5fd, `SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, image_size=8, patch_size=2, rope=False)`, its patch embedding converted to
    linear as the released checkpoints are) and `MLPconnector(32, 48, "gelu_pytorch_tanh")`,
    weights `seeded_state(.., 2000)`; two images (3x4x6, 3x8x4, U(-1, 1)
    from manual_seed(9)) packed with `patchify` and `get_flattened_position_ids_extrapolate` (side
    4); flash_attn_varlen_func stubbed by exact per-image attention and the bf16 casts before it
    dropped (the only patch). Saved: the ViT's last hidden states and connector + vit_pos_embed."""

    path = str(FIXTURE.with_name("bagel_vit_tiny.safetensors"))
    with safe_open(path, "pt") as f:
        shapes = json.loads(f.metadata()["shapes"])
    saved = load_file(path)
    vit = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": 8,
           "patch_size": 2, "layer_norm_eps": 1e-6, "rope": False}
    model = BagelBackbone(llm_config({**LLM, "hidden_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2}),
                          BagelGeometry(latent_channels=4, max_latent_size=8), vit=vit, vit_max_patches_per_side=4).eval()
    state = seeded_state(shapes, 2000)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not [k for k in missing if k.startswith(("vit_model", "connector"))], (missing, unexpected)
    torch.testing.assert_close(model.vit_pos_embed.pos_embed, saved["pos_embed"])
    with torch.no_grad():
        tokens = model.embed_images([saved["in/image0"], saved["in/image1"]])
    torch.testing.assert_close(torch.cat(tokens), saved["out/tokens"], rtol=1e-5, atol=1e-5)



def test_a_folder_in_the_released_layout_loads_every_tensor_by_name(tmp_path):
    """A tiny seeded BAGEL written as the released folder is (llm_config.json, vit_config.json with
    the one layer BAGEL drops, ema.safetensors under the released names, ae.safetensors in FLUX's
    original layout) loads back tensor for tensor, its VAE encoding as the VAE fixture's; a missing
    file or a foreign tensor is named."""

    vae_path = str(FIXTURE.with_name("bagel_vae_tiny.safetensors"))
    with safe_open(vae_path, "pt") as f:
        ae_state = seeded_state(json.loads(f.metadata()["shapes"]), 1000)
    vit = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": 140,
           "patch_size": 2, "layer_norm_eps": 1e-6}
    llm = {k: v for k, v in LLM.items() if k not in ("qk_norm", "layer_module")}
    torch.manual_seed(0)
    model = BagelBackbone(llm_config(LLM), BagelGeometry(latent_channels=4, max_latent_size=64), vit={**vit, "rope": False},
                          vit_max_patches_per_side=70)
    save_folder(tmp_path / "bagel", model, llm, vit, ae_state)
    geometry = AutoencoderGeometry(ch=32, ch_mult=(1, 2), num_res_blocks=1, z_channels=4)
    loaded, vae = load_folder(tmp_path / "bagel", geometry)
    assert json.loads((tmp_path / "bagel/vit_config.json").read_text())["num_hidden_layers"] == 3  # BAGEL runs 2 of 3
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    with torch.no_grad():
        torch.testing.assert_close(encode_latents(vae, load_file(vae_path)["in/image"]), load_file(vae_path)["out/latent"],
                                   rtol=1e-5, atol=1e-5)

    (tmp_path / "bagel/ae.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"not a BAGEL folder, missing ae.safetensors"):
        load_folder(tmp_path / "bagel", geometry)
    save_file(ae_state, str(tmp_path / "bagel/ae.safetensors"))
    foreign = {**load_file(str(tmp_path / "bagel/ema.safetensors")), "language_model.model.layers.9.mlp.up_proj.weight": torch.ones(1)}
    save_file(foreign, str(tmp_path / "bagel/ema.safetensors"))
    with pytest.raises(ValueError, match=r"ema.safetensors: 0 tensors of the model missing .*, 1 not the model's"):
        load_folder(tmp_path / "bagel", geometry)
