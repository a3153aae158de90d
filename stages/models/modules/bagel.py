"""BAGEL's generation backbone (ByteDance-Seed/Bagel, "Emerging Properties in Unified Multimodal
Pretraining"), written here from its published architecture: a Qwen2 decoder whose every layer
holds two experts of the same shape (mixture of transformers, MoT), one for understanding tokens
(text, and ViT patches when the ViT is attached) and one for generation tokens (noisy VAE latent
patches), sharing one attention over the whole sequence. Module and parameter names follow the
released checkpoint (`language_model.model.layers.N.self_attn.q_proj_moe_gen.weight`, `vae2llm`,
`llm2vae`, `time_embedder.mlp.0.weight`, `latent_pos_embed.pos_embed`), so its `ema.safetensors`
loads by name; the SigLIP NaViT understanding encoder with its connector; the VAE (FLUX.1's).

    sequence   splits of a sample, each `causal` (text) or `noise` (one image's latent patches)
    attention  kv visible to q when (kv <= q, or both in the same noise split), and kv is not in
               another noise split than q's (a noisy image is seen by nothing but itself);
    positions  RoPE on one index per text token; all patches of one image share one index;
    experts    per token: q/k/v/o projections, q/k RMSNorms (head-wise), input and
               post-attention RMSNorms, SwiGLU MLP, final RMSNorm: `*_moe_gen` for latent tokens;
    latents    x_t = (1 - t) x_0 + t noise per 2x2 patch of the VAE latent (t = 1: noise), in
               `vae2llm(x_t) + time_embedder(t) + latent_pos_embed(row * max_latent_size + col)`;
               out: `llm2vae(h)` = the velocity noise - x_0; text out: `language_model.lm_head(h)`.

Tensors are padded batches (B, T, D) with a boolean attention mask (B, T, T), not the packed
sequences of the published training code; `tests/stages/test_bagel.py` checks the outputs
against that code's on the same weights.
"""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP, Qwen2RMSNorm, Qwen2RotaryEmbedding, apply_rotary_pos_emb

GEN = "_moe_gen"  # the suffix of the generation expert's parameters in the released checkpoint


@dataclass
class Split:
    """One part of a sample: `length` tokens, `causal` (text) or `noise` (an image's latent patches)."""

    length: int
    mode: str


def attention_mask(splits: Sequence[Split], total: int | None = None) -> torch.Tensor:
    """(T, T) bool, True where query q may attend to key k, for one sample of `splits` padded to
    `total` tokens (padding attends to itself alone, so its rows stay finite)."""
    n = sum(s.length for s in splits)
    total = n if total is None else total
    seq_id = torch.full((total,), -1)
    noise = torch.zeros(total, dtype=torch.bool)
    start = 0
    for i, s in enumerate(splits):
        if s.mode not in ("causal", "noise", "full"):
            raise ValueError(f"split {i}: attention mode {s.mode!r} (causal, full or noise)")
        if s.mode != "causal":
            seq_id[start:start + s.length] = i
        noise[start:start + s.length] = s.mode == "noise"
        start += s.length
    q, k = torch.arange(total)[:, None], torch.arange(total)[None, :]
    same = (seq_id[:, None] == seq_id[None, :]) & (seq_id[:, None] >= 0)
    allowed = ((k <= q) | same) & ~(noise[None, :] & (seq_id[None, :] != seq_id[:, None]))
    allowed[n:, :] = False
    allowed[:, n:] = False
    allowed[n:, n:] = torch.eye(total - n, dtype=torch.bool)
    return allowed


def expert(owner: nn.Module, name: str) -> nn.Module:
    """`owner`'s submodule `name` (the understanding expert's), or with GEN appended (the generation expert's)."""
    found = getattr(owner, name)
    if not isinstance(found, nn.Module):
        raise TypeError(f"{type(owner).__name__}.{name} is not a module")
    return found


def split_linear(x: torch.Tensor, gen: torch.Tensor, und_layer: nn.Module, gen_layer: nn.Module, width: int) -> torch.Tensor:
    """`und_layer` on the tokens where `gen` is False and `gen_layer` where it is True (x: (N, D), gen: (N,))."""
    out = x.new_zeros(x.shape[0], width)
    out[~gen] = und_layer(x[~gen])
    out[gen] = gen_layer(x[gen])
    return out


