"""The slim verifier's routing mask: which sub-layers of the target ``q'`` skips, as a pinned artifact.

A :class:`SlimMask` is a set of ``(layer, "attn"|"mlp")`` sub-layers to bypass; every weight stays
shared with the target, so ``model(tokens, slots, skip=mask.skip)`` *is* the slim verifier. Layer 0
is never skipped (its attention turns token embeddings into contextual states; every later layer
depends on it, and skipping it destroys agreement).

On disk a mask is a folder (``mask.json`` + ``checksum.json``, and a human ``report.md``) so it can
ship inside the package like the EAGLE-3 head: ``load_mask("slim-smollm2")`` finds
``hvd_ray/assets/slim-smollm2``. ``mask.json`` carries a format version, the model id, the model's
content hash (``model_revision``) and the layer count; ``checksum.json`` pins the SHA-256 of
``mask.json``'s bytes, so an edited or truncated artifact is refused rather than silently used.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUBS = ("attn", "mlp")
FORMAT_VERSION = 1
MASK_FILE = "mask.json"
CHECKSUM_FILE = "checksum.json"
ASSETS = Path(__file__).resolve().parents[1] / "assets"
# Names that load_mask resolves to shipped artifacts (model name -> asset folder).
SHIPPED = {"slim-smollm2": "slim-smollm2", "default": "slim-smollm2", "SmolLM2-135M-Instruct": "slim-smollm2"}

SubLayer = tuple[int, str]


class MaskError(ValueError):
    """A mask or mask artifact that cannot be used as asked (the message says why)."""


@dataclass(frozen=True)
class SlimMask:
    """Sub-layers to skip in an ``n_layers`` target. ``skip`` is sorted and duplicate-free.

    ``model_id`` / ``model_revision`` name the target the mask was searched on (None for a mask
    built by hand); ``meta`` holds the search's provenance (budget, objective, figures) and does not
    take part in equality.
    """

    n_layers: int
    skip: tuple[SubLayer, ...] = ()
    model_id: str | None = None
    model_revision: str | None = None
    meta: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.n_layers, int) or self.n_layers < 1:
            raise MaskError(f"n_layers must be a positive int, got {self.n_layers!r}")
        items = []
        for s in self.skip:
            try:
                layer, sub = int(s[0]), str(s[1])
            except (TypeError, ValueError, IndexError):
                raise MaskError(f"bad sub-layer {s!r}; expected (layer, 'attn'|'mlp')") from None
            if sub not in SUBS:
                raise MaskError(f"bad sub-layer kind {sub!r} in {s!r}; expected one of {SUBS}")
            if not 0 <= layer < self.n_layers:
                raise MaskError(f"layer {layer} out of range for a {self.n_layers}-layer model")
            if layer == 0:
                raise MaskError("layer 0 is always kept; a slim mask cannot skip it")
            items.append((layer, sub))
        if len(set(items)) != len(items):
            raise MaskError(f"duplicate sub-layers in {items}")
        object.__setattr__(self, "skip", tuple(sorted(items, key=lambda x: (x[0], SUBS.index(x[1])))))

    # ------------------------------------------------------------------------------ views
    @property
    def skipped(self) -> list[SubLayer]:
        """The list to pass as ``Transformer.forward(skip=...)``."""
        return list(self.skip)

    @property
    def kept(self) -> list[SubLayer]:
        s = set(self.skip)
        return [(i, k) for i in range(self.n_layers) for k in SUBS if (i, k) not in s]

    @staticmethod
    def candidates(n_layers: int) -> list[SubLayer]:
        """Every sub-layer a mask may skip (all but layer 0's): ``2 * (n_layers - 1)`` of them."""
        return [(i, k) for i in range(1, n_layers) for k in SUBS]

    def bits(self) -> list[int]:
        """1 = skipped, over :meth:`candidates` order."""
        s = set(self.skip)
        return [int(c in s) for c in self.candidates(self.n_layers)]

    @classmethod
    def from_bits(cls, n_layers: int, bits: Sequence[int], **kw: Any) -> SlimMask:
        cands = cls.candidates(n_layers)
        if len(bits) != len(cands):
            raise MaskError(f"expected {len(cands)} bits for {n_layers} layers, got {len(bits)}")
        return cls(n_layers, tuple(c for c, b in zip(cands, bits) if b), **kw)

    def spec(self) -> str:
        """Compact text form, e.g. ``"attn:3-5,attn:9,mlp:12"`` (round-trips through :meth:`parse`)."""
        parts = []
        for sub in SUBS:
            layers = [i for i, k in self.skip if k == sub]
            run: list[int] = []
            for i in layers + [None]:  # type: ignore[list-item]
                if run and (i is None or i != run[-1] + 1):
                    parts.append(f"{sub}:{run[0]}" + (f"-{run[-1]}" if len(run) > 1 else ""))
                    run = []
                if i is not None:
                    run.append(i)
        return ",".join(parts)

    @classmethod
    def parse(cls, spec: str, n_layers: int, **kw: Any) -> SlimMask:
        """``"attn:10-17,mlp:20,layer:5"`` -> mask (``layer:i`` skips both sub-layers; ``""`` = none)."""
        items: list[SubLayer] = []
        for part in filter(None, (p.strip() for p in spec.split(","))):
            kind, _, rng = part.partition(":")
            a, _, b = rng.partition("-")
            if kind not in ("attn", "mlp", "layer") or not a.strip().isdigit() or (b and not b.strip().isdigit()):
                raise MaskError(f"bad mask spec {part!r}; expected e.g. attn:10-17, mlp:20 or layer:5")
            lo, hi = int(a), int(b or a)
            if hi < lo:
                raise MaskError(f"bad range in {part!r}")
            for i in range(lo, hi + 1):
                items += [(i, "attn"), (i, "mlp")] if kind == "layer" else [(i, kind)]
        return cls(n_layers, tuple(items), **kw)

    def check(self, model: Any) -> None:
        """Refuse a mask made for a different layer count (``model`` is a Transformer or its cfg)."""
        cfg = getattr(model, "cfg", model)
        if cfg.n_layers != self.n_layers:
            raise MaskError(f"mask is for a {self.n_layers}-layer model, this model has {cfg.n_layers} layers")

    # ------------------------------------------------------------------------------- json
    def to_json(self) -> dict:
        return {
            "format": "hvd_ray.slim_mask",
            "version": FORMAT_VERSION,
            "model_id": self.model_id,
            "model_revision": self.model_revision,
            "n_layers": self.n_layers,
            "skip": [[i, k] for i, k in self.skip],
            "spec": self.spec(),
            "meta": self.meta,
        }

    @classmethod
    def from_json(cls, d: dict) -> SlimMask:
        if d.get("format") != "hvd_ray.slim_mask":
            raise MaskError("not a slim-mask artifact (format field missing or wrong)")
        if d.get("version") != FORMAT_VERSION:
            raise MaskError(
                f"slim-mask format version {d.get('version')!r} is not supported "
                f"(this hvd_ray reads version {FORMAT_VERSION})"
            )
        try:
            return cls(
                int(d["n_layers"]),
                tuple((int(i), str(k)) for i, k in d["skip"]),
                d.get("model_id"),
                d.get("model_revision"),
                dict(d.get("meta") or {}),
            )
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, MaskError):
                raise
            raise MaskError(f"malformed slim-mask artifact: {e!r}") from None


