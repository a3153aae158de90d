"""What the text policy asks of a Qwen-VL family: a prompt with images -> token ids (the chat
template's image placeholders expanded to one token per merged patch), and a batch of token ids
with its images -> the model's extra inputs (pixel values, patch grids) and its multimodal RoPE
positions.

Positions. Qwen2.5-VL and Qwen3-VL rotate queries and keys by 3-D positions (M-RoPE, one axis
each for time, height and width): an image's tokens get (t0, t0 + row, t0 + col) and the text
after it continues at t0 + max(rows, cols) on all three axes. We compute them with the model's
own `get_rope_index` from `mm_token_type_ids` (1 on image tokens) and pass them explicitly in
the prefill of sampling and in the replay, so both see the same positions (the behaviour check
proves it); a generated token sits one past the largest position of its prefix on every axis
(stages/policies/text_sampling.py `next_positions`), as the model's own `generate` continues
with its cached `rope_deltas`. Without explicit positions Qwen3-VL raises and Qwen2.5-VL falls
back to 1-D positions, which change every log-prob after the image.

The tokenizer of a tiny model is built in code (one token per character plus Qwen's special
tokens and a ChatML chat template with image items), like stages/runtime/tokenizer.py does for
Qwen3; a real checkpoint's tokenizer, chat template and image processor load from its folder.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from unirl.stages.runtime.images import ImageError, decode
from unirl.stages.runtime.tokenizer import load_tokenizer

if TYPE_CHECKING:
    import torch

QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>")

# Qwen's ChatML with image items, without the default system turn (a tiny model has no use for it).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "<|im_start|>{{ message['role'] }}{{ '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}<|im_end|>{{ '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant{{ '\\n' }}{%- endif -%}"
)


def build_vl_tokenizer(charset: str):
    """One token per character of `charset` (plus newline, which the chat template writes), Qwen's
    special tokens, `<|im_end|>` as eos and `<|endoftext|>` as pad, and the chat template above."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # start-up time: tokenizers loads on first use, not when a recipe is read
    from transformers import PreTrainedTokenizerFast  # start-up time: transformers loads on first use, not when a recipe is read

    vocab = {tok: i for i, tok in enumerate(QWEN_SPECIALS + ("<unk>",))}
    for ch in dict.fromkeys(charset + "\n"):
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  unk_token="<unk>", additional_special_tokens=list(QWEN_SPECIALS))
    tok.chat_template = CHAT_TEMPLATE
    return tok


def load_vl_tokenizer(directory: Path):
    """The folder's tokenizer; its chat template from the tokenizer, else the processor's
    `chat_template.json` (how Qwen-VL checkpoints ship it)."""
    tok = load_tokenizer(directory)
    processor_template = Path(directory) / "chat_template.json"
    if not getattr(tok, "chat_template", None) and processor_template.is_file():
        tok.chat_template = json.loads(processor_template.read_text())["chat_template"]
    return tok


def image_processor(patch_size: int, merge_size: int, temporal_patch_size: int, min_pixels: int, max_pixels: int):
    """Qwen's image processor (resize to a multiple of patch x merge within [min, max] pixels,
    normalise, cut into patches), the PIL backend: it needs no torchvision."""
    # start-up time: transformers loads on first use, not when a recipe is read
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=patch_size, merge_size=merge_size, temporal_patch_size=temporal_patch_size,
                                    size={"shortest_edge": min_pixels, "longest_edge": max_pixels})


def load_image_processor(directory: Path):
    from transformers import AutoImageProcessor  # start-up time: transformers loads on first use, not when a recipe is read

    if not (Path(directory) / "preprocessor_config.json").is_file():
        raise FileNotFoundError(f"model.path {directory}: no preprocessor_config.json (a Qwen-VL folder ships its "
                                "image processor's settings there)")
    return AutoImageProcessor.from_pretrained(str(directory))


