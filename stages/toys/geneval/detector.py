"""A deterministic toy-GenEval detector: colour blobs -> shapes -> the GenEval-style score.

Pixels go to the nearest palette colour (or the background, or nowhere when far from all);
4-connected components of one colour are objects. An object's shape comes from two features of
its mask inside its bounding box that survive blur (a generated or VAE-decoded blob has soft
edges, which pulls a triangle's fill of ~0.5 up to a circle's ~0.75): `taper`, the mass of the
top half over the bottom half (an apex-up triangle ~0.3, circles and squares ~1), and `corners`,
how full the four corner cells are (a square ~1, a circle ~0.1). Numpy only, no model.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from unirl.stages.toys.geneval.dataset import BACKGROUND, COLOURS, RELATIONS, PromptSpec, parse_prompt

COLOUR_NAMES = tuple(COLOURS)
# A pixel farther than this (RGB Euclidean) from every palette colour and the background is
# treated as unknown: it joins no object.
MAX_COLOUR_DISTANCE = 110.0
# Shape thresholds, midway between the classes on VAE-reconstructed renders (taper: triangles
# 0.38-0.47, circles and squares 0.95-1.04; corners: circles 0-0.25, squares 0.88-1).
TRIANGLE_MAX_TAPER = 0.7
SQUARE_MIN_CORNERS = 0.6
# Centres closer than this fraction of the two objects' summed extent, along an axis, do not
# count as offset along that axis.
POSITION_SLACK = 0.1


@dataclass(frozen=True)
class Blob:
    """One detected object. `bbox` = (x0, y0, x1, y1), inclusive pixel coordinates; `fill`: area
    over bbox area; `taper` and `corners`: the shape features (module docstring)."""

    colour: str
    shape: str
    area: int
    bbox: tuple[int, int, int, int]
    fill: float
    taper: float
    corners: float


@dataclass(frozen=True)
class GenEvalScore:
    """`strict` is 1.0 only when every criterion holds; the components are fractions in [0, 1]
    over the prompt's object groups (`position` is 1.0 for prompts without a relation)."""

    strict: float
    object: float
    colour: float
    count: float
    position: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def _to_rgb(image: Any) -> np.ndarray:
    if hasattr(image, "convert"):
        image = image.convert("RGB")
    arr = np.asarray(image)
    if arr.ndim != 3 or arr.shape[-1] != 3:
        raise ValueError(f"expected an RGB image (H, W, 3), got shape {arr.shape}")
    return arr.astype(np.float32)


def classify_pixels(rgb: np.ndarray) -> np.ndarray:
    """rgb (H, W, 3) -> (H, W) int: index into COLOUR_NAMES, or -1 (background or unknown)."""
    palette = np.array([COLOURS[c] for c in COLOUR_NAMES] + [BACKGROUND], dtype=np.float32)
    dist = np.linalg.norm(rgb[:, :, None, :] - palette[None, None], axis=-1)
    nearest = dist.argmin(-1)
    ok = (nearest < len(COLOUR_NAMES)) & (dist.min(-1) <= MAX_COLOUR_DISTANCE)
    return np.where(ok, nearest, -1)


def connected_components(mask: np.ndarray) -> tuple[np.ndarray, int]:
    """4-connected components of a boolean (H, W) mask -> (labels (H, W), n); labels are 0..n-1
    inside the mask and -1 outside. Min-label propagation with pointer jumping."""
    h, w = mask.shape
    none = h * w
    labels = np.where(mask, np.arange(none).reshape(h, w), none)
    while True:
        new = labels.copy()
        np.minimum(new[1:], labels[:-1], out=new[1:])
        np.minimum(new[:-1], labels[1:], out=new[:-1])
        np.minimum(new[:, 1:], labels[:, :-1], out=new[:, 1:])
        np.minimum(new[:, :-1], labels[:, 1:], out=new[:, :-1])
        new = np.where(mask, new, none)
        # A label is the flat index of a pixel in the same component: follow it (jumping).
        flat = np.append(new.ravel(), none)
        new = np.where(mask, flat[new], none)
        if np.array_equal(new, labels):
            break
        labels = new
    roots, dense = np.unique(labels[mask], return_inverse=True)
    out = np.full((h, w), -1, dtype=np.int64)
    out[mask] = dense
    return out, len(roots)


