#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Fuzz the configuration check: generated files through ``tieringd --check-config``'s own function,
a sample through the command itself, and accepted files through a real start.

    python scripts/reliability/fuzz_config.py [--json OUT] [--quick] [--seed S] [--files N]

Files are mutations of the shipped ``etc/tieringd.toml`` (every key, commented out): keys uncommented
with extreme numbers (NaN, ±inf, 0, -1, 1e308, 2^64, huge integers), in-range values, values of the
wrong type, unknown keys and tables, keys outside any table, tables given twice, inline tables and
arrays of tables, strings cut short, bytes that are not UTF-8, random bytes, and lines shuffled,
duplicated or cut. Each file goes through :func:`tieringd.settings.check_file` (what ``tieringd
--check-config`` runs); the answer must be "FILE: ok", or one line that starts ``FILE:LINE:`` — never
a traceback, never a second line. Every 500th file also goes through the ``tieringd --check-config``
command, whose output must be the same; and files that were accepted are started as a real daemon
(a few): it must answer ``status`` and stop cleanly — a file the check passes must not crash a start.
"""
from __future__ import annotations

import io
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, HostDaemon, arguments, result, seed_of, write  # noqa: E402

from tieringd import settings  # noqa: E402

EXTREME = ("nan", "inf", "-inf", "+inf", "0", "-1", "1e308", "-1e308", "18446744073709551616",
           "99999999999999999999999999999", "-9223372036854775809", "0.0", "1e-320", "0x7fffffff",
           "1_000", "true", '"fast"', '""', "[]", "[1, nan]", "{}", '{ a = 1 }', "1979-05-27")
ACCEPTED_STARTS = 6


class Generator:
    def __init__(self, seed: int):
        self.r = random.Random(seed)
        self.base = settings.default_file_text().splitlines()
        self.keys = [i for i, line in enumerate(self.base) if re.match(r"^# \w+ = ", line)]
        self.ranges = self._ranges()

    def _ranges(self) -> dict[str, tuple[float, float]]:
        import dataclasses
        from tieringd import config
        out = {}
        for name, (cls, _) in settings.TABLES.items():
            for f in dataclasses.fields(cls):
                rng = config.range_of(f)
                if rng is not None:
                    out[f.name] = (rng.lo, rng.hi)
        return out

    def value(self, key: str) -> str:
        r = self.r
        if key in self.ranges and r.random() < 0.3:
            lo, hi = self.ranges[key]
            x = r.uniform(lo, hi)
            return str(int(x)) if r.random() < 0.5 and math.isfinite(x) else repr(x)
        return r.choice(EXTREME)

    def text(self) -> bytes:
        r = self.r
        lines = list(self.base)
        for i in r.sample(self.keys, r.randrange(1, 6)):
            key = lines[i].split()[1]
            lines[i] = f"{key} = {self.value(key)}"
        kind = r.random()
        if kind < 0.1:
            lines.insert(r.randrange(len(lines)), r.choice(("nosuch = 1", "[nosuch]", "[policy.nosuch]",
                                                            "[[policy]]", "policy = 3", "[policy]", "x.y = 1")))
        elif kind < 0.15:
            lines.insert(0, r.choice(("interval_ms = 100", "top = true")))
        elif kind < 0.2:
            i = r.randrange(len(lines))
            lines[i] = lines[i][: r.randrange(len(lines[i]) + 1)] + r.choice(('"', "'", "[", "=", "\\"))
        elif kind < 0.25:
            lines = [line for line in lines if not line.startswith("[")]
        elif kind < 0.3:
            r.shuffle(lines)
        elif kind < 0.35:
            i = r.randrange(len(lines))
            lines[i:i] = lines[i: i + r.randrange(1, 20)]
        text = "\n".join(lines).encode()
        if r.random() < 0.05:
            pos = r.randrange(len(text))
            text = text[:pos] + r.choice((b"\xff", b"\xc3", b"\x00", b"\x7f", r.randbytes(8))) + text[pos:]
        if r.random() < 0.02:
            text = r.randbytes(r.randrange(1, 400))
        if r.random() < 0.02:
            text = text[: r.randrange(len(text) + 1)]
        return text


def check_one(path: str) -> tuple[int, str, str, str | None]:
    """check_file's exit, stdout, stderr; the traceback if it raised instead."""
    out, err = io.StringIO(), io.StringIO()
    try:
        rc = settings.check_file(path, out, err)
    except Exception:
        import traceback
        return 2, out.getvalue(), err.getvalue(), traceback.format_exc()
    return rc, out.getvalue(), err.getvalue(), None


