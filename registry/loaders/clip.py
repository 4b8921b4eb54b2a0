"""Image embeddings from CLIP-family dual encoders (CLIP, SigLIP, ...) with transformers:
images through the vision tower, texts through the text tower, both into one space."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import AutoModel, AutoProcessor

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.registry.loaders.common import place, pretrained_kwargs, require_dir
from modelpool.registry.spec import ModelSpec


class ClipEmbedder:
    def __init__(self, key: str, processor: Any, model: Any, text_padding: str) -> None:
        self.key = key
        self.processor = processor
        self.model = model.eval()
        self.text_padding = text_padding
        config = model.config
        vision = getattr(config, "vision_config", config)
        text = getattr(config, "text_config", None)
        # CLIP projects both towers to projection_dim; SigLIP has no projection and
        # shares the towers' hidden size.
        self.dim = int(getattr(config, "projection_dim", None) or vision.hidden_size)
        self.image_size = int(getattr(vision, "image_size", 0))
        self.text_tower = (text is not None and hasattr(model, "get_text_features")
                           and getattr(processor, "tokenizer", None) is not None)
        self.text_context = int(getattr(text, "max_position_embeddings", 0) or 77)

    def info(self) -> dict[str, Any]:
        return {"dim": self.dim, "image_size": self.image_size, "text_tower": self.text_tower,
                "max_seq_length": self.text_context}

    @torch.inference_mode()
    def embed_images(self, images: Sequence[Image.Image]) -> np.ndarray:
        # The processor expects 3 channels: palette, greyscale, RGBA and CMYK inputs are
        # converted here rather than failing (or being misread) in it.
        rgb = [image if image.mode == "RGB" else image.convert("RGB") for image in images]
        batch = self.processor(images=rgb, return_tensors="pt")
        pixels = batch["pixel_values"].to(self.model.device, self.model.dtype)
        return _normalised(self.model.get_image_features(pixel_values=pixels))

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        return self.embed_counted(texts)[0]

    @torch.inference_mode()
    def embed_counted(self, texts: Sequence[str]) -> tuple[np.ndarray, list[int]]:
        """The vectors, and the tokens each text was read as (usage figures)."""
        if not self.text_tower:
            raise PoolError(ErrorCode.WRONG_CAPABILITY,
                            f"model {self.key!r} has no text tower: it embeds images only")
        # Longer texts are cut at the tower's context (77 tokens for CLIP), as CLIP does.
        batch = self.processor.tokenizer(list(texts), padding=self.text_padding, truncation=True,
                                         max_length=self.text_context, return_tensors="pt")
        vectors = _normalised(self.model.get_text_features(**batch.to(self.model.device)))
        return vectors, batch["attention_mask"].sum(dim=1).tolist()


def _normalised(features: Any) -> np.ndarray:
    """Unit rows as float32, so a dot product is CLIP's cosine similarity."""
    # transformers 5 returns a model output whose pooler_output holds the projected
    # features; 4.x returned the tensor itself.
    if not isinstance(features, torch.Tensor):
        features = features.pooler_output
    features = torch.nn.functional.normalize(features.float(), p=2, dim=-1)
    return features.cpu().numpy()


def load(spec: ModelSpec, model_dir: Path | None) -> ClipEmbedder:
    model_dir = require_dir(spec, model_dir)
    processor = AutoProcessor.from_pretrained(
        model_dir, local_files_only=True, trust_remote_code=spec.trust_remote_code)
    model = place(spec, AutoModel.from_pretrained(model_dir, **pretrained_kwargs(spec)))
    if not hasattr(model, "get_image_features"):
        raise ValueError(f"model {spec.key!r} ({type(model).__name__}) has no image tower "
                         "(get_image_features): not a CLIP-family model")
    # SigLIP was trained on texts padded to the full context; CLIP pools at the end-of-text
    # token and is indifferent, so it pads to the longest text of the batch only.
    default_padding = "max_length" if "siglip" in model.config.model_type else "longest"
    padding = spec.options.get("text_padding", default_padding)
    if padding not in ("longest", "max_length"):
        raise ValueError(f"model {spec.key!r}: text_padding {padding!r} not in "
                         "('longest', 'max_length')")
    return ClipEmbedder(spec.key, processor, model, padding)
