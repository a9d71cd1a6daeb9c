"""Multimodal (Qwen3-VL) policies: a prompt holds each image as a run of placeholder tokens
(`<|image_pad|>` x n), the image beside them as an `ImageInput` of image-processor patches. Engine
and trainer feed the same patches and explicit mRoPE position ids (`model_inputs`; HF's cached
`rope_deltas` never), and mask vision tokens from sampling alike (`vision_token_ids`)."""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from molt_core.lazy import torch
from molt_core.trajectory import ImageInput

__all__ = ["ImageEncoder", "MessageEncoder", "content_text", "decode_data_uri", "decoder_layers",
           "images_of", "is_vl", "load_model", "load_tokenizer", "model_inputs", "require_chat_template",
           "unpack_rows", "vision_token_ids"]

VISION_PART = "<|vision_start|><|image_pad|><|vision_end|>"   # one image in rendered text


def is_vl(config: Any) -> bool:
    return getattr(config, "vision_config", None) is not None


def load_model(path: str | Path, dtype: torch.dtype) -> torch.nn.Module:
    """The checkpoint's causal LM, or its image-text-to-text model for VL checkpoints."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    auto = AutoModelForImageTextToText if is_vl(AutoConfig.from_pretrained(path)) \
        else AutoModelForCausalLM
    return auto.from_pretrained(path, dtype=dtype)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The transformer blocks of the language model (VL models keep them one level deeper)."""
    return getattr(model.model, "language_model", model.model).layers


def vision_token_ids(config: Any) -> list[int]:
    """Token ids the policy must never sample (image/video placeholders, vision start/end)."""
    if not is_vl(config):
        return []
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return sorted({getattr(config, n) for n in names if getattr(config, n, None) is not None})


def decode_data_uri(url: str) -> Any:
    """`data:image/png;base64,...` -> an RGB PIL image (the server never fetches URLs)."""
    from PIL import Image, UnidentifiedImageError

    head, sep, data = url.partition(",")
    if not (url.startswith("data:image/") and sep and head.endswith(";base64")):
        raise ValueError(f"image_url must be a base64 data URI (data:image/png;base64,...), got "
                         f"'{url[:40]}...': fetching remote images is not supported")
    try:
        return Image.open(io.BytesIO(base64.b64decode(data, validate=True))).convert("RGB")
    except (binascii.Error, UnidentifiedImageError, OSError) as e:
        raise ValueError(f"image_url data URI is not a decodable image: {e}") from None


def images_of(messages: Sequence[dict]) -> list[Any]:
    """The images of chat messages, in order: parts {"type": "image", "image": PIL or HxWx3
    uint8 array} or OpenAI {"type": "image_url", "image_url": {"url": data URI}}."""
    out = []
    for m in messages:
        for part in m.get("content") if isinstance(m.get("content"), list) else ():
            if part.get("type") == "image":
                out.append(part["image"])
            elif part.get("type") == "image_url":
                url = part["image_url"]
                out.append(decode_data_uri(url["url"] if isinstance(url, dict) else url))
    return out


def content_text(content: str | list[dict] | None) -> str:
    """Message content as text without a chat template (image parts as VISION_PART)."""
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(VISION_PART if p.get("type") in ("image", "image_url")
                   else p.get("text", "") for p in content)