def shape_features(mask: np.ndarray) -> tuple[float, float]:
    """(taper, corners) of a boolean mask cropped to its bounding box (module docstring)."""
    h, w = mask.shape
    top, bottom = mask[: h // 2].sum(), mask[(h + 1) // 2 :].sum()
    k = max(1, round(min(h, w) / 4))
    cells = (mask[:k, :k], mask[:k, -k:], mask[-k:, :k], mask[-k:, -k:])
    return float(top / max(bottom, 1)), float(np.mean([c.mean() for c in cells]))


def shape_of(taper: float, corners: float) -> str:
    if taper < TRIANGLE_MAX_TAPER:
        return "triangle"
    return "square" if corners >= SQUARE_MIN_CORNERS else "circle"


def detect(image: Any, *, min_area: int | None = None) -> list[Blob]:
    """Objects in an RGB image (PIL or array (H, W, 3)). Components smaller than `min_area`
    (default 0.6% of the image, at least 4 px) are noise."""
    rgb = _to_rgb(image)
    h, w = rgb.shape[:2]
    if min_area is None:
        min_area = max(4, round(0.006 * h * w))
    classes = classify_pixels(rgb)
    blobs = []
    for ci, colour in enumerate(COLOUR_NAMES):
        labels, n = connected_components(classes == ci)
        areas = np.bincount(labels[labels >= 0], minlength=n)
        for k in np.flatnonzero(areas >= min_area):  # specks are skipped before any per-pixel work
            ys, xs = np.nonzero(labels == k)
            x0, x1, y0, y1 = int(xs.min()), int(xs.max()), int(ys.min()), int(ys.max())
            box = labels[y0 : y1 + 1, x0 : x1 + 1] == k
            taper, corners = shape_features(box)
            blobs.append(Blob(colour, shape_of(taper, corners), int(areas[k]), (x0, y0, x1, y1), float(box.mean()),
                              taper, corners))
    return blobs


def relations(box_a: tuple[int, ...], box_b: tuple[int, ...]) -> set[str]:
    """The relations of A to B (subset of RELATIONS) from two (x0, y0, x1, y1) boxes, y down.
    Each axis offset of the centres is first shrunk by POSITION_SLACK x the summed extents; an
    axis counts when it carries more than half of the shrunk offset's direction (so a diagonal
    placement holds two relations, and centres that nearly coincide hold none)."""
    ca = np.array([(box_a[0] + box_a[2]) / 2, (box_a[1] + box_a[3]) / 2])
    cb = np.array([(box_b[0] + box_b[2]) / 2, (box_b[1] + box_b[3]) / 2])
    extent = np.array([box_a[2] - box_a[0] + box_b[2] - box_b[0] + 2, box_a[3] - box_a[1] + box_b[3] - box_b[1] + 2])
    offset = ca - cb
    shrunk = np.sign(offset) * np.maximum(np.abs(offset) - POSITION_SLACK * extent, 0.0)
    norm = float(np.linalg.norm(shrunk))
    if norm < 1e-6:
        return set()
    dx, dy = shrunk / norm
    out = set()
    if dx < -0.5:
        out.add(RELATIONS[0])
    if dx > 0.5:
        out.add(RELATIONS[1])
    if dy < -0.5:
        out.add(RELATIONS[2])
    if dy > 0.5:
        out.add(RELATIONS[3])
    return out


def score_blobs(blobs: list[Blob], spec: PromptSpec) -> GenEvalScore:
    """Per group: object = some blob has the shape; colour = some blob has shape and colour;
    count = exactly `count` blobs have shape and colour. Position: some matching pair of blobs
    stands in the relation. Components average over groups; strict = all criteria hold."""
    checks: dict[str, list[bool]] = {"object": [], "colour": [], "count": []}
    matches = []
    for obj in spec.objects:
        same = [b for b in blobs if b.shape == obj.shape and b.colour == obj.colour]
        matches.append(same)
        checks["object"].append(any(b.shape == obj.shape for b in blobs))
        checks["colour"].append(bool(same))
        checks["count"].append(len(same) == obj.count)
    position = True
    if spec.relation is not None:
        position = any(spec.relation in relations(a.bbox, b.bbox) for a in matches[0] for b in matches[1])
    parts = {k: float(np.mean(v)) for k, v in checks.items()}
    strict = all(all(v) for v in checks.values()) and position
    return GenEvalScore(float(strict), parts["object"], parts["colour"], parts["count"], float(position))


def score(image: Any, prompt: str | PromptSpec) -> GenEvalScore:
    """GenEval-style score of one image against one prompt (text or parsed spec)."""
    spec = prompt if isinstance(prompt, PromptSpec) else parse_prompt(prompt)
    return score_blobs(detect(image), spec)
