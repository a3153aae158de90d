"""The SD3 family on a tiny, seeded SD3 saved and loaded in diffusers layout."""
from __future__ import annotations

import io
import json
import shutil
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
from PIL import Image

from unirl.stages.models.flow_text import build_tiny_clip_tokenizer
from unirl.stages.models.sd3 import SD3, SD3ModelConfig, TinySD3
from unirl.stages.runtime.config_base import LoraConfig
from unirl.stages.runtime.media import to_pil, to_png_bytes
from unirl.stages.toys.geneval import WORDS, all_prompts

PROMPTS = ["two red circles", "a blue square on the left of a green triangle"]
# Two VAE blocks (factor 2), patch 2 and the VAE's mid attention: SD3's real layout in small.
TINY = {"image_size": 32, "vae_channels": [32, 32], "patch_size": 2, "vae_mid_attention": True}


def build(directory, **over):
    return SD3.build_tiny(directory, TinySD3(**{**TINY, **over}))


def load(directory):
    return SD3.load(directory, SD3ModelConfig(), "cpu")


@dataclass
class Embeds:
    """The conditioning of PROMPTS (B = 2) and of the negative prompt "" broadcast to them."""

    embeds: torch.Tensor
    pooled: torch.Tensor
    neg_embeds: torch.Tensor
    neg_pooled: torch.Tensor


def encode(bundle, prompts, negative="") -> Embeds:
    cond = [SD3.encode_prompt(bundle, p) for p in prompts]
    neg = SD3.encode_prompt(bundle, negative)
    return Embeds(torch.stack([c[0] for c in cond]), torch.stack([c[1] for c in cond]),
                  neg[0].expand(len(prompts), *neg[0].shape), neg[1].expand(len(prompts), *neg[1].shape))


def velocity(bundle, x, sigma, embeds, pooled, guidance_scale=1.0, neg_embeds=None, neg_pooled=None):
    neg = None if neg_embeds is None else (neg_embeds, neg_pooled)
    return SD3.velocity(bundle, bundle.module, x, sigma, (embeds, pooled), guidance_scale, neg)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build(tmp_path_factory.mktemp("sd3") / "tiny")


@pytest.fixture()
def bundle(tiny_dir):
    return load(tiny_dir)


@pytest.fixture()
def embeds(bundle):
    return encode(bundle, PROMPTS)


def _noise(bundle, n=2, seed=0):
    return torch.randn(n, *SD3.latent_shape(bundle, 32), generator=torch.Generator().manual_seed(seed))


