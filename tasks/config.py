"""Typed parameters of the transfer-learning flow.

They are pydantic models so that the Prefect UI renders the Run form with bounds and help
text, and so that a bad value is rejected before any cluster starts. Ranks receive these
models (plain values), never Prefect objects.

Help text never holds angle brackets: the UI reads `<url>` as an HTML tag and drops it, so
placeholders are written in capitals (URL/CLASS/IMAGE.jpg).
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Annotated, Any, Literal, Optional, TypedDict, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from prefect_ddp.tasks.backbone_names import known_backbone

# How often an elastic gang asks mid-epoch whether to grow: each ask is a one-integer broadcast,
# measured at well under a millisecond against steps of tens of milliseconds or more (bench/RESULTS.md,
# "An elastic gang's boundary"), while a worker come free waits at most this many steps.
REGROUP_EVERY_STEPS = 50
# The most DataLoader processes a rank may be given (training.num_workers).
MAX_NUM_WORKERS = 64
# TrainingConfig's fine-tuning knobs (docs/models.md, "Fine-tuning knobs"): each default trains as the recipe
# did before they existed.
FINE_TUNING_KNOBS = ("label_smoothing", "mixup_alpha", "cutmix_alpha", "trivial_augment", "random_erasing",
                     "clip_grad_norm", "accumulate_steps", "drop_path", "layer_decay", "ema_decay")


class _Strict(BaseModel):
    # A misspelt field in a deployment's parameters should fail loudly, not be ignored.
    model_config = ConfigDict(extra="forbid")


class DataConfig(_Strict):
    """Where the images are and how they are checked and split."""

    url: str | None = Field(
        default=None,
        description="Image folder laid out as URL/CLASS/IMAGE.jpg: s3://bucket/prefix, "
        "file:///path or a local path. Overrides the block's url when both are given.",
    )
    block: str | None = Field(
        default=None,
        description="Name of a saved `data-location` block holding the S3 endpoint, region "
        "and credentials (and a default url).",
    )
    val_fraction: float = Field(default=0.2, gt=0, lt=1, description="Share of each class held out.")
    seed: int = Field(default=0, ge=0, description="Seed of the stratified train/val split.")
    validate_sample: int | None = Field(
        default=None,
        ge=1,
        description="Decode-check this many images per class; empty checks every image.",
    )
    max_unreadable_fraction: float = Field(
        default=0.1,
        ge=0,
        le=1,
        description="Largest share of images that may fail to decode (or be missing) and be "
        "left out; above it the run stops: before training when decode-check finds them, at the "
        "end of an epoch when training meets them. 0 allows none, 1 any.",
    )
    index_cache_minutes: int = Field(
        default=60,
        ge=0,
        le=7 * 24 * 60,
        description="Reuse the listing of an unchanged url for this long; 0 lists every run.",
    )

    @model_validator(mode="after")
    def _url_or_block(self) -> DataConfig:
        if not self.url and not self.block:
            raise ValueError(
                "data needs `url` (s3://bucket/prefix or a local path) or `block` "
                "(a saved data-location block); neither was given. Set data.url or data.block, "
                "or the shortcuts data_url or data_block."
            )
        return self


# A validator in the type, not on the model, so that the flat `backbone` shortcut checks it too.
BackboneName = Annotated[str, AfterValidator(known_backbone)]


class ModelConfig(_Strict):
    """Which backbone to fine-tune (torchvision's, or timm's) and where its starting weights come from."""

    backbone: BackboneName = Field(
        default="resnet18",
        description="Any torchvision classification model by name: resnet18, resnet50, convnext_tiny, "
        "efficientnet_v2_s, vit_b_16, swin_t, regnet_y_800mf, mobilenet_v3_small, ... "
        "(torchvision.models.list_models(module=torchvision.models) lists them). Or, with the timm extra, "
        "any timm model as timm/NAME, its pretrained tag included: timm/convnext_tiny.fb_in22k.",
    )
    weights: str | None = Field(
        default=None,
        description="Empty: random init. A torchvision weights name (DEFAULT, IMAGENET1K_V1), or DEFAULT for a "
        "timm model (its tag's weights): downloaded, needs internet on the workers. A state_dict or "
        "safetensors URI (s3://... or a local .pt/.safetensors path) for clusters without internet.",
    )
    freeze_backbone: bool = Field(default=False, description="Train only the new classifier head.")
    warm_start: bool | str = Field(
        default=False,
        description="true: start from the model kept as latest under output.model_name (by default the "
        "deployment's), when there is one with this backbone. Or a registered model, "
        "models:/NAME@ALIAS (models:/NAME@champion) or models:/NAME/VERSION, read through tracking.block. "
        "Its head too when the classes match. Overrides weights.",
    )

    @field_validator("warm_start", mode="before")
    @classmethod
    def _registry_uri(cls, value: Any) -> Any:
        if isinstance(value, str) and value.lower() in ("true", "false"):  # as a CLI or form gives it
            return value.lower() == "true"
        if isinstance(value, str) and not is_registry_uri(value):
            raise ValueError(
                f"model.warm_start={value!r} is neither true/false nor a registered model's URI; use "
                "models:/NAME@ALIAS (e.g. models:/nightly@champion) or models:/NAME/VERSION."
            )
        return value

    def warm_start_uri(self) -> str | None:
        """The registered model to start from, when warm_start names one."""
        return self.warm_start if isinstance(self.warm_start, str) else None


def is_registry_uri(uri: str) -> bool:
    """Whether `uri` names a version in an MLflow model registry: models:/NAME@ALIAS or models:/NAME/VERSION.

    >>> [is_registry_uri(u) for u in ("models:/cats@champion", "models:/cats/3", "models:/cats", "s3://b/m")]
    [True, True, False, False]
    """
    return bool(REGISTRY_URI.fullmatch(uri))


REGISTRY_URI = re.compile(r"models:/[^/@]+(@[A-Za-z0-9_-]+|/[0-9]+)")


class TrackingConfig(_Strict):
    """Whether and where the run is recorded in MLflow (experiments, the model registry)."""

    block: str | None = Field(
        default=None,
        description="Name of a saved `mlflow-tracking` block (the server and its credentials). Empty: "
        "no tracking. A server that cannot be reached is warned about, never fails the training.",
    )
    experiment: str | None = Field(
        default=None, description="MLflow experiment the run is recorded in; empty: the block's.",
    )


class TrainingConfig(_Strict):
    """The optimisation recipe; every rank gets the same values."""

    epochs: int = Field(default=5, ge=1, le=1000, description="Passes over the training images.")
    batch_size: int = Field(default=32, ge=1, le=4096, description="Images per rank per step.")
    image_size: int = Field(default=224, ge=16, le=1024, description="Side of the square crop.")
    optimizer: Literal["sgd", "adamw"] = Field(default="sgd", description="sgd (with momentum) or adamw.")
    lr: float = Field(default=0.01, gt=0, le=10, description="Learning rate for one rank.")
    momentum: float = Field(default=0.9, ge=0, lt=1, description="SGD only.")
    weight_decay: float = Field(default=1e-4, ge=0, le=1, description="L2 penalty on the weights (none on norm "
                                "and bias parameters).")
    scale_lr_by_world_size: bool | None = Field(
        default=None, description="Multiply lr by the world size (the linear scaling rule). Empty: for sgd "
        "only; adamw keeps the per-rank lr.",
    )
    warmup_epochs: int | None = Field(
        default=None, ge=0, le=100, description="Raise lr linearly, step by step, over this many first epochs. "
        "Empty: 1 when lr is scaled by a world size above 1, else 0.",
    )
    sync_batchnorm: bool = Field(
        default=False, description="Pool BatchNorm's batch statistics over all ranks (SyncBatchNorm; CUDA "
        "ranks only): for small per-rank batches. BatchNorm layers of a frozen backbone stay in eval mode.",
    )
    # FINE_TUNING_KNOBS:
    label_smoothing: float = Field(
        default=0, ge=0, lt=1, description="Share of each training target spread evenly over all classes (0: "
        "off). The training loss only: val_loss stays plain cross-entropy, comparable between runs.",
    )
    mixup_alpha: float = Field(
        default=0, ge=0, le=10, description="MixUp on each training batch: each image blended with its batch "
        "neighbour, its target alike, by a share drawn from Beta(alpha, alpha) (0: off; 0.2 is usual). With "
        "cutmix_alpha too, each batch takes one of the two at random.",
    )
    cutmix_alpha: float = Field(
        default=0, ge=0, le=10, description="CutMix on each training batch: a box of each image replaced by its "
        "batch neighbour's, the target mixed by the box's area, drawn from Beta(alpha, alpha) (0: off; 1.0 is usual).",
    )
    trivial_augment: bool = Field(
        default=False, description="TrivialAugmentWide after the random crop and flip: one photometric or "
        "geometric change of random strength per training image.",
    )
    random_erasing: float = Field(
        default=0, ge=0, le=1, description="Probability of erasing a random box of each normalised training "
        "image (RandomErasing; 0: off; 0.1-0.25 is usual).",
    )
    clip_grad_norm: float | None = Field(
        default=None, gt=0, le=1e6, description="Scale the gradients down to this total L2 norm before each "
        "optimizer step (after unscaling them under float16's loss scaling). Empty: no clipping.",
    )
    accumulate_steps: int = Field(
        default=1, ge=1, le=1024,
        description="Batches whose gradients add up to one optimizer step: each rank's batch_size images times "
        "this make a step's batch per rank, for a batch larger than the GPU holds. The gradients are all-reduced "
        "once per step. 1: a step per batch.",
    )
    drop_path: float | None = Field(
        default=None, ge=0, lt=1,
        description="Drop-path (stochastic depth) rate: each residual block of a training step is skipped with "
        "up to this probability. timm's models and torchvision's ConvNeXt, EfficientNet, Swin and MaxViT take "
        "it. Empty: the model's own (0 for most of timm's, 0.1-0.2 for a few such as FasterNet; torchvision's "
        "builders: 0.1-0.5 by size); 0 turns it off.",
    )
    layer_decay: float | None = Field(
        default=None, gt=0, le=1,
        description="Layer-wise learning-rate decay, for fine-tuning transformers: the head trains at lr, each "
        "layer below it at layer_decay times the rate of the one above (timm's layer groups: timm/NAME models "
        "only). Empty: one rate for every layer.",
    )
    ema_decay: float | None = Field(
        default=None, gt=0, lt=1,
        description="Keep an exponential moving average of the weights, moved 1 - ema_decay of the way to them "
        "after every optimizer step (0.999: about the last thousand steps). Each epoch validates it beside the "
        "model and keeps whichever did better (the record's `weights`). Empty: none.",
    )
    scheduler: Literal["cosine", "plateau", "none"] = Field(
        default="cosine", description="cosine over the epochs, plateau on val loss, or none."
    )
    amp: bool = Field(default=True, description="Mixed precision; used only where ranks have CUDA.")
    amp_dtype: Literal["bfloat16", "float16"] = Field(
        default="bfloat16", description="Autocast type with amp: bfloat16 needs no loss scaling (GPUs "
        "without it, before Ampere, fall back to float16 with a GradScaler).",
    )
    channels_last: bool = Field(
        default=True, description="On CUDA ranks, lay out the model and images channels-last (faster "
        "convolutions on tensor cores).",
    )
    decode_on: Literal["auto", "loader", "device"] = Field(
        default="auto", description="Where images are decoded and augmented: in the DataLoader's CPU "
        "processes (loader; on uint8: the rank converts and normalises each batch on its device), or in "
        "batches on the rank's device, a batch ahead (device; on a GPU, torchvision's nvjpeg decoder: for "
        "when the CPUs cannot keep the GPU fed). auto: each GPU rank times its model's step, its loaders' "
        "decode and its device's on a few of the run's images before the first epoch, takes the one that "
        "trains more images a second and logs why; ranks without a GPU decode in the loaders. Non-JPEG "
        "images decode on the CPU either way.",
    )
    num_workers: int | None = Field(
        default=None, ge=0, le=MAX_NUM_WORKERS,
        description="DataLoader worker processes per rank (0: load inline). Empty "
        "(the default): one per CPU the rank has (the CPUs its worker may run on, shared among the "
        "workers that may run on them) less one for the rank itself, at most 32: what a GPU rank needs "
        "to keep fed; fewer where the host's /dev/shm, memory, open-file or thread limit holds fewer (their "
        "batches through pipes where /dev/shm holds fewer than half of them, or than set here). The run's "
        "log says what it chose and why, and warns when a number set here is past such a limit.",
    )
    fetch_threads: int | None = Field(
        default=None, ge=1, le=4096, description="Images fetched concurrently per batch. Empty: the batch "
        "size, so a batch costs one storage round trip rather than several; fewer where the host's ranks "
        "would keep more than 8,192 GETs in flight to the storage, a process more files open than it may, or "
        "the host more threads (one per GET) than its limits on them leave.",
    )
    cache_gb: float | None = Field(
        default=None, ge=0, le=100_000,
        description="Keep fetched images on each worker host's local disk, up to this many GB per "
        "host, so later epochs read them from there instead of S3; images larger than training needs "
        "(camera photos) are kept resized to the side the crop needs (folder: $PREFECT_DDP_CACHE_DIR, "
        "else ~/.cache/prefect-ddp/images, the user's own). 0 turns it off. Empty: a run of 3 epochs or more "
        "that decodes in its loader processes keeps copies of its training images over twice "
        "the side the crop needs, resized to it, up to a tenth of the folder's free disk space, where that "
        "folder is on a local disk; the run's log says what it chose.",
    )
    images_per_shard: int | None = Field(
        default=None, ge=2, le=1_000_000,
        description="Pack the training images into tar shards of this many images (written once "
        "below OUTPUT/shards/ and reused by later runs over the same images and split) and read "
        "each shard with one GET. Empty: one GET per image (the default). Validation stays per image.",
    )
    shard_side: int | None = Field(
        default=None, ge=0, le=16384,
        description="With shards: images larger than this on their shorter side are stored resized to it, as "
        "JPEG, so training decodes small images instead of originals (a 12-MP photo: ~2 ms instead of ~60-200). "
        "Empty: what the random crop at image_size needs (1.5 x image_size). 0: the images as stored.",
    )
    shard_quality: int = Field(default=90, ge=50, le=100, description="JPEG quality of images stored resized in shards.")
    checkpoint_every: Literal["epoch", "auto"] = Field(
        default="epoch", description="When rank 0 checkpoints, for a re-formed gang to resume from: after every "
        "epoch, or auto: at the interval Young and Daly's rule gives from the measured cost of a save and "
        "the failures this run has seen (mtbf_h before any), never leaving more than max_lost_min of "
        "training unsaved, and always after the last epoch. A sweep's trials checkpoint every epoch. Saves "
        "are copied to memory and written while training goes on, either way.",
    )
    mtbf_h: float = Field(
        default=24, gt=0, le=100_000, description="With checkpoint_every=auto: the expected hours between failures "
        "of the gang (a rank or worker lost) until this run has seen one; after that, the shorter of this "
        "and the time it trained per failure seen.",
    )
    max_lost_min: float = Field(
        default=30, gt=0, le=100_000, description="With checkpoint_every=auto: the most training, in minutes, that "
        "one failure may lose: the interval never exceeds it.",
    )
    regroup_every_steps: int = Field(
        default=REGROUP_EVERY_STEPS, ge=0, le=1_000_000, description="In an elastic gang (cluster.min_world_size): "
        "after every this many optimizer steps, besides each epoch's end, the ranks ask whether a worker "
        "came free, and grow onto it there, mid-epoch, instead of leaving it idle until the epoch ends. "
        "0: at epochs' ends only. Each ask is one tiny broadcast between the ranks.",
    )
    fetch_timeout_s: float = Field(
        default=60, ge=1, le=3600,
        description="Limit in seconds for fetching one batch of images, retries included. A "
        "rank whose storage stalls longer fails with a TimeoutError naming the images, and the "
        "gang restarts, instead of waiting out the process group's timeout. A gang of live "
        "workers is never taken for hung (cluster.hang_timeout_s) sooner.",
    )

    def fetches_in_flight(self) -> int:
        """fetch_threads, or the batch size when it is empty."""
        return self.fetch_threads or self.batch_size

    def knobs_set(self) -> dict[str, float | bool]:
        """The fine-tuning knobs set away from their defaults, for the report's recipe.

        >>> TrainingConfig(label_smoothing=0.1, clip_grad_norm=1.0).knobs_set()
        {'label_smoothing': 0.1, 'clip_grad_norm': 1.0}
        """
        return {name: getattr(self, name) for name in FINE_TUNING_KNOBS
                if getattr(self, name) != TrainingConfig.model_fields[name].default}

    @model_validator(mode="after")
    def _shards_no_smaller_than_the_crop(self) -> TrainingConfig:
        if self.shard_side and self.shard_side < self.image_size:
            raise ValueError(
                f"training.shard_side={self.shard_side} is below training.image_size={self.image_size}: every "
                "stored image would be scaled up again for training. Leave shard_side empty (1.5 x image_size, "
                "what the random crop needs), set at least image_size, or 0 to store the images as they are."
            )
        return self


class GangOptions(TypedDict):
    """`run_gang`'s keyword arguments that a flow's `cluster` parameter decides (`ClusterConfig.gang_options`)."""

    world_size: int | None
    min_world_size: int | None
    init_timeout: timedelta
    timeout: timedelta | None
    max_restarts: int
    hang_timeout: timedelta | None
    lease_timeout: timedelta


class ClusterConfig(_Strict):
    """Which Dask cluster runs the ranks: a saved block, an address, or a new local one."""

    block: str | None = Field(default=None, description="Name of a saved `dask-cluster` block.")
    address: str | None = Field(
        default=None, description="Scheduler address of an existing cluster, e.g. tcp://10.0.0.5:8786."
    )
    n_workers: int = Field(
        default=2, ge=1, le=256, description="Workers of a new local cluster (ignored with address)."
    )
    world_size: int | None = Field(
        default=None, ge=1, description="Ranks to run; empty uses every worker of the cluster. With "
        "min_world_size: the most ranks."
    )
    min_world_size: int | None = Field(
        default=None, ge=1, description="Make the gang elastic: it starts once this many workers are free, on "
        "as many up to world_size as are; a lost worker shrinks it to the survivors at once, and a worker "
        "come free grows it back at its next boundary (training.regroup_every_steps, or an epoch's end), the "
        "state handed over in memory. A sweep sizes its trials with settings.min_ranks_per_trial. Empty: a fixed "
        "size (world_size).",
    )
    init_timeout_s: int = Field(
        default=300, ge=10, le=3600, description="Limit for all ranks to join the process group, and for any one "
        "collective to complete; raised to training.fetch_timeout_s / 0.8 where that is longer."
    )
    gang_timeout_s: int | None = Field(
        default=None, ge=60, description="Limit for the whole training; empty waits as long as it runs."
    )
    max_restarts: int = Field(
        default=1, ge=0, le=10, description="Re-form the gang this often after a rank or worker fails."
    )
    hang_timeout_s: int | None = Field(
        default=None, ge=5, le=86400, description="Stop and re-form the gang when no rank makes progress this "
        "long (a frozen worker is found this long after it froze); empty: the larger of 60 s and 5x the "
        "longest of the last 20 gaps between steps, below 80% of the process group's timeout "
        "(init_timeout_s, raised as it says). Loading data, validation batches and checkpoints get 5x "
        "longer (an empty limit still stays below that 80%); live workers get at least "
        "training.fetch_timeout_s.",
    )
    lease_timeout_s: int = Field(
        default=600, ge=0, le=86400,
        description="How long to wait for enough workers that no other run holds before failing.",
    )

    def gang_options(self) -> GangOptions:
        """The gang's options, as `run_gang(fn, config, **cluster.gang_options(), ...)` takes them:
        seconds become timedeltas, and an empty limit stays None (no limit, or the gang's own rule).

        >>> options = ClusterConfig(world_size=2, gang_timeout_s=3600).gang_options()
        >>> options["world_size"], options["timeout"], options["hang_timeout"]
        (2, datetime.timedelta(seconds=3600), None)
        """
        return GangOptions(
            world_size=self.world_size,
            min_world_size=self.min_world_size,
            init_timeout=timedelta(seconds=self.init_timeout_s),
            timeout=timedelta(seconds=self.gang_timeout_s) if self.gang_timeout_s else None,
            max_restarts=self.max_restarts,
            hang_timeout=timedelta(seconds=self.hang_timeout_s) if self.hang_timeout_s else None,
            lease_timeout=timedelta(seconds=self.lease_timeout_s),
        )

    @model_validator(mode="after")
    def _block_or_address(self) -> ClusterConfig:
        if self.min_world_size and self.world_size and self.min_world_size > self.world_size:
            raise ValueError(
                f"cluster got min_world_size={self.min_world_size} above world_size={self.world_size}; "
                "give min_world_size <= world_size (the gang's size range), or leave it empty for a fixed size."
            )
        if self.block and self.address:
            raise ValueError(
                f"cluster got both block={self.block!r} and address={self.address!r}; "
                "give one of them (or neither, for a new local cluster)."
            )
        return self


class OutputConfig(_Strict):
    """Where models, metrics and reports are written: one folder per flow run below url."""

    url: str = Field(
        default="./outputs", description="s3://bucket/prefix or a local path; each run writes to URL/RUN-NAME-ID/ (ID: the first 8 characters of the flow run id)."
    )
    block: str | None = Field(
        default=None,
        description="data-location block for the output's credentials; empty reuses the "
        "data block when url is on S3.",
    )
    model_name: str | None = Field(
        default=None,
        description="Keep the best model of the runs sharing this name under URL/NAME/ (NAME/latest.json "
        "names the version kept): a run replaces it only when its model beats the kept one on the run's "
        "validation images neither trained on (min_improvement). Empty: the deployment's name; a run "
        "outside a deployment keeps none; sweep trials never promote.",
    )
    min_improvement: float | None = Field(
        default=None, ge=0, le=1,
        description="How much more accurate than the kept model, on the same images, a run's model must be "
        "to replace it. Empty: more than the noise of that comparison (one standard error of the paired "
        "difference: sqrt(images only one gets right) / images). A tie always keeps the kept model.",
    )
    shared: bool = Field(
        default=False,
        description="A local url is one filesystem mounted on every worker host (NFS, Lustre). "
        "Without it, a local url with ranks on several hosts is refused: each would write its own disk.",
    )


M = TypeVar("M", bound=BaseModel)


def shortcut(model: type[BaseModel], field: str) -> Any:
    """The type of a flat flow parameter that sets `model.field`: the same bounds, or empty.

    `prefect deployment run --param training=...` replaces the deployment's whole nested
    object; a shortcut (`--param epochs=2`) changes one field and keeps the rest. (Prefect
    takes a flow parameter's help text from the flow's docstring, not from here.)
    """
    info = model.model_fields[field]
    # Optional[...] spelled as the call it is at runtime: the field's type is a value here,
    # which a type checker would read as a (missing) type name in the subscript form.
    optional = Optional.__getitem__(info.annotation)
    return Annotated[(optional, *info.metadata)] if info.metadata else optional


def with_overrides(config: M, **values: Any) -> M:
    """`config` with every value that is not None put in, validated again as a whole."""
    changes = {name: value for name, value in values.items() if value is not None}
    return type(config).model_validate(config.model_dump() | changes)


DataUrl = shortcut(DataConfig, "url")
DataBlock = shortcut(DataConfig, "block")
BackboneChoice = shortcut(ModelConfig, "backbone")
Epochs = shortcut(TrainingConfig, "epochs")
LearningRate = shortcut(TrainingConfig, "lr")
BatchSize = shortcut(TrainingConfig, "batch_size")