def save_mask(mask: SlimMask, folder: str | Path) -> Path:
    """Write ``mask.json`` and its ``checksum.json`` into ``folder`` (created); returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    data = (json.dumps(mask.to_json(), indent=1, sort_keys=True) + "\n").encode()
    (folder / MASK_FILE).write_bytes(data)
    pin = {
        "sha256": hashlib.sha256(data).hexdigest(),
        "file": MASK_FILE,
        "model_id": mask.model_id,
        "n_layers": mask.n_layers,
    }
    (folder / CHECKSUM_FILE).write_text(json.dumps(pin, indent=1) + "\n")
    return folder


def mask_folder(name_or_path: str | Path) -> Path:
    """A shipped mask name (``"slim-smollm2"``, ``"default"``) or a folder / ``mask.json`` path -> folder."""
    key = str(name_or_path)
    if key in SHIPPED:
        folder = ASSETS / SHIPPED[key]
        if not (folder / MASK_FILE).is_file():
            raise MaskError(f"no slim mask is shipped under {folder}; run jobs/search_slim.py and pass its --out")
        return folder
    p = Path(name_or_path).expanduser()
    if p.is_file() and p.name == MASK_FILE:
        return p.parent
    if p.is_dir() and (p / MASK_FILE).is_file():
        return p
    raise MaskError(f"slim mask {key!r} not found: expected a folder with {MASK_FILE} or one of {sorted(SHIPPED)}")


def load_mask(name_or_path: str | Path, model: Any = None, *, model_revision: str | None = None) -> SlimMask:
    """Load and verify a mask artifact: checksum, format version, and (if given) the target.

    ``model`` (a Transformer or ModelConfig) must have the mask's layer count; ``model_revision``
    (see ``hvd_ray.traces.model_info.model_revision``), when given and recorded, must match.
    """
    folder = mask_folder(name_or_path)
    data = (folder / MASK_FILE).read_bytes()
    pin_file = folder / CHECKSUM_FILE
    if not pin_file.is_file():
        raise MaskError(f"{folder} has no {CHECKSUM_FILE}; refusing an unpinned mask")
    try:
        pin = json.loads(pin_file.read_text())
        want = pin["sha256"]
    except (ValueError, KeyError):
        raise MaskError(f"{pin_file} is not a valid checksum file") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != want:
        raise MaskError(f"slim mask {folder / MASK_FILE} fails its checksum ({digest} != {want})")
    try:
        mask = SlimMask.from_json(json.loads(data))
    except json.JSONDecodeError as e:
        raise MaskError(f"{folder / MASK_FILE} is not valid JSON: {e}") from None
    if model is not None:
        mask.check(model)
    if model_revision and mask.model_revision and model_revision != mask.model_revision:
        raise MaskError(
            f"mask was searched on model revision {mask.model_revision[:12]}…, this model is {model_revision[:12]}…"
        )
    return mask


def as_mask(x: SlimMask | Iterable[SubLayer] | str, n_layers: int) -> SlimMask:
    """A SlimMask from a mask, a skip list, or a spec string."""
    if isinstance(x, SlimMask):
        return x
    if isinstance(x, str):
        return SlimMask.parse(x, n_layers)
    return SlimMask(n_layers, tuple(x))


def shipped_mask(model: Any = None) -> SlimMask:
    """The DIMR mask searched for the default model (``hvd_ray/assets/slim-smollm2``), checksum-pinned."""
    return load_mask("slim-smollm2", model)


# ------------------------------------------------------------------- the engine's slim mask
def resolve_mask(mask: str | Path | SlimMask | Sequence[SubLayer] | None, n_layers: int) -> list[SubLayer]:
    """The slim verifier's skipped sub-layers (what ``SlimTier`` takes) from: a ``SlimMask`` or a list
    of ``(layer, kind)``; ``"default"`` / None (the shipped DIMR mask when it fits, else
    ``layerskip.default_skip``); ``"layerskip"`` (``default_skip``); a mask artifact (folder,
    ``mask.json`` or shipped name, checksum-verified by ``load_mask``); or a skip spec
    (``"attn:10-17,mlp:20"``). Here, not in ``verification``: the names need the drafters and DIMR."""
    from ..drafters.layerskip import default_skip, parse_skip
    from ..verification.tiered import check_mask

    if mask is None or (isinstance(mask, str) and mask == "default"):
        skip = _shipped(n_layers) or default_skip(n_layers)
    elif isinstance(mask, str) and mask == "layerskip":
        skip = default_skip(n_layers)
    elif isinstance(mask, (str, Path)):
        skip = _load_artifact(str(mask))
        if skip is None:
            skip = parse_skip(str(mask))
    else:
        skip = list(getattr(mask, "skip", mask))
    return check_mask(skip, n_layers)


def describe_mask(mask: str | Path | SlimMask | Sequence[SubLayer] | None, n_layers: int) -> str:
    """Where ``resolve_mask`` takes this mask from, for reports."""
    if mask is None or mask == "default":
        return "shipped DIMR mask" if _shipped(n_layers) else "layerskip.default_skip (no DIMR mask shipped)"
    return str(mask) if isinstance(mask, (str, Path)) else "explicit list"


def _shipped(n_layers: int) -> list[SubLayer] | None:
    """The shipped DIMR mask for a model of ``n_layers`` layers, if one is shipped."""
    try:
        m = load_mask("default")
    except MaskError:
        return None
    return list(m.skip) if m.n_layers == n_layers else None


def _load_artifact(spec: str) -> list[SubLayer] | None:
    """A ``SlimMask`` artifact's skip list; None when ``spec`` is no artifact (a skip spec)."""
    try:
        return list(load_mask(spec).skip)
    except MaskError as e:
        looks_like_spec = all(p.strip().split(":")[0] in ("attn", "mlp", "layer") for p in spec.split(",") if p.strip())
        if looks_like_spec and not Path(spec).exists():
            return None
        raise ValueError(str(e)) from None
