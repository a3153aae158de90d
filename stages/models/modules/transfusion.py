"""The architecture of the `transfusion` family (stages/models/transfusion.py): a small unified
(text + image) transformer of our own in the Transfusion / BAGEL pattern: one
set of weights is both a causal language model and a flow-matching velocity model, so a unified
family can be tested end to end without BAGEL or HunyuanImage-3 (neither ships in transformers
or diffusers).

    sequence   [ t_0 ... t_{L-1} | x_0 ... x_{N-1} ]     L text tokens, then N = (H/p)*(W/p) patches
    attention  text -> valid text at or before it (causal);
               patch -> every valid text token and every patch (bidirectional within the image);
               text never sees the image, so text hidden states do not depend on it.
    text in    embed_tokens(ids) + text_pos(1-D)            out: lm_head -> next-token logits (B, L, V)
    image in   patch_in(patchify(latents)) + row_pos + col_pos + time_embed(sigma)
               out: velocity_head -> unpatchify -> (B, C, H, W)

Positions are learned absolute embeddings, chosen over RoPE because they need no buffers and so
load like any other weight: text positions count valid tokens (cumsum of the mask), so left or
right padding leaves a sequence's outputs unchanged; image patches get a 2-D (row + column)
embedding, which the text positions never index. sigma in [0, 1] is the flow-matching noise
level: x_sigma = (1 - sigma) * x_0 + sigma * noise, and the velocity is noise - x_0, the
convention of `unirl.stages.diffusion.sde` (x_0 = x - sigma * v).

What stands for which part of the real models:
  * Transfusion (Zhou et al. 2024): the whole recipe -- one transformer, causal over text and
    bidirectional within an image, an LM loss plus a diffusion loss on the same weights, linear
    patchify of VAE latents with the timestep embedding added to every patch.
  * BAGEL: `blocks` is its Qwen2.5 backbone with the understanding and generation experts (MoT)
    collapsed into one shared set of weights; `patch_in` / `velocity_head` are `vae2llm` /
    `llm2vae`; `time_embed` and `row_pos` + `col_pos` are its timestep embedder and latent
    position embedding, added to the latent tokens the same way.
  * HunyuanImage-3: `blocks` is its decoder-only (MoE) LLM, here dense; its generalised causal
    attention (causal text, bidirectional image) is `joint_attention_mask`; its 2-D RoPE for image
    tokens is the learned 2-D embedding here.
No VAE and no tokenizer live here: the model reads latents and token ids.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel


class TransfusionConfig(PretrainedConfig):
    """Sizes of a `TransfusionModel`. `image_size` is the largest latent side (latent pixels, after
    the VAE) the 2-D position table covers; latents may be smaller, in multiples of `patch_size`."""

    model_type = "unirl_transfusion"

    def __init__(self, vocab_size: int = 256, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                 intermediate_size: int = 128, latent_channels: int = 4, patch_size: int = 2,
                 max_text_len: int = 32, image_size: int = 8, rms_norm_eps: float = 1e-6,
                 initializer_range: float = 0.02, **kwargs: Any) -> None:
        if hidden_size % num_heads:
            raise ValueError(f"TransfusionConfig: hidden_size {hidden_size} must be a multiple of num_heads {num_heads}")
        if image_size % patch_size:
            raise ValueError(f"TransfusionConfig: image_size {image_size} must be a multiple of patch_size {patch_size}")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.intermediate_size = intermediate_size
        self.latent_channels = latent_channels
        self.patch_size = patch_size
        self.max_text_len = max_text_len
        self.image_size = image_size
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        super().__init__(**kwargs)


@dataclass
class TransfusionOutput:
    """`text_hidden`: (B, L, D) final-normed text states; `logits`: (B, L, V) or None;
    `velocity`: (B, C, H, W) or None when no latents were given."""

    text_hidden: torch.Tensor
    logits: torch.Tensor | None
    velocity: torch.Tensor | None


def patchify(latents: torch.Tensor, p: int) -> torch.Tensor:
    """latents: (B, C, H, W) -> patches (B, (H/p)*(W/p), C*p*p), raster order (row by row)."""
    b, c, h, w = latents.shape
    x = latents.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // p) * (w // p), c * p * p)


def unpatchify(patches: torch.Tensor, p: int, c: int, h: int, w: int) -> torch.Tensor:
    """patches: (B, (H/p)*(W/p), C*p*p) -> latents (B, C, H, W); the inverse of `patchify`."""
    b = patches.shape[0]
    x = patches.reshape(b, h // p, w // p, c, p, p).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, h, w)


def joint_attention_mask(text_mask: torch.Tensor, num_image: int) -> torch.Tensor:
    """Boolean SDPA mask (B, 1, L+N, L+N), True = may attend, for L text tokens (`text_mask`:
    (B, L), 1 = real token) followed by N image patches. Text is causal over valid text; patches
    see all valid text and all patches. Every query also sees itself, so a padding query's row is
    never empty (an all-False row makes SDPA return NaN); no valid query ever sees padding."""
    b, length = text_mask.shape
    total = length + num_image
    valid = torch.cat([text_mask.bool(), text_mask.new_ones(b, num_image, dtype=torch.bool)], dim=1)
    idx = torch.arange(total, device=text_mask.device)
    is_text_q = idx[:, None] < length
    structure = torch.where(is_text_q, idx[None, :] <= idx[:, None], idx[None, :] < total)
    mask = structure[None] & valid[:, None, :]
    mask = mask | torch.eye(total, dtype=torch.bool, device=text_mask.device)[None]
    return mask[:, None]


def cached_text_mask(attention_mask: torch.Tensor, new: int) -> torch.Tensor:
    """Boolean SDPA mask (B, 1, new, T) of the last `new` text tokens over all T = past + new
    (`attention_mask`: (B, T), 1 = real token): causal over valid tokens, each query sees itself."""
    total = attention_mask.shape[1]
    q = torch.arange(total - new, total, device=attention_mask.device)
    k = torch.arange(total, device=attention_mask.device)
    mask = (k[None, :] <= q[:, None])[None] & attention_mask.bool()[:, None, :]
    return (mask | (k[None, :] == q[:, None])[None])[:, None]


def timestep_embedding(sigma: torch.Tensor, dim: int) -> torch.Tensor:
    """sigma: (B,) in [0, 1] -> (B, dim) sinusoidal features of 1000 * sigma (the SD3 / FLUX scale)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=sigma.device, dtype=torch.float32) / half)
    args = 1000.0 * sigma.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class TransfusionBlock(nn.Module):
    """Pre-norm transformer block: multi-head attention under an explicit boolean mask, then a
    SwiGLU MLP. x: (B, S, D), mask: (B, 1, S, S) -> (B, S, D). One FSDP2 unit."""

    def __init__(self, config: TransfusionConfig) -> None:
        super().__init__()
        d = config.hidden_size
        self.num_heads = config.num_heads
        self.attn_norm = nn.RMSNorm(d, eps=config.rms_norm_eps)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.attn_out = nn.Linear(d, d, bias=False)
        self.mlp_norm = nn.RMSNorm(d, eps=config.rms_norm_eps)
        self.gate_up = nn.Linear(d, 2 * config.intermediate_size, bias=False)
        self.down = nn.Linear(config.intermediate_size, d, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, cache: Any = None, layer: int = 0) -> torch.Tensor:
        """`cache`: a transformers `Cache` holding the keys and values of earlier text tokens (the
        sampler's KV cache); this call's are appended to it, and `mask` covers all of them."""
        b, s, d = x.shape
        q, k, v = (t.transpose(1, 2) for t in self.qkv(self.attn_norm(x)).view(b, s, 3, self.num_heads, d // self.num_heads).unbind(2))
        if cache is not None:
            k, v = cache.update(k, v, layer)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.attn_out(attn.transpose(1, 2).reshape(b, s, d))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class TransfusionModel(PreTrainedModel):
    """One backbone, two heads: `text_logits` (causal LM) and `velocity` (flow matching on latent
    patches conditioned on a text prefix). `forward` runs the joint sequence once and returns both,
    which is what a unified SFT step (LM loss + flow loss, one backward) wants."""

    config_class = TransfusionConfig
    base_model_prefix = "transfusion"
    _no_split_modules = ["TransfusionBlock"]

    def __init__(self, config: TransfusionConfig) -> None:
        super().__init__(config)
        d, p, c = config.hidden_size, config.patch_size, config.latent_channels
        grid = config.image_size // p
        self.embed_tokens: nn.Module = nn.Embedding(config.vocab_size, d)
        self.text_pos = nn.Embedding(config.max_text_len, d)
        self.patch_in = nn.Linear(c * p * p, d)
        self.row_pos = nn.Embedding(grid, d)
        self.col_pos = nn.Embedding(grid, d)
        self.time_embed = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, d))
        self.blocks = nn.ModuleList(TransfusionBlock(config) for _ in range(config.num_layers))
        self.norm = nn.RMSNorm(d, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(d, config.vocab_size, bias=False)
        self.velocity_head = nn.Linear(d, c * p * p)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.embed_tokens = value

    def _embed_text(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -input_ids.shape[1]:]
        if int(position_ids.max()) >= self.config.max_text_len:
            raise ValueError(f"text of {int(position_ids.max()) + 1} tokens is longer than this model's max_text_len "
                             f"{self.config.max_text_len}: truncate the prompt or build the model with a larger max_text_len")
        return self.embed_tokens(input_ids) + self.text_pos(position_ids)

    def _embed_image(self, latents: torch.Tensor, sigma: torch.Tensor | float) -> torch.Tensor:
        cfg = self.config
        b, c, h, w = latents.shape
        p = cfg.patch_size
        if c != cfg.latent_channels or h % p or w % p or h > cfg.image_size or w > cfg.image_size:
            raise ValueError(f"latents of shape {tuple(latents.shape)} cannot be taken by this model: it reads "
                             f"{cfg.latent_channels} channels and sides that are multiples of {p} up to {cfg.image_size}")
        sigma = torch.as_tensor(sigma, device=latents.device, dtype=torch.float32).expand(b)
        rows = torch.arange(h // p, device=latents.device).repeat_interleave(w // p)
        cols = torch.arange(w // p, device=latents.device).repeat(h // p)
        dtype = self.patch_in.weight.dtype
        t = self.time_embed(timestep_embedding(sigma, cfg.hidden_size).to(dtype))
        return self.patch_in(patchify(latents.to(dtype), p)) + self.row_pos(rows) + self.col_pos(cols) + t[:, None]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                latents: torch.Tensor | None = None, sigma: torch.Tensor | float | None = None, *,
                compute_logits: bool = True, position_ids: torch.Tensor | None = None,
                past_key_values: Any = None, use_cache: bool = False) -> TransfusionOutput:
        """input_ids, attention_mask: (B, L) (mask 1 = real token; left or right padding);
        latents: (B, C, H, W) noisy latents at noise level sigma: (B,) or a float in [0, 1].
        Without latents the sequence is text only. Text only, as the language model is called
        (stages/policies/text_sampling.py): `past_key_values` a transformers `Cache` the call
        reads and extends when `use_cache` (then `attention_mask` covers past and new tokens),
        `position_ids` (B, L) the new tokens' positions (default: valid tokens counted)."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        length = input_ids.shape[1]
        cache = past_key_values if use_cache else None
        if cache is not None and latents is not None:
            raise ValueError("a KV cache is for sampling text; the velocity is one forward over text and image")
        x = self._embed_text(input_ids, attention_mask, position_ids)
        if latents is not None:
            if sigma is None:
                raise ValueError("velocity needs the noise level sigma of the latents (a float or (B,) in [0, 1])")
            x = torch.cat([x, self._embed_image(latents, sigma)], dim=1)
        if cache is not None:
            mask = cached_text_mask(attention_mask, length)
        else:
            mask = joint_attention_mask(attention_mask, x.shape[1] - length)
        for layer, block in enumerate(self.blocks):
            x = block(x, mask, cache, layer)
        x = self.norm(x)
        text_hidden = x[:, :length]
        logits = self.lm_head(text_hidden) if compute_logits else None
        velocity = None
        if latents is not None:
            b, c, h, w = latents.shape
            velocity = unpatchify(self.velocity_head(x[:, length:]), self.config.patch_size, c, h, w)
        return TransfusionOutput(text_hidden=text_hidden, logits=logits, velocity=velocity)

    def text_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, attention_mask: (B, L) -> next-token logits (B, L, V); position i predicts
        token i+1 and sees only valid tokens 0..i (a full forward, no KV-cache)."""
        return self(input_ids, attention_mask).logits

    def velocity(self, text_ids: torch.Tensor, text_mask: torch.Tensor | None, latents: torch.Tensor,
                 sigma: torch.Tensor | float) -> torch.Tensor:
        """text_ids, text_mask: (B, L) condition prefix; latents: (B, C, H, W) at noise level sigma
        ((B,) or float in [0, 1]) -> predicted velocity noise - x_0, (B, C, H, W)."""
        # through __call__, not .forward: FSDP2 gathers the sharded weights in its forward hooks
        return self(text_ids, text_mask, latents, sigma, compute_logits=False).velocity


def build_tiny_transfusion(path: str | Path, *, seed: int = 0, vocab_size: int = 256, hidden_size: int = 64,
                           num_layers: int = 2, num_heads: int = 4, intermediate_size: int = 128,
                           latent_channels: int = 4, image_size: int = 8, patch_size: int = 2,
                           max_text_len: int = 32, **config: Any) -> Path:
    """Build a `TransfusionModel` randomly initialised from `seed` (the global RNG is left as it
    was) and save it under `path` (config.json + model.safetensors), which
    `TransfusionModel.from_pretrained(path)` reads like a real checkpoint. The defaults have
    128,016 parameters (vocab 256, hidden 64, 2 layers, 4 heads, 4-channel 8x8 latents, patch 2)."""
    cfg = TransfusionConfig(vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
                            num_heads=num_heads, intermediate_size=intermediate_size,
                            latent_channels=latent_channels, image_size=image_size, patch_size=patch_size,
                            max_text_len=max_text_len, **config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TransfusionModel(cfg)
    root = Path(path)
    model.save_pretrained(root)
    return root


# ---------------------------------------------------------------------------- the `transfusion` family
#
