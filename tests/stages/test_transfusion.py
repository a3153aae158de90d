"""The tiny unified Transfusion model: checkpoint round trip, the attention pattern (causal text,
bidirectional image that reads the text prefix), padding, and one backbone trained by both heads."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from unirl.stages.models.transfusion import TransfusionModel, build_tiny_transfusion, joint_attention_mask, patchify, unpatchify

B, L, C, S = 2, 10, 4, 8


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_transfusion(tmp_path_factory.mktemp("transfusion") / "tiny", seed=0)


@pytest.fixture()
def model(tiny_dir):
    return TransfusionModel.from_pretrained(tiny_dir).eval()


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (B, L), generator=g)
    latents = torch.randn(B, C, S, S, generator=g)
    return ids, latents, torch.tensor([0.3, 0.8])


def test_tiny_build_size_and_files(tiny_dir, model):
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["model_type"] == "unirl_transfusion" and config["hidden_size"] == 64
    assert (tiny_dir / "model.safetensors").is_file()
    # vocab 256, hidden 64, 2 blocks of 41,088, 4-channel 8x8 latents in 2x2 patches.
    assert sum(p.numel() for p in model.parameters()) == 128_016
    assert len(model.blocks) == 2 and model._no_split_modules == {"TransfusionBlock"}


def test_save_load_round_trip_is_exact(tiny_dir, model, tmp_path):
    model.save_pretrained(tmp_path / "again")
    again = TransfusionModel.from_pretrained(tmp_path / "again").eval()
    other_seed = TransfusionModel.from_pretrained(build_tiny_transfusion(tmp_path / "seed1", seed=1)).eval()
    ids, latents, sigma = _inputs()
    with torch.no_grad():
        out, out2, out3 = (m(ids, None, latents, sigma) for m in (model, again, other_seed))
    assert torch.equal(out.logits, out2.logits) and torch.equal(out.velocity, out2.velocity)
    assert not torch.allclose(out.velocity, out3.velocity)


def test_patchify_is_raster_order_and_inverts():
    latents = torch.zeros(1, C, S, S)
    latents[0, 1, 2, 5] = 1.0  # row 2, col 5 -> patch (1, 2) -> index 1 * 4 + 2
    patches = patchify(latents, 2)
    assert patches.shape == (1, 16, C * 4)
    assert patches[0].abs().sum(-1).nonzero().flatten().tolist() == [6]
    x = torch.randn(B, C, S, S)
    assert torch.equal(unpatchify(patchify(x, 2), 2, C, S, S), x)


def test_joint_attention_mask_by_hand():
    mask = joint_attention_mask(torch.tensor([[1, 1, 0]]), num_image=2)[0, 0].int()
    expected = torch.tensor([
        [1, 0, 0, 0, 0],  # text 0: itself
        [1, 1, 0, 0, 0],  # text 1: causal
        [1, 1, 1, 0, 0],  # text pad: valid text before it, and itself so its row is never empty
        [1, 1, 0, 1, 1],  # patch 0: valid text, every patch
        [1, 1, 0, 1, 1],
    ])
    assert torch.equal(mask, expected)


def test_text_is_causal(model):
    ids, _, _ = _inputs()
    changed = ids.clone()
    changed[:, 6] = (changed[:, 6] + 1) % 256
    with torch.no_grad():
        a, b = model.text_logits(ids), model.text_logits(changed)
    assert a.shape == (B, L, 256)
    torch.testing.assert_close(a[:, :6], b[:, :6], rtol=0, atol=1e-6)
    assert (a[:, 6:] - b[:, 6:]).abs().amax() > 1e-4


def test_image_reads_text_but_text_never_reads_image(model):
    ids, latents, sigma = _inputs()
    other_prompt = ids.clone()
    other_prompt[:, 0] = (other_prompt[:, 0] + 1) % 256
    with torch.no_grad():
        v = model.velocity(ids, None, latents, sigma)
        joint = model(ids, None, latents, sigma)
        text_only = model(ids)
        other_image = model(ids, None, torch.randn_like(latents), sigma)
        v_other_prompt = model.velocity(other_prompt, None, latents, sigma)
    assert v.shape == (B, C, S, S)
    assert (v - v_other_prompt).abs().amax() > 1e-4
    torch.testing.assert_close(joint.text_hidden, text_only.text_hidden, rtol=0, atol=1e-5)
    torch.testing.assert_close(other_image.logits, text_only.logits, rtol=0, atol=1e-5)


def test_image_attention_is_bidirectional(model):
    ids, latents, sigma = _inputs()
    last_patch = latents.clone()
    last_patch[:, :, -2:, -2:] += 1.0  # the last patch in raster order
    with torch.no_grad():
        a, b = model.velocity(ids, None, latents, sigma), model.velocity(ids, None, last_patch, sigma)
    assert (a[:, :, :2, :2] - b[:, :, :2, :2]).abs().amax() > 1e-4  # the first patch sees it


def test_sigma_changes_velocity(model):
    ids, latents, _ = _inputs()
    with torch.no_grad():
        a, b = model.velocity(ids, None, latents, 0.2), model.velocity(ids, None, latents, 0.9)
    assert (a - b).abs().amax() > 1e-4


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_does_not_change_outputs(model, side):
    ids, latents, sigma = _inputs()
    garbage = torch.randint(0, 256, (B, 5), generator=torch.Generator().manual_seed(7))
    padded = torch.cat([ids, garbage] if side == "right" else [garbage, ids], dim=1)
    mask = torch.cat([torch.ones(B, L), torch.zeros(B, 5)] if side == "right" else [torch.zeros(B, 5), torch.ones(B, L)], 1)
    valid = slice(0, L) if side == "right" else slice(5, 5 + L)
    with torch.no_grad():
        v, v_pad = model.velocity(ids, None, latents, sigma), model.velocity(padded, mask.long(), latents, sigma)
        logits, logits_pad = model.text_logits(ids), model.text_logits(padded, mask.long())
    torch.testing.assert_close(v_pad, v, rtol=0, atol=1e-5)
    torch.testing.assert_close(logits_pad[:, valid], logits, rtol=0, atol=1e-5)


def test_shapes_the_model_cannot_take_are_errors(model):
    ids, latents, sigma = _inputs()
    with pytest.raises(ValueError, match="max_text_len 32"):
        model.text_logits(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match="multiples of 2 up to 8"):
        model.velocity(ids, None, torch.randn(B, C, 16, 16), sigma)
    with pytest.raises(ValueError, match="sigma"):
        model(ids, None, latents)


def test_lm_and_flow_losses_train_one_backbone(model):
    """Transfusion's objective: LM cross-entropy on the text plus flow-matching MSE on the image,
    one joint forward and one backward; both fall on a fixed batch, and both reach the blocks."""
    model.train()
    ids, x0, sigma = _inputs()
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(3))
    s = sigma[:, None, None, None]
    x_sigma, target = (1 - s) * x0 + s * noise, noise - x0

    def losses():
        out = model(ids, None, x_sigma, sigma)
        lm = F.cross_entropy(out.logits[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1))
        return lm, F.mse_loss(out.velocity, target)

    lm, flow = losses()
    qkv = model.blocks[0].qkv.weight
    assert torch.autograd.grad(lm, qkv, retain_graph=True)[0].abs().amax() > 0
    assert torch.autograd.grad(flow, qkv)[0].abs().amax() > 0
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    first = None
    for _ in range(15):
        lm, flow = losses()
        first = first or (lm.item(), flow.item())
        opt.zero_grad()
        (lm + flow).backward()
        opt.step()
    lm, flow = losses()
    assert lm.item() < 0.7 * first[0] and flow.item() < 0.9 * first[1], (first, lm.item(), flow.item())
