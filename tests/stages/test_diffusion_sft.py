"""Flow-matching SFT pieces: records from the train split only, VAE warm-up that learns, latent
standardization, the flow-matching loss by hand, batches that depend on (seed, step) only, grids."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from unirl.stages.diffusion import sft as S
from unirl.stages.diffusion.grid import image_grid
from unirl.stages.toys.geneval import split_of


def test_records_come_from_the_train_split_and_decode():
    records = S.geneval_records(12, seed=3, image_size=16)
    assert all(split_of(r["prompt"]) == "train" for r in records)
    images = S.decode_images([r["media_png"] for r in records])
    assert images.shape == (12, 16, 16, 3) and images.dtype == np.uint8
    small = io.BytesIO()
    Image.new("RGB", (8, 8)).save(small, format="PNG")
    with pytest.raises(ValueError, match="must share one size"):
        S.decode_images([records[0]["media_png"], small.getvalue()], "sft.arrow")


def test_batches_depend_on_seed_and_step_only():
    a = [S.batch_indices(s, seed=1, batch_size=5, num_records=50) for s in range(4)]
    assert a == [S.batch_indices(s, seed=1, batch_size=5, num_records=50) for s in range(4)]
    assert a[0] != a[1] and a != [S.batch_indices(s, seed=2, batch_size=5, num_records=50) for s in range(4)]
    sig = S.logit_normal_sigmas([4, 9], seed=0, step=3)
    assert sig.shape == (2,) and bool(((sig > 0) & (sig < 1)).all())


def test_shifted_training_sigmas_follow_the_samplers_shift():
    # The same draws, shifted: 3s / (1 + 2s); at the median draw (s = 0.5) that is 0.75.
    plain = S.logit_normal_sigmas(list(range(64)), seed=0, step=1)
    shifted = S.logit_normal_sigmas(list(range(64)), seed=0, step=1, shift=3.0)
    torch.testing.assert_close(shifted, 3 * plain / (1 + 2 * plain))
    assert float(shifted.median()) > 0.6 > float(plain.median())  # training moves towards high noise


def test_flow_matching_loss_by_hand():
    x0 = torch.tensor([[[[1.0, -1.0]]]])
    noise = torch.tensor([[[[0.5, 0.5]]]])
    sigma = torch.tensor([0.25])
    seen = {}

    def velocity(x, s):
        seen["x"] = x
        return torch.zeros_like(x)

    loss = S.flow_matching_loss(velocity, x0, noise, sigma)
    # x_sigma = .75 * x0 + .25 * noise = (.875, -.625); target v = noise - x0 = (-.5, 1.5): loss = (.25 + 2.25) / 2
    torch.testing.assert_close(seen["x"], torch.tensor([[[[0.875, -0.625]]]]))
    assert float(loss) == pytest.approx(1.25)


def test_vae_warm_up_learns_and_latents_are_standardized():
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, down_block_types=["DownEncoderBlock2D"],
                        up_block_types=["UpDecoderBlock2D"], block_out_channels=[8], layers_per_block=1, norm_num_groups=8,
                        sample_size=16, mid_block_add_attention=False)
    images = S.decode_images([r["media_png"] for r in S.geneval_records(16, seed=0, image_size=16)])
    pixels = S.to_pixels(images)
    with torch.no_grad():
        before = float(S.reconstruction_loss(vae, pixels))
    out = S.warm_up_vae(vae, images, steps=30, lr=5e-3, batch_size=8, seed=0)
    with torch.no_grad():
        after = float(S.reconstruction_loss(vae, pixels))
    assert after < 0.5 * before and out["vae_loss"] == pytest.approx(out["vae_loss"])
    assert not any(p.requires_grad for p in vae.parameters()), "the VAE is frozen after its warm-up"
    stats = S.standardize_latents(vae, images)
    with torch.no_grad():
        z = vae.encode(pixels).latent_dist.mean
    z = (z - vae.config.shift_factor) * vae.config.scaling_factor
    assert abs(float(z.mean())) < 1e-4 and float(z.std()) == pytest.approx(1.0, abs=1e-3)
    assert stats["vae_scaling_factor"] == vae.config.scaling_factor


def test_image_grid_captions_every_image():
    pngs = [r["media_png"] for r in S.geneval_records(5, seed=0, image_size=16)]
    grid = image_grid(pngs, [f"prompt {i}  r=0.50" for i in range(5)], columns=2, cell=32)
    assert grid.size[0] == 2 * 36 and grid.size[1] > 3 * 32