def grid_of(processor: Any, width: int, height: int) -> tuple[int, int, int]:
    """The (t, h, w) patch grid `processor` cuts a `width` x `height` image into (its own resize rule)."""
    # start-up time: transformers loads on first use, not when a recipe is read
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    patch, merge = processor.patch_size, processor.merge_size
    h, w = smart_resize(height, width, factor=patch * merge, min_pixels=processor.size["shortest_edge"],
                        max_pixels=processor.size["longest_edge"])
    return (1, h // patch, w // patch)


class ImagePrompts:
    """A Qwen-VL bundle's prompts: token ids with image placeholders, decoded images checked
    against their stored grids, and the model inputs of a batch (see the module docstring).
    Without `rope_index` (a folder's tokenizer, processor and config, no weights: `from_folder`)
    it encodes prompts only."""

    def __init__(self, bundle: Any, use_chat: bool, device: torch.device):
        self.tokenizer, self.processor, self.device = bundle.tokenizer, bundle.processor, device
        self.rope_index = getattr(bundle, "rope_index", None)
        config = bundle.config
        self.image_token_id = config.image_token_id
        self.placeholder = self.tokenizer.convert_ids_to_tokens(config.image_token_id)
        self.start = self.tokenizer.convert_ids_to_tokens(config.vision_start_token_id)
        self.end = self.tokenizer.convert_ids_to_tokens(config.vision_end_token_id)
        self.merge = self.processor.merge_size
        self.use_chat = use_chat
        # Tokens that mark where images go: a response holding one would be read as an image slot.
        self.banned = sorted({config.image_token_id, config.video_token_id, config.vision_start_token_id,
                              config.vision_end_token_id})

    @classmethod
    def from_folder(cls, directory: Path, chat_template: bool | None) -> ImagePrompts:
        """The prompts of a model folder without loading its weights: its tokenizer (chat template
        as `model.chat_template` says), image processor and config (the image token ids)."""
        import torch  # start-up time: loaded on first use, not when a recipe is read
        from transformers import AutoConfig

        from unirl.stages.runtime.tokenizer import uses_chat_template

        tokenizer = load_vl_tokenizer(directory)
        parts = SimpleNamespace(tokenizer=tokenizer, processor=load_image_processor(directory),
                                config=AutoConfig.from_pretrained(str(directory)))
        return cls(parts, uses_chat_template(tokenizer, chat_template), torch.device("cpu"))

    def tokens(self, grid: tuple[int, int, int]) -> int:
        """Image tokens of an image with patch grid `grid`: one per merge x merge patches."""
        t, h, w = grid
        return t * h * w // (self.merge * self.merge)

    def encode(self, text: str, grids: list[tuple[int, int, int]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of a user turn showing the images, then `text` (Qwen's order), through the chat
        template when the recipe uses it (given `tools`, function schemas, for an agent's first
        turn); each image placeholder becomes its image's tokens."""
        if self.use_chat:
            content = [{"type": "image"} for _ in grids] + [{"type": "text", "text": text}]
            rendered = self.tokenizer.apply_chat_template([{"role": "user", "content": content}], tools=tools,
                                                          tokenize=False, add_generation_prompt=True)
        else:
            rendered = f"{self.start}{self.placeholder}{self.end}" * len(grids) + text
        pieces = rendered.split(self.placeholder)
        if len(pieces) != len(grids) + 1:
            raise ValueError(f"the chat template wrote {len(pieces) - 1} image placeholders for {len(grids)} images")
        expanded = pieces[0] + "".join(self.placeholder * self.tokens(g) + piece for g, piece in zip(grids, pieces[1:]))
        return self.tokenizer(expanded, add_special_tokens=False).input_ids

    def grids(self, images: list[Any]) -> list[tuple[int, int, int]]:
        return [grid_of(self.processor, im.width, im.height) for im in images]

    def decode(self, pngs: list[bytes], grids: list[tuple[int, int, int]], where: str) -> list[Any]:
        """The stored images, each checked against its stored grid (what the processor makes of it)."""
        images = [decode(png, f"{where}: image {k}") for k, png in enumerate(pngs)]
        for k, (im, stored) in enumerate(zip(images, grids)):
            made = grid_of(self.processor, im.width, im.height)
            if tuple(stored) != made:
                raise ImageError(
                    f"{where}: image {k}: its stored patch grid {tuple(stored)} is not the {made} this model's image "
                    f"processor cuts its {im.width}x{im.height} pixels into; the shard was written for another image "
                    "processor (write the requests again with this model)"
                )
        return images

    def inputs(self, ids: torch.Tensor, attn: torch.Tensor, images: list[list[Any]]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The images of each row (in order), as the model takes them with `ids` / `attn` (B, T):
        ({pixel_values (patches, C*t*p*p), image_grid_thw (images, 3)}, M-RoPE positions (3, B, T))."""
        if self.rope_index is None:
            raise RuntimeError("these image prompts were made from a folder without its model (from_folder): they encode "
                               "prompts, not model inputs")
        flat = [im for row in images for im in row]
        pixels = self.processor(images=flat, return_tensors="pt")
        grid = pixels["image_grid_thw"].to(self.device)
        expected = int(sum(self.tokens(tuple(g)) for g in grid.tolist()))
        found = int((ids == self.image_token_id).sum())
        if found != expected:
            raise ValueError(f"a batch holds {found} image tokens for {len(flat)} images of {expected} tokens")
        positions, _ = self.rope_index(ids, (ids == self.image_token_id).int(), image_grid_thw=grid, attention_mask=attn)
        return {"pixel_values": pixels["pixel_values"].to(self.device), "image_grid_thw": grid}, positions

    def stand_in(self) -> tuple[list[int], list[Any]]:
        """A one-image prompt (a blank image of the processor's smallest size) for a rank without
        samples: every rank must run the vision tower too (FSDP2 gathers its blocks collectively)."""
        from PIL import Image  # start-up time: PIL loads on first use, not when a recipe is read

        side = self.processor.patch_size * self.merge
        image = Image.new("RGB", (side, side), (255, 255, 255))
        return self.encode("", self.grids([image])), [image]