class MoTAttention(nn.Module):
    """Qwen2 attention with a second set of projections and q/k norms for generation tokens."""

    def __init__(self, config: Qwen2Config):
        super().__init__()
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        d, q_out, kv_out = config.hidden_size, self.heads * self.head_dim, self.kv_heads * self.head_dim
        for suffix in ("", GEN):
            setattr(self, f"q_proj{suffix}", nn.Linear(d, q_out, bias=True))
            setattr(self, f"k_proj{suffix}", nn.Linear(d, kv_out, bias=True))
            setattr(self, f"v_proj{suffix}", nn.Linear(d, kv_out, bias=True))
            setattr(self, f"o_proj{suffix}", nn.Linear(q_out, d, bias=False))
            norm = (lambda: Qwen2RMSNorm(self.head_dim, eps=config.rms_norm_eps)) if config.qk_norm else nn.Identity
            setattr(self, f"q_norm{suffix}", norm())
            setattr(self, f"k_norm{suffix}", norm())

    def forward(self, x: torch.Tensor, gen: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        flat, g = x.reshape(b * t, -1), gen.reshape(-1)

        def project(name: str, heads: int) -> torch.Tensor:
            width = heads * self.head_dim
            return split_linear(flat, g, expert(self, name), expert(self, name + GEN), width).view(b * t, heads, self.head_dim)

        def normed(states: torch.Tensor, name: str) -> torch.Tensor:
            out = torch.zeros_like(states)
            out[~g] = expert(self, name)(states[~g])
            out[g] = expert(self, name + GEN)(states[g])
            return out.view(b, t, -1, self.head_dim).transpose(1, 2)  # (B, heads, T, head_dim)

        q = normed(project("q_proj", self.heads), "q_norm")
        k = normed(project("k_proj", self.kv_heads), "k_norm")
        v = project("v_proj", self.kv_heads).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        attn = attn.transpose(1, 2).reshape(b * t, self.heads * self.head_dim)
        return split_linear(attn, g, expert(self, "o_proj"), expert(self, "o_proj" + GEN), x.shape[-1]).view(b, t, -1)


class MoTLayer(nn.Module):
    """One decoder layer: pre-norm attention and SwiGLU MLP, each with its generation expert."""

    def __init__(self, config: Qwen2Config):
        super().__init__()
        self.self_attn = MoTAttention(config)
        for suffix in ("", GEN):
            setattr(self, f"mlp{suffix}", Qwen2MLP(config))
            setattr(self, f"input_layernorm{suffix}", Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps))
            setattr(self, f"post_attention_layernorm{suffix}", Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps))

    def forward(self, x: torch.Tensor, gen: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        def both(name: str) -> tuple[nn.Module, nn.Module]:
            return expert(self, name), expert(self, name + GEN)

        x = x + self.self_attn(per_expert(x, gen, *both("input_layernorm")), gen, cos, sin, mask)
        return x + per_expert(per_expert(x, gen, *both("post_attention_layernorm")), gen, *both("mlp"))


def per_expert(x: torch.Tensor, gen: torch.Tensor, und: nn.Module, gen_module: nn.Module) -> torch.Tensor:
    """`und` on the understanding tokens of x (B, T, D), `gen_module` on the generation tokens."""
    return split_linear(x.reshape(-1, x.shape[-1]), gen.reshape(-1), und, gen_module, x.shape[-1]).view(x.shape)


class MoTDecoder(nn.Module):
    """`language_model.model`: token embeddings, the MoT layers, the two final norms, RoPE."""

    def __init__(self, config: Qwen2Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MoTLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm_moe_gen = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen2RotaryEmbedding(config=config)

    def forward(self, x: torch.Tensor, gen: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rotary_emb(x, positions)
        for layer in self.layers:
            x = layer(x, gen, cos, sin, mask)
        return per_expert(x, gen, self.norm, self.norm_moe_gen)


class MoTLanguageModel(nn.Module):
    """`language_model`: the decoder and its output head."""

    def __init__(self, config: Qwen2Config):
        super().__init__()
        self.model = MoTDecoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


class TimestepEmbedder(nn.Module):
    """t in [0, 1] -> sinusoidal features (cos half first, 256 wide) -> Linear, SiLU, Linear."""

    def __init__(self, hidden: int, frequencies: int = 256):
        super().__init__()
        self.frequencies = frequencies
        self.mlp = nn.Sequential(nn.Linear(frequencies, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.frequencies // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t.float()[:, None] * freqs[None]
        return self.mlp(torch.cat([torch.cos(args), torch.sin(args)], dim=-1))


def sincos_2d(side: int, width: int) -> torch.Tensor:
    """(side*side, width) fixed 2-D sin-cos table, row-major (index row * side + col): the first
    half encodes the column, the second the row, each [sin | cos] over width/4 frequencies."""
    quarter = width // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    rows, cols = torch.meshgrid(torch.arange(side, dtype=torch.float64), torch.arange(side, dtype=torch.float64), indexing="ij")

    def axis(pos: torch.Tensor) -> torch.Tensor:
        out = pos.reshape(-1, 1) * omega[None]
        return torch.cat([out.sin(), out.cos()], dim=1)

    return torch.cat([axis(cols), axis(rows)], dim=1).float()


class PositionEmbedding(nn.Module):
    """A frozen 2-D sin-cos table indexed by row * max_side + col (a checkpoint tensor)."""

    def __init__(self, max_side: int, width: int):
        super().__init__()
        self.pos_embed = nn.Parameter(sincos_2d(max_side, width), requires_grad=False)

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        return self.pos_embed[index]


class VisionEmbeddings(nn.Module):
    """Patches (p*p*C, each (p, p, C) flattened, as the released checkpoint's linear patch
    embedding reads them) plus a learned embedding of row * side + col."""

    def __init__(self, channels: int, patch: int, width: int, side: int):
        super().__init__()
        self.patch_embedding = nn.Linear(channels * patch * patch, width)
        self.position_embedding = nn.Embedding(side * side, width)

    def forward(self, patches: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return self.patch_embedding(patches) + self.position_embedding(index)


class VisionLayer(nn.Module):
    """A SigLIP encoder layer: pre-LayerNorm attention over one image's patches, pre-LayerNorm
    GELU (tanh) MLP."""

    def __init__(self, width: int, intermediate: int, heads: int, eps: float):
        super().__init__()
        self.heads = heads
        self.layer_norm1 = nn.LayerNorm(width, eps=eps)
        self.layer_norm2 = nn.LayerNorm(width, eps=eps)
        self.self_attn = nn.Module()
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            self.self_attn.add_module(name, nn.Linear(width, width))
        self.mlp = nn.Module()
        self.mlp.add_module("fc1", nn.Linear(width, intermediate))
        self.mlp.add_module("fc2", nn.Linear(intermediate, width))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        h = self.layer_norm1(x)
        attn = self.self_attn

        def heads(name: str) -> torch.Tensor:
            return expert(attn, name)(h).view(b, n, self.heads, d // self.heads).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads("q_proj"), heads("k_proj"), heads("v_proj"), attn_mask=mask[:, None])
        x = x + expert(attn, "out_proj")(out.transpose(1, 2).reshape(b, n, d))
        return x + expert(self.mlp, "fc2")(F.gelu(expert(self.mlp, "fc1")(self.layer_norm2(x)), approximate="tanh"))


class SiglipNaViT(nn.Module):
    """`vit_model`: SigLIP's vision transformer on images of any size (each its own sequence of
    patches, no resizing to a square), with the released names under `vision_model`. BAGEL's
    checkpoints use learned patch positions (their `rope: false`)."""

    def __init__(self, config: dict[str, Any]):
        super().__init__()
        if config.get("rope", True):
            raise ValueError("vit_config.json: rope true; unirl's BAGEL reads the released checkpoints' learned patch "
                             "positions (rope false)")
        width, patch = config["hidden_size"], config["patch_size"]
        self.patch, self.side = patch, config["image_size"] // patch
        self.vision_model = nn.Module()
        self.vision_model.add_module("embeddings", VisionEmbeddings(config.get("num_channels", 3), patch, width, self.side))
        encoder = nn.Module()
        encoder.add_module("layers", nn.ModuleList(
            VisionLayer(width, config["intermediate_size"], config["num_attention_heads"], config.get("layer_norm_eps", 1e-6))
            for _ in range(config["num_hidden_layers"])))
        self.vision_model.add_module("encoder", encoder)
        self.vision_model.add_module("post_layernorm", nn.LayerNorm(width, eps=config.get("layer_norm_eps", 1e-6)))

    def forward(self, patches: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """patches (B, N, p*p*C), index (B, N) patch positions, valid (B, N) bool -> (B, N, width)."""
        vm = self.vision_model
        x = expert(vm, "embeddings")(patches, index)
        mask = valid[:, :, None] & valid[:, None, :]
        mask = mask | torch.eye(mask.shape[-1], dtype=torch.bool, device=mask.device)  # padding sees itself
        for layer in expert(expert(vm, "encoder"), "layers").children():
            x = layer(x, mask)
        return expert(vm, "post_layernorm")(x)


class Connector(nn.Module):
    """`connector`: ViT width -> LLM width (Linear, GELU tanh, Linear)."""

    def __init__(self, vit_width: int, width: int):
        super().__init__()
        self.fc1 = nn.Linear(vit_width, width)
        self.fc2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


def patchify(image: torch.Tensor, p: int) -> torch.Tensor:
    """(C, H, W) -> (H/p * W/p, p*p*C): row-major patches, each (p, p, C) flattened."""
    c, h, w = image.shape
    return torch.einsum("chpwq->hwpqc", image.reshape(c, h // p, p, w // p, p)).reshape(-1, p * p * c)


def grid_positions(rows: int, cols: int, side: int) -> torch.Tensor:
    """Row-major indices row * side + col of a rows x cols grid in a table `side` wide."""
    return (torch.arange(rows)[:, None] * side + torch.arange(cols)).flatten()


@dataclass
class BagelGeometry:
    """What of BAGEL's own config.json the generation path reads."""

    latent_patch_size: int = 2
    max_latent_size: int = 64
    latent_channels: int = 16  # the VAE's z_channels
    timestep_shift: float = 1.0


class BagelBackbone(nn.Module):
    """The language model with both experts, and the generation path's latent in/out layers."""

    def __init__(self, llm: Qwen2Config, geometry: BagelGeometry, vit: dict[str, Any] | None = None,
                 vit_max_patches_per_side: int = 70):
        super().__init__()
        if not hasattr(llm, "qk_norm"):  # a plain Qwen2Config: BAGEL's checkpoints norm q and k
            llm.qk_norm = True
        self.geometry = geometry
        hidden = llm.hidden_size
        patch_dim = geometry.latent_patch_size ** 2 * geometry.latent_channels
        self.language_model = MoTLanguageModel(llm)
        self.time_embedder = TimestepEmbedder(hidden)
        self.vae2llm = nn.Linear(patch_dim, hidden)
        self.llm2vae = nn.Linear(hidden, patch_dim)
        self.latent_pos_embed = PositionEmbedding(geometry.max_latent_size, hidden)
        self.vit_side = vit_max_patches_per_side
        if vit is not None:  # understanding images: BAGEL's visual_und
            self.vit_model = SiglipNaViT(vit)
            self.connector = Connector(vit["hidden_size"], hidden)
            self.vit_pos_embed = PositionEmbedding(vit_max_patches_per_side, hidden)

    def patchify(self, latent: torch.Tensor) -> torch.Tensor:
        """(C, H, W) latent -> (H/p * W/p, p*p*C) patches, row-major, each (p, p, C) flattened."""
        return patchify(latent, self.geometry.latent_patch_size)

    def embed_latents(self, patches: torch.Tensor, t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """The sequence entries of one image's noisy patches x_t (N, p*p*C) at noise level t."""
        index = grid_positions(rows, cols, self.geometry.max_latent_size).to(patches.device)
        return self.vae2llm(patches) + self.time_embedder(t.reshape(1).expand(patches.shape[0])) + self.latent_pos_embed(index)

    def embed_images(self, images: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The sequence entries of understanding images ((C, H, W) each, sides multiples of the ViT
        patch): ViT patches through the connector, plus the 2-D sin-cos `vit_pos_embed`; one
        (H/p * W/p, D) tensor per image."""
        vit = self.vit_model
        if not isinstance(vit, SiglipNaViT):
            raise TypeError("this BAGEL was built without its ViT (vit_config): it draws, it does not see")
        p = vit.patch
        grids = [(im.shape[1] // p, im.shape[2] // p) for im in images]
        n = max(r * c for r, c in grids)
        patches = torch.zeros(len(images), n, images[0].shape[0] * p * p, device=images[0].device)
        index = torch.zeros(len(images), n, dtype=torch.long, device=images[0].device)
        valid = torch.zeros(len(images), n, dtype=torch.bool, device=images[0].device)
        for i, (im, (r, c)) in enumerate(zip(images, grids)):
            patches[i, :r * c] = patchify(im, p)
            index[i, :r * c] = grid_positions(r, c, self.vit_side)
            valid[i, :r * c] = True
        tokens = expert(self, "connector")(vit(patches, index, valid)) + expert(self, "vit_pos_embed")(index)
        return [tokens[i, :r * c] for i, (r, c) in enumerate(grids)]

    def forward(self, embeds: torch.Tensor, gen: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Last hidden states (B, T, D) of embedded sequences; gen (B, T) marks latent tokens,
        positions (B, T) the RoPE index, mask (B, T, T) what each token sees (`attention_mask`)."""
        return self.language_model.model(embeds, gen, positions, mask)

    def text_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.lm_head(hidden)

    def velocity(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.llm2vae(hidden)


def llm_config(raw: dict[str, Any]) -> Qwen2Config:
    """The language model's Qwen2Config from the released `llm_config.json`, with BAGEL's own keys
    (qk_norm, layer_module) checked: the MoT layers are what this module builds."""
    raw = dict(raw)
    layer = raw.pop("layer_module", "Qwen2MoTDecoderLayer")
    if layer != "Qwen2MoTDecoderLayer":
        raise ValueError(f"llm_config.json: layer_module {layer!r}; unirl's BAGEL builds the MoT layers "
                         "(Qwen2MoTDecoderLayer) of the released checkpoints")
    qk_norm = bool(raw.pop("qk_norm", True))
    for key in ("freeze_und", "_attn_implementation", "architectures", "model_type", "torch_dtype", "transformers_version"):
        raw.pop(key, None)
    config = Qwen2Config(**raw)
    config.qk_norm = qk_norm
    return config


@dataclass
class AutoencoderGeometry:
    """BAGEL's VAE (FLUX.1's autoencoder, `ae.safetensors`): the released one is ch 128, ch_mult
    (1, 2, 4, 4), 2 res blocks, 16 latent channels, scale 0.3611, shift 0.1159."""

    ch: int = 128
    ch_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    z_channels: int = 16
    scale_factor: float = 0.3611
    shift_factor: float = 0.1159


def autoencoder(state: dict[str, torch.Tensor], geometry: AutoencoderGeometry) -> Any:
    """A diffusers AutoencoderKL holding the weights of BAGEL's `ae.safetensors` (original FLUX/LDM
    tensor names, converted by diffusers' own single-file mapping), with its scale and shift: its
    latents are `(mean - shift) * scale` as BAGEL's `AutoEncoder.encode` (without sampling) gives."""
    from diffusers import AutoencoderKL  # start-up time: diffusers loads when a BAGEL VAE is built
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint  # start-up time: as above

    levels = len(geometry.ch_mult)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * levels,
                        up_block_types=["UpDecoderBlock2D"] * levels,
                        block_out_channels=[geometry.ch * m for m in geometry.ch_mult], layers_per_block=geometry.num_res_blocks,
                        latent_channels=geometry.z_channels, norm_num_groups=32, use_quant_conv=False, use_post_quant_conv=False,
                        scaling_factor=geometry.scale_factor, shift_factor=geometry.shift_factor)
    converted = convert_ldm_vae_checkpoint(dict(state), vae.config)
    missing, unexpected = vae.load_state_dict(converted, strict=False)
    if missing or unexpected:
        raise ValueError(f"ae.safetensors: {len(missing)} tensors missing (first: {sorted(missing)[:3]}), {len(unexpected)} "
                         f"unexpected (first: {sorted(unexpected)[:3]}) for the VAE geometry {geometry}")
    return vae


def encode_latents(vae: Any, images: torch.Tensor) -> torch.Tensor:
    """Images in [-1, 1] (B, 3, H, W) -> BAGEL's latents (the posterior mean, shifted and scaled)."""
    mean = vae.encode(images).latent_dist.mean
    return (mean - vae.config.shift_factor) * vae.config.scaling_factor


def decode_latents(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    """BAGEL's latents -> images in about [-1, 1]."""
    return vae.decode(latents / vae.config.scaling_factor + vae.config.shift_factor).sample


# The released folder (ByteDance-Seed/BAGEL-7B-MoT): what its own loader (app.py, inferencer)
# reads, with the settings it applies on top of the files.
FILES = ("llm_config.json", "vit_config.json", "ae.safetensors", "ema.safetensors")
RELEASED = {"latent_patch_size": 2, "max_latent_size": 64, "vit_max_patches_per_side": 70}


def folder_configs(folder: Any) -> tuple[Qwen2Config, dict[str, Any]]:
    """The language model's and the ViT's configs of a BAGEL folder, as its loader sets them: the
    MoT layers with q/k norms and an untied head; the ViT with learned positions and one layer
    fewer than vit_config.json lists (BAGEL reads the penultimate SigLIP layer)."""
    root = Path(folder)
    missing = [name for name in FILES if not (root / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{root}: not a BAGEL folder, missing {', '.join(missing)} (the released layout: "
                                f"{', '.join(FILES)} and the Qwen2 tokenizer files)")
    raw = json.loads((root / "llm_config.json").read_text())
    llm = llm_config({**raw, "qk_norm": True, "tie_word_embeddings": False, "layer_module": "Qwen2MoTDecoderLayer"})
    vit = json.loads((root / "vit_config.json").read_text())
    vit = {**vit, "rope": False, "num_hidden_layers": int(vit["num_hidden_layers"]) - 1}
    return llm, vit


def load_folder(folder: Any, ae: AutoencoderGeometry | None = None, device: Any = "cpu") -> tuple[BagelBackbone, Any]:
    """BAGEL from its released folder: the backbone with every tensor of ema.safetensors loaded by
    name (a tensor missing or left over is an error naming it), and the VAE of ae.safetensors."""
    root = Path(folder)
    llm, vit = folder_configs(root)
    ae = ae or AutoencoderGeometry()
    geometry = BagelGeometry(latent_patch_size=RELEASED["latent_patch_size"], max_latent_size=RELEASED["max_latent_size"],
                             latent_channels=ae.z_channels)
    model = BagelBackbone(llm, geometry, vit=vit, vit_max_patches_per_side=RELEASED["vit_max_patches_per_side"])
    state = load_file(str(root / "ema.safetensors"), device=str(device))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if "rotary_emb" not in k]
    if missing or unexpected:
        raise ValueError(f"{root / 'ema.safetensors'}: {len(missing)} tensors of the model missing (first: {missing[:3]}), "
                         f"{len(unexpected)} not the model's (first: {unexpected[:3]}); is it BAGEL's MoT checkpoint?")
    vae = autoencoder(load_file(str(root / "ae.safetensors"), device=str(device)), ae)
    return model.to(device), vae.to(device)


def save_folder(folder: Any, model: BagelBackbone, llm: dict[str, Any], vit: dict[str, Any], ae_state: dict[str, torch.Tensor]) -> None:
    """Write a BAGEL folder in the released layout (a tiny seeded one for tests): the configs as the
    loader reads them (vit_config.json lists one layer more than the model runs), ema.safetensors
    under the released names, ae.safetensors in the original FLUX layout."""
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    (root / "llm_config.json").write_text(json.dumps(llm, indent=2))
    (root / "vit_config.json").write_text(json.dumps({**vit, "num_hidden_layers": int(vit["num_hidden_layers"]) + 1}, indent=2))
    state = {k: v.contiguous() for k, v in model.state_dict().items() if "rotary_emb" not in k}
    save_file(state, str(root / "ema.safetensors"))
    save_file({k: v.contiguous() for k, v in ae_state.items()}, str(root / "ae.safetensors"))
