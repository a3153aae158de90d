"""Bad flow-family inputs fail at validate time naming the field (a folder of another family, a
frame count the VAE cannot take, an image side the VAE and patch cannot take), and video in the
data plane: a video family's rollouts store one PNG per frame, scorers receive the frames, and the
preview is an animated grid."""
from __future__ import annotations

import io
import sys

import pytest
import torch
from PIL import Image

from tests import zygote
from tests.conftest import REPO
from tests.tiny import CASES, merged
from unirl.stages.recipe import RecipeError, build_recipe


def errors(case: str, **over) -> list[str]:
    with pytest.raises(RecipeError) as info:
        build_recipe(merged(CASES[case], {"algorithm": {"name": "flow_grpo"}}, over))
    return info.value.errors


def test_a_folder_of_another_family_is_refused_naming_model_path_and_the_kind_that_loads_it(tiny_weights):
    sd3 = tiny_weights("sd3")
    (err,) = errors("wan", model={"path": str(sd3)})
    assert err == (f"model.path: {sd3} is a StableDiffusion3Pipeline folder, not one model.kind 'wan' loads (WanPipeline); "
                   "set model.kind: sd3, or point model.path at a wan checkpoint")
    (err,) = errors("sd3", model={"path": str(tiny_weights("wan"))})
    assert "is a WanPipeline folder, not one model.kind 'sd3' loads" in err and "set model.kind: wan" in err
    build_recipe(merged(CASES["wan2.2"], {"algorithm": {"name": "flow_grpo"}, "model": {"path": str(tiny_weights("wan2.2"))}}))


def test_a_frame_count_the_vae_cannot_take_names_the_field(tiny_weights):
    (err,) = errors("wan", model={"tiny": {"num_frames": 6}})
    assert err.startswith("model.tiny.num_frames: 6 frames cannot be taken by the Wan model in model.tiny:") and \
        "clips need 1 + 4k frames (e.g. 5, 9, 13)" in err
    # (the toy video task may refuse the same clip length for its own reasons: both are reported)
    assert any(e.startswith("rollout.sampler.num_frames: 7 frames cannot be taken by the HunyuanVideo 1.0 model")
               for e in errors("hunyuan_video", rollout={"sampler": {"num_frames": 7}}))
    # a checkpoint's VAE read from its config, before any weights load
    (err,) = errors("wan", model={"path": str(tiny_weights("wan"))}, rollout={"sampler": {"num_frames": 8}})
    assert err.startswith(f"rollout.sampler.num_frames: 8 frames cannot be taken by the Wan model in {tiny_weights('wan')}")
    (err,) = errors("flux2_klein", rollout={"sampler": {"num_frames": 5}})
    assert err == "rollout.sampler.num_frames: model.kind 'flux2_klein' makes images, not videos; remove it"


def test_an_image_side_the_vae_and_patch_cannot_take_names_the_field(tiny_weights):
    (err,) = errors("qwen_image", rollout={"sampler": {"image_size": 18}})
    assert err.startswith("rollout.sampler.image_size: image size 18 cannot be taken by the Qwen-Image model in model.tiny: "
                          "the VAE downsamples by 2 and the transformer patch is 2, so image sides must be multiples of 4")
    (err,) = errors("hunyuan_video1.5", model={"tiny": {"image_size": 15}})
    assert err.startswith("model.tiny.image_size: image size 15 cannot be taken by the HunyuanVideo 1.5 model")
    (err,) = errors("flux2_klein", model={"path": str(tiny_weights("flux2_klein"))}, rollout={"sampler": {"image_size": 18}})
    assert err.startswith("rollout.sampler.image_size: image size 18 cannot be taken by the FLUX.2 model in") and \
        "multiples of 4" in err  # FLUX.2 patchifies the VAE's latents 2x2: 2 x 2


def test_unirl_validate_reports_it_before_anything_loads(tmp_path, tiny_weights):
    out = zygote.run([sys.executable, "-m", "unirl.flows.cli", "validate", str(REPO / "recipes/video/wan.yaml"),
                      "rollout.sampler.num_frames=4", f"model.path={tiny_weights('hunyuan_video')}"],
                     cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 2
    assert "model.path: " in out.stderr and "is a HunyuanVideoPipeline folder, not one model.kind 'wan' loads" in out.stderr


def test_a_video_familys_rollouts_store_frames_that_scorers_and_previews_read(tmp_path, tiny_weights):
    from unirl.stages.diffusion.grid import rollout_grid
    from unirl.stages.run import iteration as it
    from unirl.stages.runtime.sample import read_rollouts
    from unirl.stages.runtime.storage import RunStorage
    from unirl.stages.workers.worker import Worker

    recipe = build_recipe(merged(CASES["wan"], {"algorithm": {"name": "flow_grpo"}, "storage": {"root": str(tmp_path)},
                                                "reward": {"scorers": [{"name": "videotoy", "params": {"mode": "mean"}}]}}))
    spec = {"recipe": recipe.model_dump(mode="json"), "root": str(tmp_path), "run": "run",
            "weights_dir": str(tiny_weights("wan")), "scratch": str(tmp_path / "scratch")}
    worker, storage = Worker(spec, None, torch.device("cpu")), RunStorage(str(tmp_path), "run")
    requests = it.write_requests(storage, recipe, 0)["files"][0]
    gen = worker.generate(iteration=0, requests=requests, out_dir="iter-000000/rollouts")
    assert gen["videos"] == 6
    table = read_rollouts(storage, gen["files"])
    row = table.slice(0, 1).to_pylist()[0]
    assert row["media_png"] is None and row["latent_shape"] == [4, 4, 5, 8, 8]  # x_T and 3 SDE transitions
    frames = [Image.open(io.BytesIO(b)) for b in row["media_frames"]]
    assert len(frames) == 5 and all(f.size == (16, 16) for f in frames)
    batch = it.score_batch(table)
    assert batch.images is None and [len(v) for v in batch.videos] == [5] * 6
    scored = it.score(storage, recipe, 0, gen["files"])
    assert {"rollout/reward/videotoy/direction", "rollout/reward/videotoy/colour"} <= set(scored["metrics"])
    grid = rollout_grid(storage, gen["files"], scored["files"][0])
    assert isinstance(grid, list) and len(grid) == 5 and grid[0].size == grid[4].size
    from unirl.stages.runtime.media import to_gif

    gif = Image.open(io.BytesIO(to_gif(grid)))
    assert gif.n_frames == 5
