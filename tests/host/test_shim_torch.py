# SPDX-License-Identifier: Apache-2.0
"""Acceptance (c): PyTorch CPU tensors in a real model forward pass with a KV cache, under the shim.

A small decoder-only transformer (random weights, nothing downloaded) prefills a prompt and decodes
tokens greedily against a preallocated per-layer KV cache, as vLLM-style engines keep it. Output
must be identical with and without the shim, and the cache tensors must be registered."""
from __future__ import annotations

import sys
import textwrap

import pytest

from shim_support import LiveRegistry, plain_env, run, shim_env

pytestmark = pytest.mark.shim
torch = pytest.importorskip("torch", reason="torch==2.13.0 (the CPU wheel) is in the test extra")
MiB = 1 << 20

MODEL = textwrap.dedent("""
    import torch, torch.nn.functional as F
    torch.manual_seed(0)
    torch.set_num_threads(1)
    LAYERS, D, HEADS, BATCH, MAX_LEN, VOCAB = 4, 256, 8, 4, 2048, 1000
    HD = D // HEADS

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(D, 3 * D)
            self.out = torch.nn.Linear(D, D)
            self.ff = torch.nn.Sequential(torch.nn.Linear(D, 4 * D), torch.nn.GELU(), torch.nn.Linear(4 * D, D))
            self.n1, self.n2 = torch.nn.LayerNorm(D), torch.nn.LayerNorm(D)
            # The KV cache: [batch, heads, max_len, head_dim] float32 = 8 MiB per tensor.
            self.register_buffer("k_cache", torch.zeros(BATCH, HEADS, MAX_LEN, HD), persistent=False)
            self.register_buffer("v_cache", torch.zeros(BATCH, HEADS, MAX_LEN, HD), persistent=False)

        def forward(self, x, pos):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.n1(x)).view(b, t, 3, HEADS, HD).permute(2, 0, 3, 1, 4)
            self.k_cache[:, :, pos:pos + t] = k
            self.v_cache[:, :, pos:pos + t] = v
            keys, values = self.k_cache[:, :, :pos + t], self.v_cache[:, :, :pos + t]
            att = F.scaled_dot_product_attention(q, keys, values, is_causal=(t > 1))
            x = x + self.out(att.transpose(1, 2).reshape(b, t, D))
            return x + self.ff(self.n2(x))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(VOCAB, D)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
            self.head = torch.nn.Linear(D, VOCAB)

        def forward(self, ids, pos):
            x = self.emb(ids)
            for blk in self.blocks:
                x = blk(x, pos)
            return self.head(x)

    model = Model().eval()
    ids = torch.randint(0, VOCAB, (BATCH, 64))
    with torch.no_grad():
        logits = model(ids, 0)                      # prefill
        pos, tokens = 64, []
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(32):                         # decode against the cache
            tokens.append(nxt)
            logits = model(nxt, pos)
            pos += 1
            nxt = logits[:, -1].argmax(-1, keepdim=True)
    print("tokens", torch.cat(tokens, 1).tolist())
    print("logits", [round(v, 4) for v in logits[:, -1, :5].flatten().tolist()])
    print("cache", round(float(model.blocks[0].k_cache.abs().sum()), 2))
""")


def test_torch_kv_cache_forward_identical_and_registered(tmp_path):
    live = LiveRegistry(tmp_path / "run").start()
    try:
        base = run([sys.executable, "-c", MODEL], plain_env())
        assert base.returncode == 0, base.stderr
        import subprocess
        p = subprocess.Popen([sys.executable, "-c", MODEL], env=shim_env(live.reg.run_dir),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        assert out == base.stdout
        assert err == ""
        caches = [d for d in live.of(p.pid, "register") if d["length"] == 8 * MiB]
        # 2 caches per layer x 4 layers, allocated by PyTorch's CPU allocator (posix_memalign).
        assert len(caches) >= 8, live.of(p.pid, "register")
        assert {d["source"] for d in caches} <= {"memalign", "malloc", "calloc"}
        assert not live.of(p.pid, "refuse")
    finally:
        live.stop()
