"""How an image becomes a model's input: the preprocessing its pretrained weights were made with.

torchvision's weights each carry their own (`Weights.transforms()`): the validation resize as a
share of the crop (8/7 for most, 232/224 for ResNet-50's second weights, 1 for the SWAG weights),
the interpolation (bicubic for ViT's SWAG weights, Swin, MaxViT, EfficientNet) and the mean and
std (0.5 for EfficientNetV2-L's, 1/255 for VGG-16's feature weights). Fine-tuned with another
preprocessing, a model loses accuracy without a word. So a run takes its weights' (random init
and a state_dict URI: torchvision's usual, `Preprocessing()`), applies it at the run's own
`training.image_size` to training's crop and validation's resize and crop, and writes it to
model.json, whence batch-predict, the champion's scoring and the logged MLflow model read it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict
from torchvision.transforms import InterpolationMode

# torchvision's ImageNet statistics: most pretrained backbones expect inputs normalised by them.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# Validation resizes the shorter side to 8/7 of the crop, then crops the centre: torchvision's
# reference sizes (256 for a crop of 224), and its usual weights'.
RESIZE_PER_CROP = 8 / 7
# What a card written before the resize was recorded was validated with.
OLD_CARDS_RESIZE_PER_CROP = 1.14


class Preprocessing(BaseModel):
    """The size-free part of a weight's preprocessing, applied at any crop side."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    resize_per_crop: float = RESIZE_PER_CROP
    interpolation: Literal["bilinear", "bicubic"] = "bilinear"  # every torchvision classifier weight's is one of them
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD

    @property
    def mode(self) -> InterpolationMode:
        return InterpolationMode(self.interpolation)

    def resize(self, image_size: int) -> int:
        """The shorter side validation resizes to before its centre crop of `image_size`.

        >>> [Preprocessing().resize(side) for side in (224, 448, 1024)]
        [256, 512, 1170]
        """
        return round(image_size * self.resize_per_crop)

    def card(self, image_size: int) -> dict[str, Any]:
        """model.json's preprocessing fields for a model trained at `image_size`."""
        return {"image_size": image_size, "resize": self.resize(image_size), "mean": self.mean, "std": self.std,
                "interpolation": self.interpolation}

    @classmethod
    def of_card(cls, card: dict[str, Any]) -> Preprocessing:
        """The preprocessing model.json records; a card written before a field was: what its model had."""
        side = card["image_size"]
        return cls(resize_per_crop=(card.get("resize") or int(side * OLD_CARDS_RESIZE_PER_CROP)) / side,
                   interpolation=card.get("interpolation", "bilinear"),
                   mean=tuple(card.get("mean", IMAGENET_MEAN)), std=tuple(card.get("std", IMAGENET_STD)))
