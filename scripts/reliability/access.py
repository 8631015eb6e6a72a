#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Access: who may do what to a real tieringd, each case tried as the user it is about.

    python scripts/reliability/access.py [--json OUT] [--quick] [--seed S]

The daemon runs as root with ``[control] group = "users"``. Clients run under ``setpriv`` as
uid 65534 with no group (an outsider) and as uid 65533 with ``users`` as a supplementary group (a
member, as the kernel reports it through ``SO_PEERGROUPS``). Each case says what the daemon must do:

- refused: the outsider's ``status``, ``policy-get`` and ``migrate``; the member's ``policy-set`` and
  its ``migrate`` of root's memory; ``tieringctl dax online`` and ``offline`` as a non-root user; a
  registry HELLO that claims root's pid, and a REGISTER of memory the process does not map;
- allowed: the member's ``status``, ``policy-get`` and ``migrate`` of its own memory (any answer
  but ``forbidden``), root's ``policy-set``;
- a flood: with ``max_clients`` at 2 and two members' connections held open, a third member is told
  the daemon is ``busy``, and root's ``status`` is answered on a connection root has reserved
  (``root_reserved_clients``).

A refusal must say why in its message; every control refusal must be logged by the daemon. The
part needs root (setpriv, and a daemon whose peers' credentials mean something): without it, it
skips and says so. ``--quick`` and ``--seed`` change nothing: the cases are fixed.
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, HostDaemon, arguments, interpreter_for, result, skip_unless_root, write  # noqa: E402

from tieringd.shim import protocol as P  # noqa: E402

GROUP, GROUP_GID = "users", 100          # Debian's; the member gets it as a supplementary group
OUTSIDER, MEMBER = 65534, 65533

# Run as the client user: one control request, or one registry exchange; prints what came back.
CLIENT = r'''
import json, os, socket, sys
kind, where, name, params = sys.argv[2], sys.argv[3], sys.argv[4], json.loads(sys.argv[5])
params = {k: (os.getpid() if v == "$self" else v) for k, v in params.items()}
if kind == "control":
    from tieringd.service.control import Client, ControlError
    try:
        with Client(where, timeout_s=60) as c:
            c.request(name, **params)
        print(json.dumps({"refused": False}))
    except ControlError as e:
        print(json.dumps({"refused": e.code == "forbidden", "code": e.code, "message": e.message}))
else:
    from tieringd.shim import protocol as P
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(30)
    s.connect(where)
    pid = params.get("pid", os.getpid())
    s.send(P.Hello(pid=pid, agent="access", seq=1).encode())
    if name == "register":
        s.send(P.Register(region_id=1, start=params["start"], length=params["length"],
                          source=P.Source.MMAP, seq=2).encode())
    out = {"refused": False}
    try:
        while True:
            msg = P.decode(s.recv(P.MAX_RECORD + 1))
            if isinstance(msg, P.Error):
                out = {"refused": True, "code": msg.code, "message": msg.message}
                break
    except (socket.timeout, P.ProtocolError, OSError):
        pass
    print(json.dumps(out))
'''


def as_user(uid: int, groups: list[int], argv: list[str]) -> subprocess.CompletedProcess:
    ids = [f"--reuid={uid}", f"--regid={uid}"] + ([f"--groups={','.join(map(str, groups))}"] if groups
                                                  else ["--clear-groups"])
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": "/nonexistent"}
    return subprocess.run(["setpriv", *ids, *argv], capture_output=True, text=True, env=env, cwd="/",
                          timeout=120)


def client(uid: int, groups: list[int], kind: str, where: str, name: str, **params) -> dict:
    interp = interpreter_for(uid)
    if len(interp) == 1:
        interp = interp + ["-c", "import sys; exec(compile(sys.argv[1], '<client>', 'exec'))"]
    p = as_user(uid, groups, interp + [CLIENT, kind, where, name, json.dumps(params)])
    try:
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"refused": False, "error": (p.stderr or p.stdout)[-400:]}


def cli(uid: int, args: list[str]) -> dict:
    """``tieringctl ARGS`` as ``uid``: refused when it exits non-zero with one line that says root."""
    interp = interpreter_for(uid)
    if len(interp) == 1:
        interp = interp + ["-c", "import sys; exec(compile(sys.argv[1], '<client>', 'exec'))"]
    p = as_user(uid, [], interp + ["import sys; sys.argv[:2] = ['tieringctl']; "
                                   "from tieringd.cli import main; main()", *args])
    err = p.stderr.strip()
    return {"refused": p.returncode != 0 and "needs root" in err and len(err.splitlines()) == 1,
            "code": p.returncode, "message": err[-300:]}


HOLD = r'''
import sys
from tieringd.service.control import Client
c = Client(sys.argv[2], timeout_s=60)
c.request("status")             # answered: this connection holds one of max_clients
print("held", flush=True)
sys.stdin.read()                # until the part closes our stdin
'''


