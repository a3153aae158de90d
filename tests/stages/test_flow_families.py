"""Every flow family (SD3, FLUX.2 klein, Qwen-Image, Wan 2.1/2.2, HunyuanVideo 1.0/1.5) on its tiny
seeded folder: the folder is a diffusers checkpoint its own pipeline class loads, the conditioning
of a prompt is fixed, the transformer is called with the timestep convention and guidance the
family states, Wan 2.2's experts switch at the boundary, LoRA starts at the base and its disabled
state is the reference, and an exported folder loads back to the same velocity (SD3 against
diffusers' own pipeline, image for image: tests/stages/test_sd3_bundle.py)."""
from __future__ import annotations

import json

import pytest
import torch

from tests.tiny import CASES
from unirl.stages.models.flow_family import get_flow_family
from unirl.stages.runtime.registry import families


def diffusers_ships(kind: str) -> bool:
    """The family's pipeline is a diffusers class (the unified `transfusion` family is ours:
    tests/stages/test_unified.py and the matrix cover it)."""
    import diffusers

    return hasattr(diffusers, get_flow_family(kind).pipelines[0])


FLOW_CASES = sorted(c for c in CASES if families.get(CASES[c]["model"]["kind"]).policy == "flow"
                    and diffusers_ships(CASES[c]["model"]["kind"]))
PROMPT = "two blue squares moving up quickly"


def family_of(case: str):
    return families.get(CASES[case]["model"]["kind"])


def loaded(case: str, tiny_weights):
    fam = family_of(case)
    return fam, fam.load(tiny_weights(case), fam.config.model_validate(CASES[case]["model"]), "cpu")


def inputs(fam, bundle, n: int = 2, seed: int = 0):
    """Latents (n, *latent) of the folder's own media size and the batched conditioning of PROMPT."""
    shape = fam.latent_shape(bundle, fam.default_image_size(bundle), fam.default_num_frames(bundle))
    x = torch.randn(n, *shape, generator=torch.Generator().manual_seed(seed))
    cond = tuple(t.expand(n, *t.shape) for t in fam.encode_prompt(bundle, PROMPT))
    return x, cond


def calls_of(module):
    """Each call's keyword arguments to `module`'s forward, collected while the hook is on."""
    seen = []
    return seen, module.register_forward_hook(lambda m, a, kw, out: seen.append(kw), with_kwargs=True)


@pytest.mark.parametrize("case", FLOW_CASES)
def test_the_tiny_folder_is_a_checkpoint_diffusers_own_pipeline_loads(case, tiny_weights):
    from diffusers import DiffusionPipeline

    root = tiny_weights(case)
    index = json.loads((root / "model_index.json").read_text())
    pipe = DiffusionPipeline.from_pretrained(root)
    assert type(pipe).__name__ == index["_class_name"] in family_of(case).pipelines
    fam, bundle = loaded(case, tiny_weights)
    ours = dict(fam.transformers(bundle.module)[0].named_parameters())
    assert all(torch.equal(p, ours[n]) for n, p in pipe.transformer.named_parameters())


@pytest.mark.parametrize("case", FLOW_CASES)
def test_conditioning_is_fixed_per_prompt_and_the_timestep_follows_the_familys_convention(case, tiny_weights):
    fam, bundle = loaded(case, tiny_weights)
    a, b = fam.encode_prompt(bundle, PROMPT), fam.encode_prompt(bundle, "a red square moving left slowly")
    assert [t.shape for t in a] == [t.shape for t in b] and not torch.equal(a[0], b[0])
    assert all(torch.equal(x, y) for x, y in zip(a, fam.encode_prompt(bundle, PROMPT)))
    x, cond = inputs(fam, bundle)
    sigma = torch.tensor([0.8, 0.75])  # above Wan 2.2's boundary: its first expert
    seen, hook = calls_of(fam.transformers(bundle.module)[0])
    with torch.no_grad():
        v = fam.velocity(bundle, bundle.module, x, sigma, cond, 1.0, None)
    hook.remove()
    assert v.shape == x.shape and v.dtype == torch.float32
    timestep = seen[-1]["timestep"]
    timestep = timestep if timestep.ndim == 1 else timestep[:, 0]
    # SD3, Wan and HunyuanVideo take sigma * 1000; FLUX.2 and Qwen-Image sigma (they scale inside)
    torch.testing.assert_close(timestep, sigma * fam.timestep_scale)
    assert fam.timestep_scale == {"flux2_klein": 1.0, "qwen_image": 1.0}.get(fam.name, 1000.0)