def test_tiny_checkpoint_has_the_diffusers_sd3_layout_and_is_seeded(tiny_dir, tmp_path):
    index = json.loads((tiny_dir / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusion3Pipeline"
    for name in ("transformer", "vae", "scheduler", "text_encoder", "text_encoder_2", "text_encoder_3",
                 "tokenizer", "tokenizer_2", "tokenizer_3"):
        assert index[name][0] is not None and (tiny_dir / name).is_dir(), name
    a, b = load(tiny_dir), load(build(tmp_path / "same", seed=0))
    other = load(build(tmp_path / "other", seed=1))
    for name, p in a.transformer.state_dict().items():
        assert torch.equal(p, b.transformer.state_dict()[name]), name
    assert not torch.equal(a.vae.state_dict()["encoder.conv_in.weight"], other.vae.state_dict()["encoder.conv_in.weight"])
    geo = SD3.geometry(a)
    assert geo.vae_factor == 2 and geo.patch == 2 and SD3.default_image_size(a) == 32
    assert a.settings["text_length"] == 16
    # the recipe's geometry and image side, read without loading weights, are the loaded model's
    for cfg in (SD3ModelConfig(tiny=TINY), SD3ModelConfig(path=str(tiny_dir))):
        assert replace(SD3.recipe_geometry(cfg), what="") == replace(geo, what="")
    assert SD3.native_image_size(SD3ModelConfig(path=str(tiny_dir))) == 32


def test_tiny_checkpoint_runs_in_diffusers_own_pipeline_and_we_reproduce_it(bundle, tiny_dir):
    """The tiny directory is a real SD3 checkpoint to diffusers, and our encode / CFG velocity /
    Euler step / decode give the pipeline's own images pixel for pixel."""
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_dir)
    pe, ne, pp, npp = pipe.encode_prompt(PROMPTS, None, None, negative_prompt="", max_sequence_length=16, device="cpu")
    ours = encode(bundle, PROMPTS)
    for theirs, mine in [(pe, ours.embeds), (pp, ours.pooled), (ne, ours.neg_embeds), (npp, ours.neg_pooled)]:
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
    noise = _noise(bundle)
    out = pipe(prompt_embeds=pe, pooled_prompt_embeds=pp, negative_prompt_embeds=ne, negative_pooled_prompt_embeds=npp,
               latents=noise.clone(), num_inference_steps=3, guidance_scale=4.0, output_type="np", height=32, width=32)
    sigmas = pipe.scheduler.sigmas
    x = noise
    with torch.no_grad():
        for i in range(3):
            v = velocity(bundle, x, float(sigmas[i]), ours.embeds, ours.pooled, guidance_scale=4.0,
                         neg_embeds=ours.neg_embeds, neg_pooled=ours.neg_pooled)
            x = x + v * (sigmas[i + 1] - sigmas[i])
    expected = torch.from_numpy((out.images * 255).round().astype(np.uint8))
    assert (SD3.decode(bundle, x).int() - expected.int()).abs().max() <= 1


def test_load_errors_name_the_directory_and_the_missing_part(tiny_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="model_index.json"):
        load(tmp_path)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir, broken)
    shutil.rmtree(broken / "vae")
    with pytest.raises(FileNotFoundError) as err:
        load(broken)
    assert str(broken) in str(err.value) and "'vae'" in str(err.value)
    shutil.copytree(tiny_dir / "vae", broken / "vae")
    index = json.loads((tiny_dir / "model_index.json").read_text())
    for missing in ("text_encoder", "tokenizer_3"):
        (broken / "model_index.json").write_text(json.dumps({**index, missing: [None, None]}))
        with pytest.raises(ValueError, match=f"lists no '{missing}'"):
            load(broken)


def test_tiny_tokenizer_reads_every_toy_prompt_word_as_one_token(bundle):
    tok = bundle.text["tokenizer"]
    for word in WORDS:
        assert len(tok(word, add_special_tokens=False).input_ids) == 1, word
    longest = max(all_prompts(), key=len)
    assert len(tok("a photo of " + longest).input_ids) <= tok.model_max_length
    assert tok.unk_token_id not in tok("zebra, 42!", add_special_tokens=False).input_ids


def test_encode_prompt_shapes_and_negative_prompt_broadcast(bundle, embeds):
    from unirl.stages.diffusion.model import PromptCache
    from unirl.stages.policies.flow import FlowSampler

    joint = bundle.transformer.config.joint_attention_dim
    assert embeds.embeds.shape == (2, 16 + 16, joint) and embeds.pooled.shape == (2, 64)
    # the conditioning of a prompt is the same bits alone or among others
    together = PromptCache(SD3, bundle)(PROMPTS, FlowSampler(guidance_scale=4.0))
    torch.testing.assert_close(together.cond, (embeds.embeds, embeds.pooled), atol=0, rtol=0)
    torch.testing.assert_close(together.neg, (embeds.neg_embeds, embeds.neg_pooled), atol=0, rtol=0)
    assert PromptCache(SD3, bundle)(PROMPTS, FlowSampler(guidance_scale=1.0)).neg is None
    assert not torch.allclose(embeds.embeds[0], embeds.embeds[1])


