"""clip, pickscore, hps and aesthetic on a tiny random CLIP loaded from a directory."""
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel

from tests.tiny_reward_models import random_images
from unirl.stages.rewards import ScoreBatch, ScorerError, build_scorer, run_scorer
from unirl.stages.rewards.aesthetic import load_linear_chain

PROMPTS = ["a cat", "a dog on a sofa", "hello", "sunset 42", "xyz", 'the sign says "ok"']


@pytest.fixture(scope="module")
def batch() -> ScoreBatch:
    return ScoreBatch([f"g/{i}" for i in range(6)], PROMPTS, images=random_images(6))


@pytest.fixture(scope="module")
def reference(clip_dir, batch):
    """Cosine similarities and exp(logit_scale) from transformers' own CLIPModel.forward."""
    model = CLIPModel.from_pretrained(clip_dir).eval()
    tok, proc = AutoTokenizer.from_pretrained(clip_dir), AutoImageProcessor.from_pretrained(clip_dir)
    text = tok(batch.prompts, padding=True, truncation=True, return_tensors="pt")
    pixels = proc(images=batch.images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        out = model(input_ids=text["input_ids"], attention_mask=text["attention_mask"], pixel_values=pixels)
    scale = model.logit_scale.exp().item()
    return out.logits_per_image.diag().double().numpy() / scale, scale, out.image_embeds.double().numpy()


def score(name, batch, **params):
    result = run_scorer(build_scorer(name, device="cpu", **params), batch)
    assert result.scores.shape == (len(batch),) and result.scores.dtype == np.float64
    return result.scores


def test_clip_is_clamped_cosine_times_w(clip_dir, batch, reference):
    cos, _, _ = reference
    assert (cos > 0).any() and (cos < 0).any(), "the fixture must exercise the clamp"
    np.testing.assert_allclose(score("clip", batch, model_path=str(clip_dir)), np.maximum(cos, 0), atol=1e-5)
    s = score("clip", batch, model_path=str(clip_dir), w=2.5)
    np.testing.assert_allclose(s, 2.5 * np.maximum(cos, 0), atol=1e-5)
    assert ((s >= 0) & (s <= 2.5)).all()


def test_pickscore_uses_the_models_logit_scale(clip_dir, batch, reference):
    cos, scale, _ = reference
    np.testing.assert_allclose(score("pickscore", batch, model_path=str(clip_dir)), scale * cos, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(score("pickscore", batch, model_path=str(clip_dir), divisor=26),
                               scale * cos / 26, rtol=1e-4, atol=1e-6)


def test_hps_is_scaled_cosine(clip_dir, batch, reference):
    cos, _, _ = reference
    np.testing.assert_allclose(score("hps", batch, model_path=str(clip_dir)), cos, atol=1e-5)
    hps_v1 = score("hps", batch, model_path=str(clip_dir), scale=100)
    np.testing.assert_allclose(hps_v1, 100 * cos, atol=1e-3)
    assert (np.abs(hps_v1) <= 100).all()


def test_aesthetic_is_head_on_unit_image_embedding(clip_dir, batch, reference):
    _, _, image_embeds = reference  # already L2-normalized by CLIPModel.forward
    (w1, b1), (w2, b2) = load_linear_chain(clip_dir / "aesthetic_head.safetensors")
    want = ((image_embeds @ w1.T + b1) @ w2.T + b2)[:, 0]
    np.testing.assert_allclose(score("aesthetic", batch, model_path=str(clip_dir)), want, atol=1e-4)
    relu = ((np.maximum(image_embeds @ w1.T + b1, 0)) @ w2.T + b2)[:, 0]
    np.testing.assert_allclose(score("aesthetic", batch, model_path=str(clip_dir), activation="relu"), relu, atol=1e-4)


@pytest.mark.parametrize("name", ["clip", "pickscore", "hps", "aesthetic"])
def test_deterministic_across_loads_and_batch_sizes(clip_dir, batch, name):
    a = score(name, batch, model_path=str(clip_dir), batch_size=4)
    b = score(name, batch, model_path=str(clip_dir), batch_size=32)
    np.testing.assert_allclose(a, b, atol=1e-6)
    np.testing.assert_array_equal(a, score(name, batch, model_path=str(clip_dir), batch_size=4))


def test_aesthetic_head_layout_errors(tmp_path):
    save_file({"a.weight": torch.zeros(4, 16), "b.weight": torch.zeros(1, 3)}, str(tmp_path / "h.safetensors"))
    with pytest.raises(ValueError, match="'b' takes 3 inputs but the layer before gives 4"):
        load_linear_chain(tmp_path / "h.safetensors")
    save_file({"layers.0.weight": torch.zeros(2, 16)}, str(tmp_path / "h2.safetensors"))
    with pytest.raises(ValueError, match="last linear layer must have one output"):
        load_linear_chain(tmp_path / "h2.safetensors")
    save_file({f"layers.{i}.weight": torch.zeros(16 if i < 10 else 1, 16) for i in (0, 2, 10)},
              str(tmp_path / "h3.safetensors"))
    assert [w.shape[0] for w, _ in load_linear_chain(tmp_path / "h3.safetensors")] == [16, 16, 1]


def test_errors_name_the_scorer_and_what_is_missing(clip_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="scorer 'clip': model_path .* is not a directory"):
        build_scorer("clip", model_path=str(tmp_path / "nope"))
    scorer = build_scorer("clip", model_path=str(clip_dir), device="cpu")
    with pytest.raises(ScorerError, match="scorer 'clip' failed: ValueError: .*needs images"):
        run_scorer(scorer, ScoreBatch(["a"], ["p"], texts=["t"]))
