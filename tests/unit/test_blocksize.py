# SPDX-License-Identifier: Apache-2.0
import json

import pytest

from tieringd.kernel.procfs import PAGE_SIZE
from tieringd.placement.blocksize import KNOWN_MODELS, BlockSizer, ModelSpec, load_model
from tieringd.config import ConfigError


def test_per_token_formula():
    # the brief: Llama-3.1-405B, 2 × 126 × 8 × 128 × 2 = 516,096 bytes per token
    assert KNOWN_MODELS["llama-3.1-405b"].kv_bytes_per_token == 516_096
    assert KNOWN_MODELS["llama-3.1-8b"].kv_bytes_per_token == 131_072


def test_hugging_face_config(tmp_path):
    cfg = {"num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
           "hidden_size": 3584, "torch_dtype": "bfloat16"}
    spec = ModelSpec.from_hf_config(cfg)
    assert spec.head_dim == 128 and spec.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2
    p = tmp_path / "qwen" / "config.json"
    p.parent.mkdir()
    p.write_text(json.dumps(cfg))
    assert load_model(str(p)).kv_bytes_per_token == spec.kv_bytes_per_token
    assert load_model("Llama-3.1-8B") is KNOWN_MODELS["llama-3.1-8b"]
    with pytest.raises(ConfigError, match="unknown model"):
        load_model("gpt-17")
    with pytest.raises(ConfigError, match="missing or bad field"):
        ModelSpec.from_hf_config({"num_hidden_layers": 2})


def test_block_size_follows_the_sequence_length():
    s = BlockSizer.from_config({"model": "llama-3.1-8b"})
    assert s.tokens_for(1000) == 8 and s.tokens_for(4095) == 8
    assert s.tokens_for(4096) == 16 and s.tokens_for(32768) == 16
    assert s.tokens_for(32769) == 32
    tokens, nbytes = s.block_bytes(100_000 * s.kv_bytes_per_token)
    assert tokens == 32 and nbytes == 32 * 131_072
    odd = BlockSizer(kv_bytes_per_token=1000)
    tokens, nbytes = odd.block_bytes(1000 * 100)
    assert tokens == 8 and nbytes % PAGE_SIZE == 0 and nbytes >= 8000


def test_config_errors():
    with pytest.raises(ConfigError, match=r"\[blocksize\] tokens: unknown key"):
        BlockSizer.from_config({"tokens": 3})
    with pytest.raises(ConfigError, match=r"\[blocksize\] kv_bytes_per_token: expected a size in \[1, 1GiB\], got 0"):
        BlockSizer.from_config({"kv_bytes_per_token": 0})
    with pytest.raises(ConfigError, match=r"short_below_tokens: expected at most long_above_tokens \(8\), got 9"):
        BlockSizer.from_config({"kv_bytes_per_token": 10, "short_below_tokens": 9, "long_above_tokens": 8})
    with pytest.raises(ConfigError, match="unknown model 'gpt-17'"):
        BlockSizer.from_config({"model": "gpt-17"})
    assert BlockSizer.from_config({"kv_bytes_per_token": "128K"}).kv_bytes_per_token == 131_072
