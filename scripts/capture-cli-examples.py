#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The example outputs of docs/cli.md, captured from the real commands (the way bcc keeps its
``*_example.txt``): one file per example under docs/cli/, each included verbatim in docs/cli.md after
a ``<!-- capture: cli/NAME.txt -->`` marker.

    python scripts/capture-cli-examples.py            # capture the examples that need no lab, sync docs/cli.md
    python scripts/capture-cli-examples.py --check    # re-run the re-checked ones and diff (exit 1 on a change)
    python scripts/capture-cli-examples.py --only numa --only tiers
    python scripts/capture-cli-examples.py --lab      # boot one lab guest (cxl, 6.12, nodes of 1 GiB) for the
                                                      # daemon's commands (a few minutes under TCG)

Kinds of example:

- ``fixture``: reads only files in the repository — sysfs trees captured from lab guests
  (``TIERINGD_FS_ROOT=tests/fixtures/sysfs/<tree>``), the shipped trace data/traces/, the example
  configuration, ``--help`` texts, the error of a command when no daemon runs. Deterministic: re-run by
  ``--check`` and tests/unit/test_cli_examples.py, compared after :func:`normalise`.
- ``host``: depends on the machine it runs on (``doctor``, ``probe``): captured once, on the build
  machine, never re-checked. ``pool`` too: two pool agents against a real etcd cluster on loopback,
  one of them served as the daemon's (:func:`capture_pool`).
- ``lab``: needs the running daemon and a workload: ``--lab`` boots the ``cxl`` profile on kernel 6.12
  with DRAM nodes of 1 GiB (as ``make demo``), starts ``tieringd``, runs ``build/tests/kv_workload``
  under ``tieringctl run``, waits until the daemon has ticked and placed the workload's blocks, then
  runs each of the daemon's commands once (``sample`` last) with this same script in the guest
  (``--guest DIR``). Never re-checked.

Every command runs with the environment below (:func:`base_env`): no ``TIERINGD_*`` variable of the
caller, no configuration file (``TIERINGD_CONFIG=/dev/null``: all defaults), ``COLUMNS=80``, Python
unbuffered so that stdout and stderr interleave as on a terminal; both go into the capture, then
``[exit status N]`` when it is not 0.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CAPTURES = REPO / "docs" / "cli"
CLI_MD = REPO / "docs" / "cli.md"
TRACE = "data/traces/mooncake-synthetic.jsonl"
NO_DAEMON = "/tmp/no-tieringd"          # a run directory where no daemon runs: the error path
SYSFS = "tests/fixtures/sysfs"
BIN = Path(sys.executable).parent       # the venv's tieringctl and tieringd: their own program names
MARKER = re.compile(r"<!-- capture: cli/(?P<name>[\w.-]+)\.txt -->\n```text\n(?P<body>.*?)```\n", re.S)

# Lab: the guest, the workload, the order of the daemon's commands.
LAB_PROFILE, LAB_KERNEL, LAB_NODE_MIB = "cxl", "6.12", 1024
RUN_DIR = "/run/tieringd"
WORKLOAD = ["build/tests/kv_workload", "--pool", "1.2G", "--seconds", "3600", "--report", "4",
            "--layout", "scattered"]
WORKLOAD_AGE_S = 40      # the daemon's commands run once the workload has been reading this long
LAB_KEEP = REPO / "build" / "cli-examples-lab"


@dataclasses.dataclass(frozen=True)
class Cmd:
    argv: tuple[str, ...]                            # as a user types it: tieringctl … or tieringd …
    env: tuple[tuple[str, str], ...] = ()            # shown before the command
    head: int | None = None                          # keep the first lines only

    def display(self) -> str:
        return " ".join([*(f"{k}={v}" for k, v in self.env), shlex.join(self.argv)])


@dataclasses.dataclass(frozen=True)
class Example:
    name: str                 # docs/cli/NAME.txt
    kind: str                 # fixture, host, lab
    cmds: tuple[Cmd, ...]
    needs_shim: bool = False  # build/libtieringd-shim.so (make)

    @property
    def checked(self) -> bool:
        return self.kind == "fixture"

    @property
    def path(self) -> Path:
        return CAPTURES / f"{self.name}.txt"


def ctl(*args: str, env: dict[str, str] | None = None, head: int | None = None) -> Cmd:
    return Cmd(("tieringctl", *args), tuple((env or {}).items()), head)


