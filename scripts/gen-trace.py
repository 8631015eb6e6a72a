#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Generate a synthetic KV-cache trace in the Mooncake (FAST'25) or Alibaba Bailian format.

Real traces are not committed (size, licence); tests and benchmarks use these. The workload:
conversations arrive as a Poisson process; each opens with one of a few shared system prompts (Zipf
popularity: the cross-request sharing the brief talks about) and runs several turns, each turn's input
being the whole conversation so far plus a new user message, after a think time. Block ids follow the
real traces' rules: a full block's id names its content and everything before it (so a conversation's
earlier blocks and a shared prompt's blocks repeat), a partial last block gets a fresh id, and ids are
renumbered 0, 1, 2… in order of first appearance.

    python scripts/gen-trace.py --format mooncake --requests 2000 --seed 1 -o /tmp/mooncake.jsonl
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

BLOCK_TOKENS = {"mooncake": 512, "bailian": 16}


def generate(fmt: str, requests: int, seed: int, rate_per_s: float, prompts: int, zipf: float,
             mean_turns: float, think_s: float) -> list[dict]:
    rng = np.random.default_rng(seed)
    bt = BLOCK_TOKENS[fmt]
    prompt_len = rng.integers(256, 4096, prompts)
    popularity = 1.0 / np.arange(1, prompts + 1) ** zipf
    popularity /= popularity.sum()
    events = []                          # (arrival_s, conversation, turn, input, output, key-path)
    t = 0.0
    conv = 0
    while len(events) < requests:
        t += rng.exponential(1.0 / rate_per_s)
        p = int(rng.choice(prompts, p=popularity))
        turns = 1 + int(rng.geometric(1.0 / mean_turns)) - 1
        context = int(prompt_len[p])
        at = t
        for turn in range(1, turns + 1):
            user = int(rng.lognormal(5.5, 1.0)) + 8                # ~250 tokens, long tail
            out = int(min(rng.lognormal(5.3, 0.8), 4096)) + 1      # ~200 tokens
            events.append((at, conv, turn, context + user, out, p))
            context += user + out
            at += out * 0.03 + rng.exponential(think_s)
        conv += 1
    events.sort(key=lambda e: e[0])
    events = events[:requests]
    remap: dict[tuple, int] = {}
    fresh = [0]

    def block_id(key) -> int:
        if key not in remap:
            remap[key] = len(remap)
        return remap[key]

    rows = []
    last_chat: dict[int, int] = {}
    for chat_id, (at, c, turn, inp, out, p) in enumerate(events):
        full, partial = divmod(inp, bt)
        ids = []
        for k in range(full):
            # a block entirely inside the shared prompt belongs to the prompt, else to the conversation
            owner = ("prompt", p) if (k + 1) * bt <= prompt_len[p] else ("conv", c)
            ids.append(block_id((owner, k)))
        if partial:
            fresh[0] += 1
            ids.append(block_id(("partial", fresh[0])))
        if fmt == "mooncake":
            rows.append({"timestamp": int(at * 1000), "input_length": inp, "output_length": out, "hash_ids": ids})
        else:
            rows.append({"chat_id": chat_id, "parent_chat_id": last_chat.get(c, -1), "timestamp": round(at, 3),
                         "input_length": inp, "output_length": out, "type": "text", "turn": turn,
                         "hash_ids": ids})
            last_chat[c] = chat_id
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--format", choices=sorted(BLOCK_TOKENS), default="mooncake")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rate", type=float, default=2.0, help="new conversations per second")
    ap.add_argument("--prompts", type=int, default=8, help="distinct shared system prompts")
    ap.add_argument("--zipf", type=float, default=1.2, help="skew of system-prompt popularity")
    ap.add_argument("--turns", type=float, default=3.0, help="mean turns per conversation")
    ap.add_argument("--think-s", type=float, default=20.0, help="mean time between a reply and the next turn")
    ap.add_argument("-o", "--output", default="-", help="file to write (default: stdout)")
    args = ap.parse_args(argv)
    if args.requests <= 0 or args.rate <= 0 or args.prompts <= 0 or args.turns < 1:
        ap.error("--requests, --rate, --prompts must be > 0 and --turns ≥ 1")
    rows = generate(args.format, args.requests, args.seed, args.rate, args.prompts, args.zipf, args.turns,
                    args.think_s)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if args.output == "-":
        sys.stdout.write(text)
    else:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
