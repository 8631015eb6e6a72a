# SPDX-License-Identifier: Apache-2.0
"""KV bytes per token from a model description, and the adaptive block size (8/16/32 tokens).

KV bytes per token: ``per_token = 2 × layers × kv_heads × head_dim × dtype_bytes`` (K and V).
Block size: 8-token blocks for short sequences (< 4K tokens: little to gain from large blocks, and
their last block is mostly empty), 32-token blocks for long ones (> 32K: fewer rows to track and move),
16 tokens in between (vLLM's default). A block is the unit the heat table tracks and the policy moves, so its size
in bytes is rounded up to whole pages: ``move_pages(2)`` works on pages.

Config table ``[blocksize]`` (docs/heat-policy.md lists every key with its unit)::

    model = "llama-3.1-8b"         # a known name, or a path to a Hugging Face config.json
    kv_bytes_per_token = 131072    # overrides the model (bytes)
    small_tokens = 8               # block size for regions shorter than short_below_tokens
    medium_tokens = 16
    large_tokens = 32              # block size for regions longer than long_above_tokens
    short_below_tokens = 4096
    long_above_tokens = 32768
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

from tieringd.kernel.procfs import PAGE_SIZE
from tieringd.config import ConfigError, Table, ranged


_DTYPE_BYTES = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2,
                "float8": 1, "fp8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What the KV cache of one token costs: ``2 × layers × kv_heads × head_dim × dtype_bytes``."""
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any], name: str = "model") -> "ModelSpec":
        """A Hugging Face ``config.json`` (Llama, Qwen, Mistral layout)."""
        try:
            layers = int(cfg["num_hidden_layers"])
            heads = int(cfg["num_attention_heads"])
            kv_heads = int(cfg.get("num_key_value_heads") or heads)
            head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        except (KeyError, TypeError, ValueError, OverflowError, ZeroDivisionError) as e:
            raise ConfigError(f"model description {name}: missing or bad field {e}") from None
        for field, v in (("num_hidden_layers", layers), ("num_key_value_heads", kv_heads), ("head_dim", head_dim)):
            if not 1 <= v <= 1 << 20:
                raise ConfigError(f"model description {name}: {field} {v} is not in [1, {1 << 20}]")
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").lower()
        if dtype not in _DTYPE_BYTES:
            raise ConfigError(f"model description {name}: unknown dtype {dtype!r}")
        return cls(name, layers, kv_heads, head_dim, _DTYPE_BYTES[dtype])


# Published architectures (config.json of each model).
KNOWN_MODELS: dict[str, ModelSpec] = {m.name: m for m in (
    ModelSpec("llama-3.1-8b", 32, 8, 128),
    ModelSpec("llama-3.1-70b", 80, 8, 128),
    ModelSpec("llama-3.1-405b", 126, 8, 128),
    ModelSpec("qwen2.5-7b", 28, 4, 128),
    ModelSpec("qwen2.5-72b", 80, 8, 128),
    ModelSpec("mistral-7b", 32, 8, 128),
)}


DEFAULT_MODEL = "llama-3.1-8b"
MAX_MODEL_FILE_BYTES = 1 << 20      # a Hugging Face config.json is a few KiB


def load_model(desc: str) -> ModelSpec:
    """A known model name (case-insensitive) or a path to a Hugging Face ``config.json``."""
    key = desc.strip().lower()
    if key in KNOWN_MODELS:
        return KNOWN_MODELS[key]
    if os.path.exists(desc):
        # a regular file of sane size: /dev/zero or a FIFO named here would hang a start or a check
        if not os.path.isfile(desc) or os.path.getsize(desc) > MAX_MODEL_FILE_BYTES:
            raise ConfigError(f"model description {desc}: not a regular file of at most "
                              f"{MAX_MODEL_FILE_BYTES >> 20} MiB")
        try:
            with open(desc, encoding="utf-8") as f:
                cfg = json.load(f)
        except (OSError, ValueError, RecursionError) as e:
            raise ConfigError(f"cannot read model description {desc}: {e}") from None
        if not isinstance(cfg, dict):
            raise ConfigError(f"model description {desc}: not a JSON object")
        return ModelSpec.from_hf_config(cfg, name=os.path.basename(os.path.dirname(desc)) or desc)
    raise ConfigError(f"unknown model {desc!r}: give a path to a config.json or one of "
                      + ", ".join(sorted(KNOWN_MODELS)))


@dataclasses.dataclass(frozen=True)
class BlockSizer(Table):
    """Chooses tokens per block for a region from its length in tokens (8/16/32 tokens by length); also the
    ``[blocksize]`` table (:meth:`from_config`). Without ``kv_bytes_per_token``, ``model``'s is used."""
    NAME = "blocksize"
    kv_bytes_per_token: int | None = ranged(None, 1, 1 << 30, unit="bytes")  # KV cache bytes per token; unset: the model's
    model: str = DEFAULT_MODEL  # a known model (llama-3.1-8b/70b/405b, qwen2.5-7b/72b, mistral-7b) or a Hugging Face config.json path
    small_tokens: int = ranged(8, 1, 1 << 20)  # tokens per block of regions shorter than short_below_tokens
    medium_tokens: int = ranged(16, 1, 1 << 20)  # tokens per block of regions in between
    large_tokens: int = ranged(32, 1, 1 << 20)  # tokens per block of regions longer than long_above_tokens
    short_below_tokens: int = ranged(4096, 0, 1 << 40)  # a region shorter than this has small_tokens blocks
    long_above_tokens: int = ranged(32768, 0, 1 << 40)  # a region longer than this has large_tokens blocks

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token is None:       # frozen: set once, here
            try:
                spec = load_model(self.model)
            except ConfigError as e:               # placed on the model key's line
                raise ConfigError(f"[{self.NAME}] model: {e.message}", table=self.NAME, key="model") from None
            object.__setattr__(self, "kv_bytes_per_token", spec.kv_bytes_per_token)

    def validate(self) -> None:
        super().validate()
        if self.short_below_tokens > self.long_above_tokens:
            raise ConfigError.bad_value("blocksize", "short_below_tokens",
                                        f"at most long_above_tokens ({self.long_above_tokens})",
                                        self.short_below_tokens)

    def tokens_for(self, region_tokens: int) -> int:
        """< short_below → small, > long_above → large, else medium."""
        if region_tokens < self.short_below_tokens:
            return self.small_tokens
        if region_tokens > self.long_above_tokens:
            return self.large_tokens
        return self.medium_tokens

    def block_bytes(self, region_bytes: int) -> tuple[int, int]:
        """(tokens per block, bytes per block rounded up to whole pages) for a region of this size."""
        tokens = self.tokens_for(region_bytes // self.kv_bytes_per_token)
        raw = tokens * self.kv_bytes_per_token
        return tokens, -(-raw // PAGE_SIZE) * PAGE_SIZE