def _subcommands() -> list[str]:
    sys.path.insert(0, str(REPO))
    from tieringd.cli import SUBCOMMANDS
    return sorted(SUBCOMMANDS)


def examples() -> list[Example]:
    fs = lambda tree: {"TIERINGD_FS_ROOT": f"{SYSFS}/{tree}"}
    nod = {"TIERINGD_RUN_DIR": NO_DAEMON}
    out = [
        Example("numa", "fixture", (ctl("numa", env=fs("pmem-6.12")), ctl("numa", env=fs("cxl-6.1")))),
        Example("tiers", "fixture", (ctl("tiers", env=fs("pmem-6.12")),)),
        Example("dax", "fixture", (ctl("dax", "list", env=fs("pmem-6.12")),
                                   ctl("dax", "list", env=fs("cxl-type3-6.12")))),
        Example("simulate", "fixture", (ctl("simulate", TRACE, "--limit", "300", "--fast-capacity", "5%",
                                            "--fast-capacity", "10%", "--no-progress"),)),
        Example("tune", "fixture", (ctl("tune", TRACE, "--limit", "200", "--trials", "3", "--fast-capacity",
                                        "5%", "-o", "-", "--no-progress"),)),
        Example("no-daemon", "fixture", (ctl("status", env=nod), ctl("status", "--json", env=nod),
                                         ctl("policy", "get", env=nod))),
        Example("run-no-daemon", "fixture", (ctl("run", "--", "echo", "hello", env=nod),
                                             ctl("run", "-v", "--", "true", env=nod)),
                needs_shim=True),
        Example("tieringd-check-config", "fixture", (Cmd(("tieringd", "--check-config", "etc/tieringd.toml")),)),
        Example("help-tieringctl", "fixture", (ctl("--help"),)),
        Example("help-tieringd", "fixture", (Cmd(("tieringd", "--help")),)),
        Example("doctor", "host", (ctl("doctor"),)),
        Example("probe", "host", (ctl("probe"),)),
        Example("pool", "host", (ctl("pool"), ctl("status", head=8))),
    ]
    for name in _subcommands():
        cmds = [ctl(name, "--help")]
        if name == "dax":
            cmds += [ctl("dax", sub, "--help") for sub in ("list", "online", "offline")]
        out.append(Example(f"help-{name}", "fixture", tuple(cmds)))
    # the lab's: run in the guest by guest(), in this order (commands filled in there: pid, address)
    out += [Example(name, "lab", ()) for name in LAB_ORDER]
    return out


LAB_ORDER = ("tieringd", "run", "status", "top", "regions", "heatmap", "stats", "policy", "migrate", "sample")


def by_name() -> dict[str, Example]:
    return {e.name: e for e in examples()}


# ---- running and formatting ---------------------------------------------------------------------------

def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERINGD_") and k != "LD_PRELOAD"}
    env.update({"COLUMNS": "80", "LINES": "24", "PYTHONUNBUFFERED": "1", "PYTHONIOENCODING": "utf-8",
                "TIERINGD_CONFIG": "/dev/null",
                # this checkout's package, whichever checkout the venv was installed from
                "PYTHONPATH": str(REPO)})
    return env


def program(argv: tuple[str, ...]) -> list[str]:
    exe = BIN / argv[0]
    return [str(exe if exe.exists() else shutil.which(argv[0]) or argv[0]), *argv[1:]]


def run_cmd(cmd: Cmd, timeout_s: float = 600, env: dict[str, str] | None = None) -> str:
    """The command's capture: ``$ COMMAND``, its stdout and stderr as they came, the exit status."""
    env = {**(env or base_env()), **dict(cmd.env)}
    r = subprocess.run(program(cmd.argv), cwd=REPO, env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=timeout_s)
    return render(cmd, r.stdout, r.returncode)


def render(cmd: Cmd, output: str, rc: int) -> str:
    lines = output.rstrip("\n").split("\n") if output.strip() else []
    if cmd.head is not None and len(lines) > cmd.head:
        lines = lines[: cmd.head] + [f"[… {len(lines) - cmd.head} more lines]"]
    text = f"$ {cmd.display()}\n" + "".join(line.rstrip() + "\n" for line in lines)
    return text + (f"[exit status {rc}]\n" if rc else "")


def capture(ex: Example) -> str:
    if ex.name == "pool":
        return capture_pool(ex)
    return "\n".join(run_cmd(c) for c in ex.cmds)


