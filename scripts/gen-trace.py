#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Generate a synthetic KV-cache trace in the Mooncake (FAST'25) or Alibaba Bailian format.

Real traces are not committed (size, licence); tests and benchmarks use these. Two shapes:

- ``--shape chat`` (the default): conversations arrive as a Poisson process; each opens with one of a
  few shared system prompts (Zipf popularity: requests share prefixes across conversations) and runs
  several turns, each turn's input being the whole conversation so far plus a new user message, after a
  think time.
- ``--shape agent``: coding-agent sessions (``generate_agent``): long sessions of LLM steps whose
  context grows by a few thousand tokens a step to 70k–150k tokens and is compacted when it reaches the
  session's ceiling; steps of one request come seconds apart (tool calls), requests minutes apart (the
  human); many sessions interleave.

Block ids follow the real traces' rules: a full block's id names its content and everything before it
(so a conversation's earlier blocks and a shared prompt's blocks repeat), a partial last block gets a
fresh id, and ids are renumbered 0, 1, 2… in order of first appearance.

    python scripts/gen-trace.py --format mooncake --requests 2000 --seed 1 -o /tmp/mooncake.jsonl
    python scripts/gen-trace.py --shape agent --requests 8621 --seed 1 -o /tmp/agent.jsonl
"""
from __future__ import annotations

import argparse
import dataclasses
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


@dataclasses.dataclass(frozen=True)
class AgentShape:
    """The agent shape's parameters. Where each comes from (estimates are marked):

    - ``prompt_tokens`` 16,000: the shared system prompt and tool definitions a coding agent sends first
      (Claude Code's first request reads about 15–16k cached tokens and writes 2k: its usage records);
      ``prompts`` 4 of them (agents, versions), Zipf ``zipf`` 1.2 (estimate).
    - ``start_tokens`` 75k–110k, ``ceiling_tokens`` 140k–160k (uniform per session): contexts of 70k–150k
      re-read at every request. TraceLab (UW, 2026: 4,265 Claude Code and Codex sessions, 357,161 LLM
      steps) averages 154k input tokens per step (54.9 B over 357,161), 96 % of them cached prefix; the
      coding-agent trace the simulator must handle averages 130k (2.2 M 512-token block references over
      8,621 requests). A session that reaches its ceiling is compacted to ``start`` again (TraceLab
      flags compactions where the input drops by ≥ 25 % from ≥ 32k): the blocks after the prompt change.
    - ``append_tokens`` lognormal, median 2,000, σ 0.9 (mean ~3,000): what a tool result adds to the
      context per step — "a few thousand tokens per turn". TraceLab: 6,350 appended tokens per step on
      average, 1,250 of them fresh (the rest re-sent output and cache misses).
    - ``output_tokens`` lognormal, median 170, σ 1.4, at most 8,192 (mean ~430): short outputs; TraceLab
      523 per step on average ("often under 50"), the coding-agent trace 430 (3.7 M over 8,621).
    - ``steps_per_request`` geometric, mean 8: TraceLab's 7.8 tool-initiated steps (and 0.9 user-
      initiated) per request; ``requests_per_session`` geometric, mean 5 (TraceLab: mean 9.2, median 1,
      p90 18; a shorter mean keeps many sessions interleaved in a trace of a few thousand requests).
    - ``tool_s`` lognormal, median 1.5 s, σ 1.0: the time between a step's reply and the next step (a
      tool call): "tool-calling loops seconds apart" (agentic-kv-cache's replay of 68,266 Claude Code
      requests; a Bash call takes ~3 s under Claude Code's own telemetry). Estimate of the spread.
    - ``human_s`` lognormal, median 30 s, σ 1.2: between requests (the human reads, types): estimate.
    - ``rate_per_s`` 0.2 sessions/s: new sessions (estimate, set so that the fast tier's hit rate under
      transparent LRU at 5 % and 10 % of the trace's KV — 62 % and 87 % — is near the real coding-agent
      trace's, 66 % and 89 %); about 120 sessions are in flight at a time, each ~39 steps over ~9 minutes.
    """
    rate_per_s: float = 0.2
    prompts: int = 4
    zipf: float = 1.2
    prompt_tokens: int = 16_000
    start_tokens: tuple[int, int] = (75_000, 110_000)
    ceiling_tokens: tuple[int, int] = (140_000, 160_000)
    append_median: float = 2_000.0
    append_sigma: float = 0.9
    output_median: float = 170.0
    output_sigma: float = 1.4
    output_max: int = 8192
    steps_per_request: float = 8.0
    requests_per_session: float = 5.0
    tool_median_s: float = 1.5
    tool_sigma: float = 1.0
    human_median_s: float = 30.0
    human_sigma: float = 1.2
    tpot_s: float = 0.03                 # the simulator's default time per output token


def _agent_session(rng, shape: AgentShape, sid: int, t0: float, prompt: int):
    """One session's steps: (arrival_s, session, step, prompt, epoch, context tokens, output tokens)."""
    steps = []
    start = int(rng.integers(*shape.start_tokens))
    ceiling = int(rng.integers(*shape.ceiling_tokens))
    context, epoch, t, k = start, 0, t0, 0
    for req in range(int(rng.geometric(1.0 / shape.requests_per_session))):
        if req:
            t += rng.lognormal(np.log(shape.human_median_s), shape.human_sigma)
            context += int(rng.lognormal(np.log(500.0), 1.0))          # the user's message
        for _ in range(int(rng.geometric(1.0 / shape.steps_per_request))):
            if context >= ceiling:                                      # compaction: a summary replaces the history
                context, epoch = start, epoch + 1
            out = int(min(rng.lognormal(np.log(shape.output_median), shape.output_sigma), shape.output_max)) + 1
            steps.append((t, sid, k, prompt, epoch, context, out))
            k += 1
            t += out * shape.tpot_s + rng.lognormal(np.log(shape.tool_median_s), shape.tool_sigma)
            context += out + int(rng.lognormal(np.log(shape.append_median), shape.append_sigma))
    return steps


def generate_agent(fmt: str, requests: int, seed: int, shape: AgentShape) -> list[dict]:
    """Coding-agent sessions (AgentShape) until ``requests`` LLM steps, in arrival order."""
    rng = np.random.default_rng(seed)
    bt = BLOCK_TOKENS[fmt]
    popularity = 1.0 / np.arange(1, shape.prompts + 1) ** shape.zipf
    popularity /= popularity.sum()
    events, t, sid = [], 0.0, 0
    while len(events) < requests or (events and t < sorted(e[0] for e in events)[requests - 1]):
        t += rng.exponential(1.0 / shape.rate_per_s)
        events += _agent_session(rng, shape, sid, t, int(rng.choice(shape.prompts, p=popularity)))
        sid += 1
    events.sort(key=lambda e: (e[0], e[1], e[2]))
    remap: dict[tuple, int] = {}
    rows, last_chat = [], {}
    for chat_id, (at, s, k, p, epoch, context, out) in enumerate(events[:requests]):
        full, partial = divmod(context, bt)
        ids = []
        for j in range(full):
            owner = ("prompt", p) if (j + 1) * bt <= shape.prompt_tokens else ("session", s, epoch)
            ids.append(remap.setdefault((owner, j), len(remap)))
        if partial:
            ids.append(remap.setdefault(("partial", chat_id), len(remap)))
        if fmt == "mooncake":
            rows.append({"timestamp": int(at * 1000), "input_length": context, "output_length": out, "hash_ids": ids})
        else:
            rows.append({"chat_id": chat_id, "parent_chat_id": last_chat.get(s, -1), "timestamp": round(at, 3),
                         "input_length": context, "output_length": out, "type": "text", "turn": k + 1,
                         "hash_ids": ids})
            last_chat[s] = chat_id
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--format", choices=sorted(BLOCK_TOKENS), default="mooncake")
    ap.add_argument("--shape", choices=("chat", "agent"), default="chat",
                    help="chat: conversations (the options below); agent: coding-agent sessions (AgentShape's "
                         "defaults, --rate and --prompts apply)")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rate", type=float, default=None,
                    help="new conversations (sessions) per second (default: 2; agent 0.2)")
    ap.add_argument("--prompts", type=int, default=None, help="distinct shared system prompts (default: 8; agent 4)")
    ap.add_argument("--zipf", type=float, default=1.2, help="skew of system-prompt popularity")
    ap.add_argument("--turns", type=float, default=3.0, help="mean turns per conversation")
    ap.add_argument("--think-s", type=float, default=20.0, help="mean time between a reply and the next turn")
    ap.add_argument("-o", "--output", default="-", help="file to write (default: stdout)")
    args = ap.parse_args(argv)
    if args.requests <= 0 or (args.rate is not None and args.rate <= 0) or \
            (args.prompts is not None and args.prompts <= 0) or args.turns < 1:
        ap.error("--requests, --rate, --prompts must be > 0 and --turns ≥ 1")
    if args.shape == "agent":
        shape = AgentShape(**{k: v for k, v in (("rate_per_s", args.rate), ("prompts", args.prompts)) if v is not None})
        rows = generate_agent(args.format, args.requests, args.seed, shape)
    else:
        rows = generate(args.format, args.requests, args.seed, 2.0 if args.rate is None else args.rate,
                        8 if args.prompts is None else args.prompts, args.zipf, args.turns, args.think_s)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if args.output == "-":
        sys.stdout.write(text)
    else:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
