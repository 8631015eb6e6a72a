# SPDX-License-Identifier: Apache-2.0
"""The whole-trace simulator as it stood before the streaming one (tieringd/simulate/ at ebc3133),
kept as the reference the streaming simulator is held to, access by access
(tests/unit/test_simulate_stream.py). It builds every access of a trace in memory, so it is for
traces of up to a few million accesses.

Only the harness is frozen: it runs the live policy (tieringd.placement), the live trace readers and
the live cost figures, so a change of the policy moves both simulators alike."""
from __future__ import annotations

import math

from simref import expand, policies
from simref.layout import Layout
from simref.model import TransparentModel, observe
from tieringd.simulate import traces

POLICIES = policies.POLICIES


def outcomes(path, kv_bytes_per_token, capacities, names, *, fmt="auto", limit=None, tick_ms=250.0,
             prefill_chunk_tokens=2048, mover_bytes_s=16e9, delay_windows=0, sample_fraction=1.0, seed=1,
             cxl_blocks=math.inf, tiers=None, heat=None, policy_cfg=None, block_tokens=None,
             trace_block_tokens=None):
    """{(policy, fast capacity in bytes): Outcome (per access: tier served, hit; bytes migrated)}, and
    the expanded accesses."""
    rm = expand.RequestModel(kv_bytes_per_token=kv_bytes_per_token, tick_ms=tick_ms,
                             prefill_chunk_tokens=prefill_chunk_tokens)
    tr = traces.read(path, fmt, limit, trace_block_tokens, block_tokens)
    acc = expand.expand_native(tr, tick_ms) if isinstance(tr, traces.NativeTrace) else expand.expand_requests(tr, rm)
    model = TransparentModel(mover_bytes_s, delay_windows, sample_fraction, seed)
    seen = observe(acc, model)
    out = {}
    for cap in capacities:
        raw = cap * acc.unique_bytes if isinstance(cap, float) else cap
        cb = int(raw // acc.block_bytes) * acc.block_bytes
        caps = (cb // acc.block_bytes, cxl_blocks, math.inf) if math.isfinite(cxl_blocks) else \
            (cb // acc.block_bytes, math.inf)
        layout = Layout(tiers, tuple(float(c) for c in caps))
        for name in names:
            out[(name, cb)] = policies.run_policy(name, acc, layout, model, heat, policy_cfg, None, seen)
    return out, acc