def capture_pool(ex: Example) -> str:
    """``tieringctl pool`` as host infer-a's daemon answers it: two pool agents on one file standing
    for the device, a three-member etcd on loopback (Debian's etcd-server), and the daemon's service
    around the stand-in loop of the service tests — the setup of tests/host/test_pool_cli.py — and 8
    blocks of 256 KiB both hosts store alike (``PoolAgent.store_block``): kept once, b's copy saved."""
    for sub in ("tests", "tests/host", "scripts/lab/pool"):
        sys.path.insert(0, str(REPO / sub))
    from etcdcluster import EtcdCluster
    import pool_support as P
    with tempfile.TemporaryDirectory(prefix="pool-example-") as tmp, EtcdCluster(Path(tmp) / "etcd") as etcd:
        dev = P.pool_file(Path(tmp), 32)
        cfgs = [P.config(etcd, dev, name, prefix="/tieringd/pool-a/") for name in ("infer-a", "infer-b")]
        with P.hosts(*cfgs) as (a, b):
            P.settle([a, b], lambda: a.member.state == b.member.state == "member" and P.held(a) and P.held(b))
            P.Demand(a).press([a, b], 5 * P.EXT)
            P.Demand(b).press([a, b], 2 * P.EXT)
            for _ in range(8):                # a shared prefix: 8 blocks both hold alike, kept once
                block = os.urandom(256 << 10)
                a.store_block(block)
                b.store_block(block)
            for x in (b, a):
                x.beat()
            run = Path(tmp) / "run"
            run.mkdir()
            env = {**base_env(), "TIERINGD_RUN_DIR": str(run)}
            with P.serving_pool(a, str(run)):
                return "\n".join(run_cmd(c, env=env) for c in ex.cmds)


def normalise(text: str) -> str:
    """What differs from run to run of a deterministic command: wall times (``tune``'s "N settings in
    S s") and process ids (the shim's log lines, ``tieringd-shim[PID]``). Nothing else: every other
    byte must match the committed capture."""
    text = re.sub(r"(settings in )[\d.]+( s)", r"\1<wall>\2", text)
    return re.sub(r"(tieringd-shim\[)\d+(\])", r"\1<pid>\2", text)


# ---- docs/cli.md ----------------------------------------------------------------------------------------

def sync_doc(text: str, captures: dict[str, str]) -> str:
    """docs/cli.md with each marked block replaced by its capture file's text."""
    def repl(m: re.Match) -> str:
        body = captures.get(m["name"], m["body"])
        return f"<!-- capture: cli/{m['name']}.txt -->\n```text\n{body}```\n"
    return MARKER.sub(repl, text)


def doc_blocks(text: str) -> dict[str, str]:
    return {m["name"]: m["body"] for m in MARKER.finditer(text)}


def committed() -> dict[str, str]:
    return {p.stem: p.read_text() for p in sorted(CAPTURES.glob("*.txt"))}


def write_doc() -> None:
    if CLI_MD.exists():
        CLI_MD.write_text(sync_doc(CLI_MD.read_text(), committed()))


# ---- the lab --------------------------------------------------------------------------------------------

def _ask(name: str, **params):
    sys.path.insert(0, str(REPO))
    from tieringd.service.control import Client
    with Client(RUN_DIR, timeout_s=120) as c:
        return c.request(name, **params)


