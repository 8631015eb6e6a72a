#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Write the lab engine's model: a tiny llama-architecture GGUF, made here, downloaded from nowhere.

    .cache/engine/venv/bin/python scripts/lab/tiny_gguf.py OUT.gguf [--layers 4] [--embd 256]
        [--heads 4] [--ff 512] [--context 307200] [--seed 1]

What memory sees of an inference server does not depend on what the weights know: the KV cache is
``layers × 2 × context × embd × 2`` bytes of f16 however the weights were trained. So the weights
are seeded random numbers (normal, scaled by 1/√fan-in so that activations neither vanish nor
explode; query and key weights three times that, so that greedy decoding picks varied tokens) and the vocabulary is small: the SentencePiece
("llama") tokenizer with ``<unk> <s> </s>``, ``▁`` (the space) and the 94 printable ASCII characters
as pieces, plus the newline as a byte piece. Every token decodes to ASCII, so the engine's output text
names its tokens one to one: equal texts are equal tokens. The same arguments write the same bytes.
Needs ``gguf`` (scripts/lab/engine-requirements.txt).
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

# SentencePiece token types (gguf.TokenType; llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6
QK_GAIN = 3.0


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>", "\u2581", "<0x0A>"] + [chr(c) for c in range(33, 127)]
    types = [UNKNOWN, CONTROL, CONTROL, NORMAL, BYTE] + [NORMAL] * 94
    scores = [0.0] * len(tokens)        # single characters only: nothing for the tokenizer to merge
    return tokens, scores, types


def weights(rng: np.random.Generator, n_vocab: int, a) -> dict[str, np.ndarray]:
    """name → array in numpy's (rows, columns) order; gguf stores the reverse (ne0 = columns)."""
    def dense(rows: int, cols: int, gain: float = 1.0) -> np.ndarray:
        return (gain * rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    ones = np.ones(a.embd, np.float32)
    out = {"token_embd.weight": dense(n_vocab, a.embd), "output_norm.weight": ones,
           "output.weight": dense(n_vocab, a.embd)}
    kv = a.embd // a.heads * a.kv_heads
    for i in range(a.layers):
        b = f"blk.{i}."
        # q and k three times larger: with unit-gain scores attention is near uniform, every position
        # sees the same average and greedy decoding repeats one token; sharper scores make the
        # answer depend on the prompt (a more sensitive check of token identity)
        out |= {b + "attn_norm.weight": ones, b + "attn_q.weight": dense(a.embd, a.embd, QK_GAIN),
                b + "attn_k.weight": dense(kv, a.embd, QK_GAIN), b + "attn_v.weight": dense(kv, a.embd),
                b + "attn_output.weight": dense(a.embd, a.embd), b + "ffn_norm.weight": ones,
                b + "ffn_gate.weight": dense(a.ff, a.embd), b + "ffn_up.weight": dense(a.ff, a.embd),
                b + "ffn_down.weight": dense(a.embd, a.ff)}
    return out


def write(path: str, a) -> None:
    import gguf

    tokens, scores, types = vocabulary()
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("tieringd-lab-tiny")
    w.add_context_length(a.context)
    w.add_embedding_length(a.embd)
    w.add_block_count(a.layers)
    w.add_feed_forward_length(a.ff)
    w.add_head_count(a.heads)
    w.add_head_count_kv(a.kv_heads)
    w.add_rope_dimension_count(a.embd // a.heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    for name, arr in weights(np.random.default_rng(a.seed), len(tokens), a).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--ff", type=int, default=512)
    ap.add_argument("--context", type=int, default=307200, help="training context (tokens)")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    if a.embd % a.heads or a.heads % a.kv_heads:
        ap.error("--embd must divide by --heads, and --heads by --kv-heads")
    write(a.out, a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
