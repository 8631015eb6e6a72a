#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Guest side of the engine runs: llama.cpp's server (llama-cpp-python, unmodified) as the KV workload.

    kv_engine.py --out DIR --model M.gguf [--condition plain|none|kernel|kernel-tuned|tieringd]...
                 [--seconds 0] [--requests 24] [--report 4] [--ctx 307200]

Per condition, in order: the kernel settings of a peer (scripts/lab/peers.py) or tieringd (pinned
to CPU 0) are set up; the server (``python -m llama_cpp.server``, pinned to CPU 1, one thread,
flash attention so that V is stored row by row like K) starts with a KV cache of --ctx cells —
``plain`` runs it bare, every other condition under ``tieringctl run`` — and gets the same requests:
a shared system prompt, then one of six conversations in turn, each request's prompt the system
prompt and that conversation so far, its answer (greedy, 8 tokens) appended to the conversation,
and a conversation that reaches 1200 characters starts again (a new user). --requests N sends N
requests, --seconds S sends them for S seconds. Every --report seconds, the node-0 share of the KV
pages the engine reads is taken: its KV buffer is the allocation of the size the model implies
(layers × 2 tensors × ctx × row bytes, f16; k_0 v_0 k_1 … in that order, ggml's allocation order)
at the address the shim's debug log says it placed it; a request of P prompt and C completion
tokens reads cells [0, P + C) of each tensor, padded to 256 cells (llama.cpp's n_kv padding), and
those pages are queried with move_pages(2). ``plain`` has no shim, so no shares.

Writes DIR/engine.json: per condition the request texts and answers, the reports, and for tieringd
the regions it registered for the server's pid. Used by tests/lab/test_engine_lab.py and
scripts/bench/p5_engine.py.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import peers  # noqa: E402
from kv_loop import DaemonProc, RUN_DIR, status  # noqa: E402
from tieringd.kernel import numa  # noqa: E402

ENGINE_PY = os.path.join(REPO, ".cache", "engine", "venv", "bin", "python")
TIERINGCTL = os.path.join(REPO, ".venv", "bin", "tieringctl")
PORT = 8765
SYSTEM = ("You are the lab's assistant. Answer briefly and in plain words. The lab runs real kernels "
          "under QEMU with memory tiers: node 0 is DRAM beside the CPUs, node 1 is slower memory "
          "without CPUs. Keep every answer short; do not repeat the question. ") * 2
TURNS = ("How far is the moon?", "Name three colours.", "What is a page?", "Say hello.",
         "Count to five.", "Why is the sky blue?", "What is memory tiering?")
PAGE = 4096
PLACED = re.compile(r"placed (0x[0-9a-f]+)\+(\d+)")


class Layout:
    """Where the KV cache's tensors are in its buffer (f16 K and V, one of each per layer)."""

    def __init__(self, layers: int, embd_kv: int, ctx: int):
        self.row_bytes = embd_kv * 2
        self.tensor_bytes = self.row_bytes * ctx
        self.tensors = 2 * layers
        self.total_bytes = self.tensor_bytes * self.tensors

    def hot_pages(self, base: int, cells: int) -> np.ndarray:
        cells = -(-cells // 256) * 256                       # n_kv padding
        n = -(-cells * self.row_bytes // PAGE)
        starts = base + np.arange(self.tensors, dtype=np.int64) * self.tensor_bytes
        return (starts[:, None] // PAGE * PAGE + np.arange(n, dtype=np.int64)[None, :] * PAGE).ravel()


def kv_buffer(log_path: str, size: int) -> int | None:
    """Where the shim placed the server's KV buffer: its debug line ``placed ADDR+LEN`` (TIERINGD_LOG=3)
    for the first allocation of at least the KV cache's size. /proc/PID/maps cannot say: the
    kernel merges the buffer's mapping with its anonymous neighbours."""
    try:
        with open(log_path, errors="replace") as f:
            for m in PLACED.finditer(f.read()):
                if int(m.group(2)) >= size:
                    return int(m.group(1), 16)
    except OSError:
        pass
    return None


def post(path: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{PORT}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def wait_ready(p: subprocess.Popen, limit_s: float = 900) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        if p.poll() is not None:
            raise RuntimeError(f"server exited with {p.returncode} before it answered")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/v1/models", timeout=5):
                return time.monotonic() - t0
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"server not answering after {limit_s} s")


def server(model: str, ctx: int, log, shim: bool) -> subprocess.Popen:
    cmd = [ENGINE_PY, "-m", "llama_cpp.server", "--model", model, "--n_ctx", str(ctx), "--n_threads", "1",
           "--n_threads_batch", "1", "--n_batch", "32", "--n_ubatch", "32", "--flash_attn", "true",
           "--host", "127.0.0.1", "--port", str(PORT)]
    if shim:
        cmd = [TIERINGCTL, "run", "--", *cmd]
    cpu = max(os.sched_getaffinity(0))
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, TIERINGD_RUN_DIR=RUN_DIR, TIERINGD_LOG="3"),
                            preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))


class Sampler:
    """Every period: the node-0 share of the KV pages the requests of that period read."""

    def __init__(self, pid: int, log_path: str, layout: Layout, period_s: float):
        self.pid, self.log_path, self.base, self.layout, self.period_s = pid, log_path, None, layout, period_s
        self.cells = 0
        self.reports: list[dict] = []
        self.t0 = time.monotonic()
        self.stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def saw(self, cells: int) -> None:
        self.cells = max(self.cells, cells)

    def _run(self) -> None:
        while not self.stop.wait(self.period_s):
            cells, self.cells = self.cells, 0
            # the server creates its context (and the KV buffer) at the first request
            self.base = self.base or kv_buffer(self.log_path, self.layout.total_bytes)
            if not cells or not self.base:
                continue
            nodes = numa.query_pages_array(self.pid, self.layout.hot_pages(self.base, cells))
            ok = nodes[nodes >= 0]
            self.reports.append({"t_s": round(time.monotonic() - self.t0, 1), "cells": cells,
                                 "pages": int(len(nodes)), "node0_share": round(float((ok == 0).mean()), 4)
                                 if len(ok) else None, "unplaced": int((nodes < 0).sum())})


def converse(n_requests: int, seconds: float, sampler: Sampler) -> list[dict]:
    convs = [""] * 6
    out, t0, i = [], time.monotonic(), 0
    while (i < n_requests) if not seconds else (time.monotonic() - t0 < seconds):
        c = i % len(convs)
        if len(convs[c]) > 1200:
            convs[c] = ""                                    # a new user takes the slot
        convs[c] += f"User: {TURNS[(i // len(convs) + c) % len(TURNS)]}\nAssistant:"
        r = post("/v1/completions", {"prompt": SYSTEM + convs[c], "max_tokens": 8, "temperature": 0.0,
                                     "top_k": 1, "seed": 1})
        text = r["choices"][0]["text"]
        convs[c] += text + "\n"
        u = r.get("usage", {})
        sampler.saw(u.get("prompt_tokens", 0) + u.get("completion_tokens", 0))
        out.append({"i": i, "conv": c, "text": text, "usage": u})
        i += 1
    return out


def run_condition(cond: str, a, layout: Layout) -> dict:
    res: dict = {"condition": cond}
    daemon = peer = None
    if cond == "tieringd":
        daemon = DaemonProc(os.path.join(a.out, "daemon.log"), [])
    elif cond != "plain":
        peer = peers.make(cond, a.out, a.promote_rate)
        peer.start()
        res["peer"] = peer.describe()
    log_path = os.path.join(a.out, f"server-{cond}.log")
    log = open(log_path, "w")
    p = server(a.model, a.ctx, log, shim=cond != "plain")
    try:
        res["ready_s"] = round(wait_ready(p), 1)
        sampler = Sampler(p.pid, log_path, layout, a.report)
        c0 = peer.counters() if peer else None
        res["requests"] = converse(a.requests, a.seconds, sampler)
        res["peer_counters"] = [c0, peer.counters()] if peer else None
        sampler.stop.set()
        res["reports"] = sampler.reports
        res["kv_buffer"] = {"start": sampler.base or kv_buffer(log_path, layout.total_bytes),
                            "bytes": layout.total_bytes}
        if daemon:
            s = status() or {}
            res["regions"] = [r for r in s.get("regions", []) if r["pid"] == p.pid]
            res["moves"] = s.get("moves")
            res["daemon_cpu_s"] = daemon.cpu_s()
    finally:
        p.send_signal(signal.SIGINT)
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        log.close()
        if daemon:
            res["daemon_rc"] = daemon.stop()
        if peer:
            peer.stop()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--condition", action="append", choices=("plain", *peers.NAMES, "tieringd"))
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--seconds", type=float, default=0, help="send requests for this long instead")
    ap.add_argument("--report", type=float, default=4)
    ap.add_argument("--ctx", type=int, default=307200)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd-kv", type=int, default=256)
    ap.add_argument("--promote-rate", type=int, default=16)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    layout = Layout(a.layers, a.embd_kv, a.ctx)
    out = {"release": os.uname().release, "ctx": a.ctx, "kv_bytes": layout.total_bytes, "conditions": []}
    for cond in a.condition or ["plain", "tieringd"]:
        try:
            out["conditions"].append(run_condition(cond, a, layout))
        except (RuntimeError, OSError, peers.PeerError) as e:
            out["conditions"].append({"condition": cond, "error": str(e)})
        with open(os.path.join(a.out, "engine.json"), "w") as f:
            json.dump(out, f)
        print(json.dumps({k: v for k, v in out["conditions"][-1].items() if k != "requests"})[:2000], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