def _wait(what: str, cond, timeout_s: float, every_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            got = cond()
        except Exception:                   # noqa: BLE001 — the daemon is still starting
            got = None
        if got:
            return got
        time.sleep(every_s)
    raise SystemExit(f"guest: {what}: not after {timeout_s:g} s")


def guest(out: Path) -> int:
    """Inside the lab guest (root, cwd = the repository, read-only): the daemon, the workload under
    ``tieringctl run``, then each of the daemon's commands once; the captures go to ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    log = lambda msg: print(f"[{time.monotonic() - t0:7.1f}] {msg}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    if not os.path.isdir("/sys/kernel/debug/sched"):
        subprocess.run(["mount", "-t", "debugfs", "none", "/sys/kernel/debug"], capture_output=True)
    env = {**base_env(), "TIERINGD_RUN_DIR": RUN_DIR}
    del env["TIERINGD_CONFIG"]              # the guest has no /etc/tieringd: all defaults, no file named
    daemon_log = out / "daemon.log"
    daemon = subprocess.Popen(program(("tieringd",)), cwd=REPO, env=env, stdout=open(daemon_log, "w"),
                              stderr=subprocess.STDOUT, preexec_fn=lambda: os.sched_setaffinity(0, {0}))
    _wait("the daemon ticks", lambda: _ask("status")["ticks"]["count"] > 0, 600)
    log("daemon ticking")
    run_cmd_ = ctl("run", "-v", "--", *WORKLOAD)
    kv_out = out / "kv.out"
    kv = subprocess.Popen(program(run_cmd_.argv), cwd=REPO, env=env, stdout=open(kv_out, "w"),
                          stderr=subprocess.STDOUT)
    rc = 0
    try:
        def started():
            for line in kv_out.read_text().splitlines():
                if line.startswith("{") and json.loads(line).get("event") == "start":
                    return json.loads(line)
            return None
        start = _wait("the workload starts", started, 600)
        pid = start["pid"]
        log(f"workload pid {pid}")
        regions = _wait("its regions register and are placed",
                        lambda: [r for r in _ask("regions", pid=pid)["regions"]
                                 if sum(v for k, v in r["bytes_by_node"].items() if k != "not_present")],
                        300)
        t_start = time.monotonic()
        time.sleep(max(0.0, t_start + WORKLOAD_AGE_S - time.monotonic()))
        log("running the commands")
        region = max(regions, key=lambda r: r["length"])          # the pool: 64 MiB of its end move
        tail = region["start"] + region["length"] - (64 << 20)
        cmds = {
            "status": [ctl("status")],
            "top": [ctl("top", "-b", "-n", "2", "-d", "3")],
            "regions": [ctl("regions")],
            "heatmap": [ctl("heatmap", "--pid", str(pid), "--seconds", "8", "--interval", "2")],
            "stats": [ctl("stats")],
            "policy": [ctl("policy", "get"), ctl("policy", "get", "interval_ms")],
            "migrate": [ctl("migrate", "--pid", str(pid), "--range", f"{tail:#x}+64M", "--to",
                            "cxl-dram")],
            "sample": [ctl("sample", "--pid", str(pid), "--seconds", "6", "--warmup-s", "20", "--top", "5")],
        }
        for name in LAB_ORDER:
            if name not in cmds:
                continue
            text = "\n".join(run_cmd(c, env=env) for c in cmds[name])
            (out / f"{name}.txt").write_text(text)
            log(f"{name} captured")
    except BaseException:
        rc = 1
        raise
    finally:
        kv.send_signal(signal.SIGTERM)
        try:
            kv.wait(600)
        except subprocess.TimeoutExpired:
            kv.kill()
        daemon.send_signal(signal.SIGTERM)
        try:
            drc = daemon.wait(120)
        except subprocess.TimeoutExpired:
            daemon.kill()
            drc = daemon.wait()
        (out / "daemon.rc").write_text(f"{drc}\n")
        render_lab_logs(out)
        log(f"done (daemon exit {drc}, workload exit {kv.returncode})")
    return rc


def _cut(line: str, width: int = 150) -> str:
    return line if len(line) <= width else line[: width - 2] + " …"


def render_lab_logs(d: Path) -> None:
    """run.txt and tieringd.txt from the guest's raw logs in ``d`` (kv.out: the workload under
    ``tieringctl run``, stdout and stderr; daemon.log, daemon.rc): the run's first lines and its
    last, long JSON lines cut; the daemon's whole log, from its start to its stop by SIGTERM."""
    kv = (d / "kv.out").read_text().splitlines()
    shown = [_cut(x) for x in kv[:6]]
    if len(kv) > 7:
        shown.append(f"[… {len(kv) - 7} more lines: a report every 4 s]")
    shown += [_cut(x) for x in kv[6:][-1:]]
    (d / "run.txt").write_text(render(ctl("run", "-v", "--", *WORKLOAD), "\n".join(shown), 0))
    rc_file = d / "daemon.rc"
    rc = int(rc_file.read_text()) if rc_file.exists() else 0
    log = (d / "daemon.log").read_text().splitlines()
    (d / "tieringd.txt").write_text(render(Cmd(("tieringd",)), "\n".join(log), rc))