def load_tokenizer(path: str, chat_template: str = "") -> Any:
    """The checkpoint's tokenizer; `chat_template` (model.chat_template, a .jinja file) replaces
    its template (e.g. recipes/templates/smollm2_tools.jinja gives SmolLM2 tools)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    if chat_template:
        if not Path(chat_template).is_file():
            raise FileNotFoundError(f"model.chat_template '{chat_template}' is not a file: point "
                                    "it at a .jinja chat template (or leave it empty)")
        tok.chat_template = Path(chat_template).read_text()
    return tok


def require_chat_template(tokenizer: Any, fix: str = "") -> None:
    """Raise ConfigError unless the tokenizer can render chat messages (the gym and chat agents,
    built before anything starts by `trainer.prepare`); `fix`: one more way out."""
    from molt_core.config import ConfigError
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"the tokenizer at '{getattr(tokenizer, 'name_or_path', '?')}' has no "
                          "chat template, which chat agents need to render messages: use an "
                          "instruct/chat checkpoint, or set `chat_template` in its "
                          f"tokenizer_config.json (or a chat_template.jinja file){fix}")


class ImageEncoder:
    """Tokenizes text whose images appear as one `<|image_pad|>` each: every pad becomes the run
    of placeholder tokens its image fills, and the image its `ImageInput` (start relative to the
    returned ids). Uses the checkpoint's image processor (preprocessor_config.json)."""

    def __init__(self, model_path: str | Path, tokenizer: Any) -> None:
        from transformers import AutoConfig, AutoImageProcessor

        config = AutoConfig.from_pretrained(model_path)
        if not is_vl(config):
            raise ValueError(f"model '{model_path}' ({config.model_type}) takes no images: an "
                             "environment or chat message sent an image to a text-only policy")
        self.processor = AutoImageProcessor.from_pretrained(model_path)
        self.tok, self.image_id = tokenizer, config.image_token_id
        self.pad = tokenizer.convert_ids_to_tokens(self.image_id)

    def encode(self, text: str, images: Sequence[Any]) -> tuple[list[int], list[ImageInput]]:
        pieces = text.split(self.pad)
        if len(pieces) - 1 != len(images):
            raise ValueError(f"text has {len(pieces) - 1} image placeholders ({self.pad}) but "
                             f"{len(images)} images were given")
        grids, patches = torch.zeros(0, 3, dtype=torch.long), torch.zeros(0)
        if images:
            out = self.processor(images=list(images), return_tensors="pt")
            grids, patches = out["image_grid_thw"], out["pixel_values"]
        merge = self.processor.merge_size ** 2
        ids: list[int] = []
        result: list[ImageInput] = []
        offset = 0
        for i, piece in enumerate(pieces):
            ids += self.tok(piece, add_special_tokens=False).input_ids
            if i == len(images):
                break
            n_patches = int(grids[i].prod())
            n = n_patches // merge
            result.append(ImageInput(patches[offset:offset + n_patches].clone(),
                                     grids[i].tolist(), len(ids), n))
            offset += n_patches
            ids += [self.image_id] * n
        return ids, result


class MessageEncoder:
    """`encoder(text, messages) -> (ids, images)`: token ids of `text`, the rendering of chat
    `messages`, and the images those hold; the `ImageEncoder` is built at the first image."""

    def __init__(self, tokenizer: Any, model_path: str | Path | None = None) -> None:
        self.tok, self.path, self._images = tokenizer, model_path, None

    def __call__(self, text: str, messages: Sequence[dict]) -> tuple[list[int], list[ImageInput]]:
        if not (images := images_of(messages)):
            return self.tok(text, add_special_tokens=False).input_ids, []
        self._images = self._images or ImageEncoder(
            self.tok.name_or_path if self.path is None else self.path, self.tok)
        return self._images.encode(text, images)


def model_inputs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> dict[str, torch.Tensor]:
    """Forward kwargs for a padded batch [B, T] whose images, in row then appearance order, are
    `pixel_values` [patches, D] and `grid_thw` [images, 3]: the patches and the explicit position
    ids [4, B, T] (text positions, then the three mRoPE rows of `get_rope_index`)."""
    config = model.config
    image_tokens = input_ids == config.image_token_id
    merge = config.vision_config.spatial_merge_size ** 2
    want = int(grid_thw.prod(-1).sum()) // merge
    if int(image_tokens.sum()) != want:
        raise ValueError(f"the batch holds {int(image_tokens.sum())} image placeholder tokens "
                         f"but its {len(grid_thw)} images fill {want}: images and tokens are out "
                         "of step")
    mrope, _ = model.model.get_rope_index(input_ids, image_tokens.int(), image_grid_thw=grid_thw,
                                          attention_mask=attention_mask)
    text = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    return {"position_ids": torch.cat([text[None], mrope]), "pixel_values": pixel_values,
            "image_grid_thw": grid_thw}


def unpack_rows(pixel_values: torch.Tensor, grid: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `trajectory.collate`'s image packing, for a slice of its rows: pixel_values
    [patches, D] and image_grid_thw [images, 3] in row order."""
    pv, grids = [], []
    for b in range(grid.shape[0]):
        g = grid[b][grid[b].prod(-1) > 0]
        pv.append(pixel_values[b, :int(g.prod(-1).sum())])
        grids.append(g)
    return torch.cat(pv), torch.cat(grids)