@pytest.mark.parametrize("case", FLOW_CASES)
def test_guidance_is_cfg_in_one_batched_forward_or_the_distilled_models_input(case, tiny_weights):
    from unirl.stages.diffusion.model import PromptCache
    from unirl.stages.policies.flow import FlowSampler

    fam, bundle = loaded(case, tiny_weights)
    x, cond = inputs(fam, bundle)
    neg = tuple(t.expand(2, *t.shape) for t in fam.encode_prompt(bundle, ""))
    sampler = FlowSampler(guidance_scale=4.0)
    seen, hook = calls_of(fam.transformers(bundle.module)[0])
    with torch.no_grad():
        guided = fam.velocity(bundle, bundle.module, x, 0.9, cond, 4.0, neg)
        plain = fam.velocity(bundle, bundle.module, x, 0.9, cond, 1.0, neg)
    hook.remove()
    if fam.uses_cfg(bundle):
        assert PromptCache(fam, bundle)([PROMPT], sampler).neg is not None
        assert [kw["hidden_states"].shape[0] for kw in seen] == [4, 2]
        with torch.no_grad():
            uncond = fam.velocity(bundle, bundle.module, x, 0.9, neg, 1.0, None)
        torch.testing.assert_close(guided, fam.combine_cfg(uncond, plain, 4.0), atol=1e-5, rtol=1e-5)
    else:  # guidance-distilled (the tiny FLUX.2 klein, HunyuanVideo 1.0): no negative prompt, the scale is an input
        assert PromptCache(fam, bundle)([PROMPT], sampler).neg is None
        assert [kw["hidden_states"].shape[0] for kw in seen] == [2, 2]
        given = seen[0]["guidance"]
        torch.testing.assert_close(given, torch.full_like(given, 4.0 * (1000.0 if fam.name == "hunyuan_video" else 1.0)))
    assert not torch.allclose(guided, plain, atol=1e-4)


def test_qwen_images_true_cfg_keeps_each_tokens_conditional_norm(tiny_weights):
    from unirl.stages.models.qwen_image import pack

    fam, bundle = loaded("qwen_image", tiny_weights)
    uncond, cond = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    guided = fam.combine_cfg(uncond, cond, 3.0)
    torch.testing.assert_close(pack(guided).norm(dim=-1), pack(cond).norm(dim=-1))
    direction = pack(uncond + 3.0 * (cond - uncond))
    cosine = torch.nn.functional.cosine_similarity(pack(guided), direction, dim=-1)
    torch.testing.assert_close(cosine, torch.ones_like(cosine))


def test_wan22_switches_experts_at_the_boundary_timestep(tiny_weights):
    fam, bundle = loaded("wan2.2", tiny_weights)
    experts = bundle.module
    assert experts.boundary == pytest.approx(700.0)  # boundary_ratio 0.7 of 1000 timesteps
    x, cond = inputs(fam, bundle, n=3)
    sigma = torch.tensor([0.9, 0.5, 0.71])
    with torch.no_grad():
        mixed = fam.velocity(bundle, experts, x, sigma, cond, 1.0, None)
        high = experts.transformer(hidden_states=x, timestep=sigma * 1000, encoder_hidden_states=cond[0], return_dict=False)[0]
        low = experts.transformer_2(hidden_states=x, timestep=sigma * 1000, encoder_hidden_states=cond[0], return_dict=False)[0]
    torch.testing.assert_close(mixed[[0, 2]], high[[0, 2]], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mixed[1], low[1], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(high[1], low[1], atol=1e-3)
    assert len(fam.fsdp_units(experts)) == 2 * len(experts.transformer.blocks)


def test_flux2s_resolution_dependent_shift_is_the_pipelines():
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

    from unirl.stages.models.flux2_klein import empirical_mu

    for tokens, steps in ((16, 10), (1024, 4), (4096, 50), (5000, 28)):
        assert empirical_mu(tokens, steps) == pytest.approx(compute_empirical_mu(tokens, steps), rel=1e-9)


@pytest.mark.parametrize("case", FLOW_CASES)
def test_lora_starts_at_the_base_its_reference_disables_it_and_export_loads_back(case, tiny_weights, tmp_path):
    from unirl.stages.runtime.config_base import LoraConfig

    fam, bundle = loaded(case, tiny_weights)
    x, cond = inputs(fam, bundle)
    velocity = lambda b=bundle: fam.velocity(b, b.module, x, 0.6, cond, 1.0, None)  # noqa: E731
    with torch.no_grad():
        base = velocity()
        lora = LoraConfig(rank=2, alpha=4)
        fam.add_lora(bundle, lora)
        assert all("lora_" in n for n, p in bundle.module.named_parameters() if p.requires_grad)
        torch.testing.assert_close(velocity(), base, atol=0, rtol=0)
        for name, p in bundle.module.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
        tuned = velocity()
        with fam.reference(bundle):
            torch.testing.assert_close(velocity(), base, atol=0, rtol=0)
    assert not torch.allclose(tuned, base, atol=1e-4)
    fam.export(bundle, tmp_path / "out", bundle.module.state_dict(), lora=lora)
    again = fam.load(tmp_path / "out", fam.config.model_validate(CASES[case]["model"]), "cpu")
    with torch.no_grad():
        torch.testing.assert_close(velocity(again), tuned, atol=1e-5, rtol=1e-4)
    assert not any("lora" in n for n, _ in again.module.named_parameters())