def flood(d: HostDaemon) -> list[tuple[str, bool | None, dict]]:
    """Members hold every one of ``max_clients`` (2): a third member is busy (``None``: must be
    busy), root's ``status`` is answered. The limit is put back afterwards."""
    ctl = str(d.run_dir)
    d.ask("policy-set", set={"control.max_clients": 2})
    interp = interpreter_for(MEMBER)
    if len(interp) == 1:
        interp = interp + ["-c", "import sys; exec(compile(sys.argv[1], '<client>', 'exec'))"]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": "/nonexistent"}
    # root's own earlier connections are gone (the status asking counts itself) before members come
    deadline = time.monotonic() + 30
    while d.ask("status")["control"]["clients"] > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    holders, held = [], []
    try:
        for _ in range(2):          # one after the other: each is answered before the next connects
            holders.append(subprocess.Popen(["setpriv", f"--reuid={MEMBER}", f"--regid={MEMBER}",
                                             f"--groups={GROUP_GID}", *interp, HOLD, ctl], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, text=True, env=env, cwd="/"))
            held.append(holders[-1].stdout.readline().strip() == "held")
        third = client(MEMBER, [GROUP_GID], "control", ctl, "status")
        try:
            d.ask("status", timeout_s=60)
            root = {"refused": False}
        except Exception as e:      # noqa: BLE001 — whatever it was, root got no answer
            root = {"refused": True, "error": str(e)}
    finally:
        for h in holders:
            h.stdin.close()
            h.wait(60)
    d.ask("policy-set", set={"control.max_clients": 64})
    third["held"] = sum(held)
    return [("member: a third connection while two members hold max_clients = 2", None, third),
            ("root: status while members hold every one of max_clients", False, root | {"held": sum(held)})]


def cases(d: HostDaemon) -> list[tuple[str, bool | None, dict]]:
    """(case, must be refused (None: must be told busy), what came back), each tried in turn
    against the running daemon."""
    ctl, reg = str(d.run_dir), str(d.run_dir / "registry.sock")
    out = [
        ("outsider: status", True, client(OUTSIDER, [], "control", ctl, "status")),
        ("outsider: policy-get", True, client(OUTSIDER, [], "control", ctl, "policy-get")),
        ("outsider: migrate of its own memory", True,
         client(OUTSIDER, [], "control", ctl, "migrate", pid="$self", all=True, to="dram")),
        ("member: status", False, client(MEMBER, [GROUP_GID], "control", ctl, "status")),
        ("member: policy-get", False, client(MEMBER, [GROUP_GID], "control", ctl, "policy-get")),
        ("member: migrate of its own memory", False,
         client(MEMBER, [GROUP_GID], "control", ctl, "migrate", pid="$self", all=True, to="dram")),
        ("member: migrate of root's memory (the daemon's)", True,
         client(MEMBER, [GROUP_GID], "control", ctl, "migrate", pid=d.pid, all=True, to="dram")),
        ("member: policy-set", True,
         client(MEMBER, [GROUP_GID], "control", ctl, "policy-set", set={"policy.interval_ms": 200})),
        ("non-root: tieringctl dax online", True, cli(OUTSIDER, ["dax", "online", "dax0.0"])),
        ("non-root: tieringctl dax offline", True, cli(OUTSIDER, ["dax", "offline", "dax0.0"])),
        ("registry: HELLO claiming root's pid", True, client(OUTSIDER, [], "registry", reg, "hello", pid=d.pid)),
        ("registry: REGISTER of memory the process does not map", True,
         client(OUTSIDER, [], "registry", reg, "register", start=1 << 45, length=2 << 20)),
    ]
    try:
        d.ask("policy-set", set={"policy.interval_ms": 100})
        out.append(("root: policy-set", False, {"refused": False}))
    except Exception as e:          # noqa: BLE001 — whatever it was, root was not let do it
        out.append(("root: policy-set", False, {"refused": True, "message": str(e)}))
    return out + flood(d)


def judge(tried: list[tuple[str, bool, dict]], log: str) -> tuple[int, int, list[str]]:
    """Refused as promised, let through (must have been refused), and every case that went wrong."""
    refused = let_through = 0
    wrong = []
    for name, must_refuse, got in tried:
        if must_refuse is None:
            if got.get("code") != "busy" or got.get("held") != 2:
                wrong.append(f"{name}: not told busy (or the members held {got.get('held')} of 2): {got}")
        elif must_refuse and got.get("refused"):
            refused += 1
            if not got.get("message"):
                wrong.append(f"{name}: refused without saying why")
        elif must_refuse:
            let_through += 1
            wrong.append(f"{name}: NOT refused: {got}")
        elif got.get("refused") or got.get("error"):
            wrong.append(f"{name}: refused or failed, but it is allowed: {got}")
    control_refusals = sum(1 for n, m, g in tried if m and g.get("refused") and g.get("code") == "forbidden")
    logged = log.count("control: refused")
    if logged < control_refusals:
        wrong.append(f"{control_refusals} control refusals, {logged} logged")
    return refused, let_through, wrong


def main() -> int:
    args = arguments(__doc__).parse_args()
    print("access: the cases are fixed (no seed)", flush=True)
    skipped = skip_unless_root(args, "access", "who may do what", "accesses")
    if skipped is not None:
        return skipped
    d = HostDaemon(config=f'[control]\ngroup = "{GROUP}"\n', tag="access")
    try:
        d.wait_ready()
        tried = cases(d)
        alive, log, tracebacks = d.alive(), d.log(), d.tracebacks()
        rc = d.stop() if alive else d.proc.returncode
    finally:
        d.cleanup(keep_log=REPO / "build" / "reliability" / "access-daemon.log")
    refused, let_through, wrong = judge(tried, log)
    for name, must_refuse, got in tried:
        print(f"access: {name}: {got.get('code') or ('refused' if got.get('refused') else 'allowed')} "
              f"({'must be busy' if must_refuse is None else 'must be refused' if must_refuse else 'allowed'}): {got.get('message', '')[:160]}", flush=True)
    for w in wrong:
        print(f"access: WRONG: {w}", flush=True)
    crashes = (0 if alive else 1) + len(tracebacks)
    return write(args, result("access", "who may do what: outsider, group member, root, registry peers",
                              tried=len(tried), unit="accesses", ok=not wrong and not crashes and rc == 0,
                              crashes=crashes, refused=refused, let_through=let_through,
                              figures={"daemon_rc": rc, "cases": {n: g for n, _, g in tried}},
                              cases=wrong + tracebacks))


if __name__ == "__main__":
    sys.exit(main())