def lab() -> int:
    sys.path.insert(0, str(REPO / "scripts" / "lab"))
    from loop_report import lab_module
    labm = lab_module()
    out = Path(tempfile.mkdtemp(prefix="cli-examples-"))
    script = ".venv/bin/python scripts/capture-cli-examples.py --guest $LAB_OUT > $LAB_OUT/guest.log 2>&1\n"
    print(f"capture: booting the lab ({LAB_PROFILE}, Linux {LAB_KERNEL}, nodes of {LAB_NODE_MIB} MiB) under "
          f"QEMU; a few minutes", flush=True)
    r = labm.run(script, profile=LAB_PROFILE, kernel=LAB_KERNEL, timeout_s=2400, out_dir=out,
                 node_mib=LAB_NODE_MIB)
    shutil.rmtree(LAB_KEEP, ignore_errors=True)       # the guest's files (logs, raw output) to look at
    shutil.copytree(out, LAB_KEEP)
    keep = LAB_KEEP
    glog = (out / "guest.log").read_text() if (out / "guest.log").exists() else ""
    missing = [n for n in LAB_ORDER if not (out / f"{n}.txt").exists()]
    if r.rc != 0 or missing:
        print(f"capture: the guest failed (exit {r.rc}; missing {missing}); files in {keep}; its log:\n"
              f"{glog[-4000:]}\n"
              f"{r.stderr[-2000:]}", file=sys.stderr)
        return 1
    CAPTURES.mkdir(parents=True, exist_ok=True)
    for name in LAB_ORDER:
        shutil.copyfile(out / f"{name}.txt", CAPTURES / f"{name}.txt")
    write_doc()
    print(f"capture: {len(LAB_ORDER)} lab captures from Linux {r.kernel_release} in {r.wall_s:.0f} s; the "
          f"guest's files: {keep}")
    return 0


# ---- main -----------------------------------------------------------------------------------------------

def shim_built() -> bool:
    return (REPO / "build" / "libtieringd-shim.so").exists()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="re-run the re-checked examples and diff")
    ap.add_argument("--only", action="append", default=[], help="these examples only (repeatable)")
    ap.add_argument("--lab", action="store_true", help="boot the lab for the daemon's examples")
    ap.add_argument("--guest", metavar="DIR", help=argparse.SUPPRESS)
    ap.add_argument("--lab-logs", action="store_true",
                    help=f"re-render run.txt and tieringd.txt from the last --lab's logs ({LAB_KEEP.relative_to(REPO)})")
    a = ap.parse_args()
    if a.guest:
        return guest(Path(a.guest))
    if a.lab_logs:
        render_lab_logs(LAB_KEEP)
        for name in ("run", "tieringd"):
            shutil.copyfile(LAB_KEEP / f"{name}.txt", CAPTURES / f"{name}.txt")
        write_doc()
        return 0
    if a.lab:
        return lab()
    known = by_name()
    unknown = [n for n in a.only if n not in known]
    if unknown:
        ap.error(f"unknown example {unknown[0]!r} (known: {', '.join(known)})")
    chosen = [known[n] for n in a.only] if a.only else [e for e in known.values() if e.kind != "lab"]
    if a.check:
        chosen = [e for e in chosen if e.checked]
    bad = 0
    for ex in chosen:
        if ex.kind == "lab":
            print(f"{ex.name}: a lab example (--lab)", file=sys.stderr)
            continue
        if ex.needs_shim and not shim_built():
            print(f"{ex.name}: skipped, the shim is not built (make)", file=sys.stderr)
            continue
        text = capture(ex)
        if a.check:
            old = ex.path.read_text() if ex.path.exists() else ""
            if normalise(old) != normalise(text):
                bad += 1
                sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), text.splitlines(True),
                                                           str(ex.path.relative_to(REPO)), "now"))
        else:
            CAPTURES.mkdir(parents=True, exist_ok=True)
            ex.path.write_text(text)
            print(f"{ex.path.relative_to(REPO)}: {len(text.splitlines())} lines", file=sys.stderr)
    if a.check:
        doc = doc_blocks(CLI_MD.read_text()) if CLI_MD.exists() else {}
        for name, text in committed().items():
            if doc.get(name) != text:
                bad += 1
                print(f"docs/cli.md: the block of cli/{name}.txt differs from the file (run the script "
                      f"without --check to sync)")
        print(f"capture --check: {len(chosen)} examples, {bad} differ", file=sys.stderr)
        return int(bad > 0)
    write_doc()
    return 0


if __name__ == "__main__":
    sys.exit(main())
