"""The ANDREA byte-level GPT (:mod:`.model`) and the text it trains on (:mod:`.sources`)."""

from .model import CONFIGS, GPT, TRAIN_DEFAULTS, GPTConfig, TrainDefaults, from_config_dict
from .sources import (
    BUILTIN_SOURCES,
    DEFAULT_MAX_BYTES,
    CropSampler,
    TextSource,
    builtin_source,
    load_sources,
    load_text_source,
    source_from_spec,
)

__all__ = [
    "BUILTIN_SOURCES",
    "CONFIGS",
    "DEFAULT_MAX_BYTES",
    "GPT",
    "GPTConfig",
    "TRAIN_DEFAULTS",
    "CropSampler",
    "TextSource",
    "TrainDefaults",
    "builtin_source",
    "from_config_dict",
    "load_sources",
    "load_text_source",
    "source_from_spec",
]