def test_velocity_is_deterministic_and_takes_per_sample_sigma(bundle, embeds):
    x = _noise(bundle)
    with torch.no_grad():
        v = velocity(bundle, x, 0.7, embeds.embeds, embeds.pooled)
        assert v.shape == x.shape and v.dtype == torch.float32
        torch.testing.assert_close(velocity(bundle, x, 0.7, embeds.embeds, embeds.pooled), v, atol=0, rtol=0)
        torch.testing.assert_close(velocity(bundle, x, torch.tensor([0.7, 0.7]), embeds.embeds, embeds.pooled), v)
        mixed = velocity(bundle, x, torch.tensor([0.7, 0.2]), embeds.embeds, embeds.pooled)
        low = velocity(bundle, x, 0.2, embeds.embeds, embeds.pooled)
        # SD3's convention: the transformer's timestep is sigma * 1000.
        direct = bundle.transformer(hidden_states=x, timestep=torch.full((2,), 0.7 * SD3.timestep_scale),
                                    encoder_hidden_states=embeds.embeds, pooled_projections=embeds.pooled).sample
    torch.testing.assert_close(mixed[0], v[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mixed[1], low[1], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(v[1], low[1])
    torch.testing.assert_close(direct, v)
    with pytest.raises(ValueError, match="sigma"):
        velocity(bundle, x, torch.tensor([0.1, 0.2, 0.3]), embeds.embeds, embeds.pooled)


def test_cfg_is_uncond_plus_scale_times_difference_in_one_batched_forward(bundle, embeds):
    x, g = _noise(bundle), 4.5
    calls = []
    hook = bundle.transformer.register_forward_hook(lambda m, a, kw, out: calls.append(kw["hidden_states"].shape[0]), with_kwargs=True)
    with torch.no_grad():
        guided = velocity(bundle, x, 0.5, embeds.embeds, embeds.pooled, guidance_scale=g,
                          neg_embeds=embeds.neg_embeds, neg_pooled=embeds.neg_pooled)
        hook.remove()
        cond = velocity(bundle, x, 0.5, embeds.embeds, embeds.pooled)
        uncond = velocity(bundle, x, 0.5, embeds.neg_embeds, embeds.neg_pooled)
        one = velocity(bundle, x, 0.5, embeds.embeds, embeds.pooled, guidance_scale=1.0,
                       neg_embeds=embeds.neg_embeds, neg_pooled=embeds.neg_pooled)
    assert calls == [4]
    torch.testing.assert_close(guided, uncond + g * (cond - uncond), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(guided, cond, atol=1e-3)
    torch.testing.assert_close(one, cond, atol=0, rtol=0)
    with pytest.raises(ValueError, match="negative_prompt"):
        velocity(bundle, x, 0.5, embeds.embeds, embeds.pooled, guidance_scale=g)
    with pytest.raises(ValueError, match="guidance_scale"):
        velocity(bundle, x, 0.5, embeds.embeds, embeds.pooled, guidance_scale=0.5)


def test_velocity_keeps_gradients_for_training(bundle, embeds):
    v = velocity(bundle, _noise(bundle), 0.5, embeds.embeds, embeds.pooled)
    v.square().mean().backward()
    assert bundle.transformer.proj_out.weight.grad is not None
    assert all(p.grad is None for p in bundle.vae.parameters())


def test_decode_and_encode_images_apply_the_vae_scale_and_shift(bundle):
    latents = _noise(bundle)
    images = SD3.decode(bundle, latents)
    assert images.shape == (2, 32, 32, 3) and images.dtype == torch.uint8
    vae, scale, shift = bundle.vae, bundle.vae.config.scaling_factor, bundle.vae.config.shift_factor
    with torch.no_grad():
        raw = vae.decode(latents / scale + shift).sample
        z = vae.encode(images.permute(0, 3, 1, 2).float() / 127.5 - 1).latent_dist.mean
    expected = ((raw.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1)
    assert torch.equal(images, expected)
    encoded = SD3.encode_images(bundle, images)
    assert encoded.shape == latents.shape
    torch.testing.assert_close(encoded, (z - shift) * scale)
    torch.testing.assert_close(SD3.encode_images(bundle, to_pil(images)), encoded)
    sampled = SD3.codec(bundle).encode(bundle.vae, images, video=False, sample=True, generator=torch.Generator().manual_seed(0))
    assert sampled.shape == latents.shape and not torch.allclose(sampled, encoded)
    png = to_png_bytes(images)
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(png[1]))), images[1].numpy())


def test_lora_starts_at_the_base_and_reference_policy_disables_it(bundle, embeds):
    x = _noise(bundle)
    from peft.tuners.lora import LoraLayer

    v = lambda: velocity(bundle, x, 0.6, embeds.embeds, embeds.pooled)  # noqa: E731
    with torch.no_grad():
        base = v()
        SD3.add_lora(bundle, LoraConfig(rank=4, alpha=8))
        layers = [n for n, m in bundle.transformer.named_modules() if isinstance(m, LoraLayer)]
        assert len(layers) == 8 * bundle.transformer.config.num_layers - 1  # last block has no to_add_out
        trainable = [n for n, p in bundle.transformer.named_parameters() if p.requires_grad]
        assert trainable and all("lora_" in n for n in trainable)
        torch.testing.assert_close(v(), base, atol=0, rtol=0)
        for name, p in bundle.transformer.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
        tuned = v()
        with SD3.reference(bundle):
            torch.testing.assert_close(v(), base, atol=0, rtol=0)
            with SD3.reference(bundle):
                pass
            torch.testing.assert_close(v(), base, atol=0, rtol=0)
        torch.testing.assert_close(v(), tuned, atol=0, rtol=0)
    assert not torch.allclose(tuned, base, atol=1e-4)


def test_lora_errors(bundle):
    with pytest.raises(ValueError, match="reference_policy needs a LoRA adapter"):
        with SD3.reference(bundle):
            pass
    with pytest.raises(ValueError) as err:
        SD3.add_lora(bundle, LoraConfig(rank=4, alpha=4, target_modules=["attn.to_q", "attn.to_qq"]))
    assert "attn.to_qq" in str(err.value) and "to_k" in str(err.value)


def test_an_image_size_the_model_cannot_take_is_a_clear_error(bundle, tmp_path):
    for size in (30, 2, 72):
        with pytest.raises(ValueError, match="multiples of 4 up to 64"):
            SD3.latent_shape(bundle, size)
    assert SD3.latent_shape(bundle, 64) == (4, 32, 32)
    SD3.check_image_size(bundle, 16, 24)
    with pytest.raises(ValueError, match="image size 30"):
        SD3.check_image_size(bundle, 16, 30)
    with pytest.raises(ValueError, match="image size 30"):
        SD3.encode_images(bundle, np.zeros((1, 30, 30, 3), dtype=np.uint8))
    with pytest.raises(ValueError, match="multiple of 4"):
        build(tmp_path / "bad", image_size=30)


def test_without_t5_zero_rows_stand_in(tmp_path):
    root = build(tmp_path / "no_t5", with_t5=False)
    assert json.loads((root / "model_index.json").read_text())["text_encoder_3"] == [None, None]
    bundle = load(root)
    assert sorted(bundle.text) == ["text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"]
    assert bundle.settings["text_length"] == 256  # diffusers' rule: max_sequence_length zero rows
    e = encode(bundle, PROMPTS)
    assert e.embeds.shape == (2, 16 + 256, 64) and torch.count_nonzero(e.embeds[:, 16:]) == 0
    assert torch.count_nonzero(e.embeds[:, :16]) > 0


def test_tiny_tokenizer_is_the_same_in_every_process():
    """Regression: the `tokenizers` BPE trainer broke ties by hash order, so every process built a
    different vocabulary and a run's tiny SD3 (and its results) changed from one launch to the next."""
    import os
    import subprocess
    import sys

    code = ("from unirl.stages.models.flow_text import build_tiny_clip_tokenizer; import json; "
            "print(json.dumps(build_tiny_clip_tokenizer().get_vocab(), sort_keys=True))")
    tok = build_tiny_clip_tokenizer()  # this process: a third hash seed (random unless PYTHONHASHSEED is set)
    vocabs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout for seed in (1, 2)}
    vocabs.add(json.dumps(tok.get_vocab(), sort_keys=True) + "\n")
    assert len(vocabs) == 1
    for word in WORDS:
        assert len(tok(word, add_special_tokens=False).input_ids) == 1, word