def judge(path: str, rc: int, out: str, err: str) -> str | None:
    """None when the answer is what --check-config promises, else what is wrong with it."""
    if rc == 0:
        return None if out.startswith(f"{path}: ok") and out.count("\n") == 1 and not err else "ok but odd output"
    if out or err.count("\n") != 1:
        return "not one line"
    if not re.match(re.escape(path) + r":\d+: ", err):
        return "no file:line"
    return None


def main() -> int:
    ap = arguments(__doc__)
    ap.add_argument("--files", type=int, default=None, help="files to check (default 100000; quick 3000)")
    args = ap.parse_args()
    seed = seed_of(args, "fuzz-config")
    n = args.files or (3_000 if args.quick else 100_000)
    gen = Generator(seed)
    tmp = Path(tempfile.mkdtemp(prefix="tieringd-rel-config-"))
    path = str(tmp / "tieringd.toml")
    bad: dict[str, list[str]] = {}
    accepted: list[bytes] = []
    commands = command_mismatch = 0
    t0 = time.monotonic()
    for i in range(n):
        text = gen.text()
        Path(path).write_bytes(text)
        rc, out, err, tb = check_one(path)
        why = "traceback: " + tb.strip().splitlines()[-1] if tb else judge(path, rc, out, err)
        if why:
            bad.setdefault(why.split(":")[0], []).append(f"file {i}: {why}: {err.strip()[:200]!r}")
            (tmp / f"bad-{i}.toml").write_bytes(text)
        if rc == 0 and len(accepted) < 200:
            accepted.append(text)
        if i % 500 == 0:
            commands += 1
            p = subprocess.run([sys.executable, "-m", "tieringd.daemon", "--check-config", path], cwd=REPO,
                               capture_output=True, text=True, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
            if (p.returncode, p.stdout, p.stderr) != (rc, out, err):
                command_mismatch += 1
                bad.setdefault("command differs", []).append(f"file {i}: {p.returncode} {p.stderr[-300:]!r}")
    wall = time.monotonic() - t0
    sample = gen.r.sample(accepted, min(len(accepted), 2 if args.quick else ACCEPTED_STARTS))
    starts = start_accepted(sample) if os.geteuid() == 0 else []     # the daemon is root's
    notes = "" if os.geteuid() == 0 else "accepted files not started: a daemon needs root"
    failures = sum(len(v) for v in bad.values())
    start_failures = [s for s in starts if not s["ok"]]
    figures = {"files": n, "files_per_s": round(n / wall), "wall_s": round(wall, 1),
               "accepted": sum(1 for _ in accepted), "through_the_command": commands,
               "answers_wrong": {k: len(v) for k, v in bad.items()}, "starts": starts}
    print(f"fuzz-config: {n} files in {wall:.1f} s, {failures} answers not one line at file:line "
          f"({ {k: len(v) for k, v in bad.items()} }), {commands} through the command; "
          f"{len(starts)} accepted files started, {len(start_failures)} failed", flush=True)
    for k, v in bad.items():
        for line in v[:3]:
            print(f"fuzz-config: {line}", flush=True)
    for s in start_failures:
        print(f"fuzz-config: start failed: {s}", flush=True)
    if failures == 0:
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        print(f"fuzz-config: the files answered wrongly are kept in {tmp}", flush=True)
    crashes = len(bad.get("traceback", [])) + len(start_failures)
    return write(args, result("fuzz-config", "configuration files: tieringd --check-config, and starts of accepted ones",
                              tried=n, unit="inputs", ok=failures == 0 and not start_failures, crashes=crashes,
                              seed=seed, figures=figures, cases=[x for v in bad.values() for x in v[:10]],
                              notes=notes))


def start_accepted(texts: list[bytes]) -> list[dict]:
    """Start a daemon with each accepted file: it must answer status and stop with 0."""
    out = []
    for text in texts:
        d = HostDaemon(config=text.decode(), tag="config")
        rec = {"ok": False}
        try:
            rec["ready_s"] = round(d.wait_ready(timeout_s=120), 2)
            rec["ok"] = True
        except RuntimeError as e:
            rec["error"] = str(e)[-600:]
        rec["rc"] = d.stop()
        rec["tracebacks"] = d.tracebacks()
        rec["ok"] = rec["ok"] and rec["rc"] == 0 and not rec["tracebacks"]
        if not rec["ok"]:
            rec["file"] = text.decode()[-3000:]
        d.cleanup()
        out.append(rec)
    return out


if __name__ == "__main__":
    sys.exit(main())
