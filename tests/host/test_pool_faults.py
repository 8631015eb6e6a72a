# SPDX-License-Identifier: Apache-2.0
"""The pool's faults against a real etcd (a three-member cluster of Debian's etcd-server on loopback,
tests/etcd_support.py; never a mock): the leader killed under running agents, every member gone and
back, a host that is a process of its own killed with SIGKILL, forged and oversized entries, and
capacity handed from a shrinking host to a growing one. Hosts are pool agents opened as the daemon
opens them (tests/host/pool_support.py).

Waits are for states, with a generous safety net; the times measured (the capacity hand-over, a
dead host's extents coming free) are recorded as the tests' properties (``record_property``), never
asserted: under load on two shared cores they mean little."""
from __future__ import annotations

import json
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pool_support import EXT, ROUNDS, TTL, Demand, claims_in_etcd, config, held, hosts, of, pool_file, settle
from tieringd.pool import etcd as E
from tieringd.pool import schema as S

pytestmark = pytest.mark.etcd

HOST_PROC = Path(__file__).resolve().parent / "pool_host_proc.py"
SAFETY_NET_S = 120.0          # a state not reached by then is a failure; never a timing


def wait_for(what: str, done, every_s: float = 0.2) -> None:
    deadline = time.monotonic() + SAFETY_NET_S
    while not done():
        assert time.monotonic() < deadline, f"{what}: not reached in {SAFETY_NET_S:.0f} s"
        time.sleep(every_s)


def in_etcd_as_held(agents, client: E.Etcd) -> bool:
    claims = claims_in_etcd(client)
    return all(of(claims, a.host) == set(held(a)) for a in agents)


# ---- etcd's members --------------------------------------------------------------------------------

def test_the_etcd_leader_killed_under_running_agents_loses_nothing(etcd, tmp_path):
    """The member both clients talk to is made the leader, then killed with SIGKILL while both
    agents beat on their own threads: they go on through the other two members after the election,
    on the same leases, holding the same extents, and etcd still says so."""
    dev = pool_file(tmp_path, 24)
    with hosts(config(etcd, dev, "host-a"), config(etcd, dev, "host-b")) as (a, b):
        settle([a, b], lambda: a.member.state == b.member.state == "member" and held(a) and held(b))
        Demand(a).press([a, b], 4 * EXT)
        before = {x.host: (set(held(x)), x.member.lease) for x in (a, b)}
        beats = {x.host: x.beats for x in (a, b)}
        etcd.make_leader(0)                 # the clients try member 0 first: it is theirs and the leader
        a.start(), b.start()
        etcd.kill(0)
        wait_for("both agents beat through the other members",
                 lambda: all(x.beats >= beats[x.host] + 3 and x.etcd_error is None for x in (a, b)))
        assert etcd.leader() in (1, 2)
        for x in (a, b):
            assert (set(held(x)), x.member.lease) == before[x.host]
            assert x.etcd.failovers >= 1 and not x.status()["lost_extents"]
        client = E.Etcd(etcd.endpoints[1:])
        assert in_etcd_as_held([a, b], client)
        client.close()


def test_with_etcd_away_a_host_keeps_what_it_holds_claims_nothing_and_goes_on_when_it_returns(etcd, tmp_path):
    dev = pool_file(tmp_path, 24)
    with hosts(config(etcd, dev, "host-a")) as (a,):
        settle([a], lambda: a.member.state == "member" and held(a))
        demand = Demand(a)
        demand.press([a], 2 * EXT)
        kept, live = set(held(a)), a.tier.log.live_bytes
        for i in range(3):
            etcd.kill(i)
        demand.grow(a.tier.log.capacity_bytes)       # fills what it holds: more than that waits for etcd
        for _ in range(2):
            a.beat()
        st = a.status()
        assert st["etcd"] == "unreachable" and "no etcd member answered" in st["etcd_error"]
        assert set(held(a)) == kept and a.tier.log.live_bytes > live
        assert st["state"] == "member"          # what it holds, it goes on serving
        for i in range(3):
            etcd.start_member(i)
        etcd.wait_healthy()
        settle([a], lambda: a.etcd_error is None and a.member.state == "member" and len(held(a)) > len(kept))
        assert set(held(a)) >= kept
        assert in_etcd_as_held([a], a.etcd)
        a.stop()
        a.stop()                                 # idempotent: the daemon and a cleanup may both stop it


# ---- a host killed -------------------------------------------------------------------------------------

class HostProcess:
    """tests/host/pool_host_proc.py: a pool host in a process of its own."""

    def __init__(self, etcd, device: str, name: str, demand_bytes: int, log: Path):
        self.log = log
        with open(log, "w") as err:            # a file, not a pipe: nobody reads it until the end
            self.proc = subprocess.Popen(
                [sys.executable, str(HOST_PROC), ",".join(etcd.endpoints), device, name,
                 "--demand-bytes", str(demand_bytes), "--ttl-s", str(TTL), "--extent-bytes", str(EXT)],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, text=True)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.proc.stdout, selectors.EVENT_READ)

    def ready(self) -> dict:
        """Its first report: a member holding its demand."""
        deadline = time.monotonic() + SAFETY_NET_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            if self.sel.select(timeout=1.0):
                return json.loads(self.proc.stdout.readline())
        self.kill()
        raise AssertionError(f"the host process did not report (rc {self.proc.returncode}): "
                             f"{self.log.read_text()[-2000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.sel.close()
        self.proc.stdout.close()


def test_a_host_process_killed_with_sigkill_frees_its_extents_after_the_lease_and_another_claims_them(
        etcd, tmp_path, record_property):
    dev = pool_file(tmp_path, 24)
    proc = HostProcess(etcd, dev, "host-a", demand_bytes=4 * EXT, log=tmp_path / "host-a.log")
    try:
        rep = proc.ready()
        with hosts(config(etcd, dev, "host-b")) as (b,):
            # the other process answers b's proof at its own heartbeats: b beats at its cadence too
            wait_for("host-b a member", lambda: b.beat() or (b.member.state == "member" and held(b)),
                     every_s=b.heartbeat_s)
            assert b.member.proved_by == "member host-a read this host's nonce on its device"
            demand = Demand(b)
            demand.press([b], 3 * EXT)
            mine, live = set(held(b)), b.tier.log.live_bytes
            proc.kill()
            killed_at = time.monotonic()
            gone = of(claims_in_etcd(b.etcd), "host-a")
            assert gone >= set(rep["extents"]) and not gone & mine
            for _ in range(ROUNDS):              # nothing but the lease frees them: b only watches
                if not of(claims_in_etcd(b.etcd), "host-a"):
                    break
                b.beat()
                time.sleep(TTL / 8)
            free_s = time.monotonic() - killed_at
            assert not of(claims_in_etcd(b.etcd), "host-a")
            assert "host-a" not in b.member.live_members()
            record_property("extents_free_after_sigkill_s", round(free_s, 2))
            demand.press([b], 18 * EXT)          # more than the pool's half: the dead host's share
            assert set(held(b)) & gone and set(held(b)) >= mine
            assert b.tier.log.live_bytes >= live and in_etcd_as_held([b], b.etcd)
    finally:
        proc.kill()


# ---- untrusted entries ---------------------------------------------------------------------------------

def test_forged_acks_joins_and_oversized_values_are_refused_and_hand_out_nothing(etcd, tmp_path):
    """An ack from a host that is not a live member does not make a joining host a member; a join
    whose slot lies outside the header, an entry over 4 KiB, one naming another host and a claim key
    of another shape are refused and counted; none of them gives anybody an extent."""
    dev = pool_file(tmp_path, 16)
    client = E.Etcd(etcd.endpoints)
    with hosts(config(etcd, dev, "host-a")) as (a,):
        settle([a], lambda: a.member.state == "member" and held(a))
        client.put("/t/pool/hosts/host-big", b'{"schema":"tieringd.pool/1","pad":"' + b"x" * 5000 + b'"}')
        entry_w = S.HostEntry(host="host-w", lease=1, weight=1.0, min_bytes=0, max_bytes=0, state="member")
        client.put("/t/pool/hosts/host-z", S.dump(entry_w))
        client.put("/t/pool/join/host-q", S.dump(S.JoinEntry("ab" * 16, 1 << 40)))
        client.put("/t/pool/claims/7/host-z", S.dump(S.ClaimEntry("own")))
        copy = str(tmp_path / "copy.dev")
        with open(dev, "rb") as src, open(copy, "wb") as dst:
            dst.write(src.read())                # the pool's header, but other memory
        with hosts(config(etcd, copy, "host-b")) as (b,):
            b.beat()
            join = S.parse("join", client.get("/t/pool/join/host-b").value)
            client.put("/t/pool/ack/host-b/host-z", S.dump(S.AckEntry(join.nonce, True)))
            b.beat()
            assert b.member.state == "joining"   # host-z is no live member: its word counts for nothing
            settle([a, b], lambda: b.member.state == "refused")
            assert "host-a read another value where this host wrote its nonce" in b.member.why
            for _ in range(2):
                a.beat(), b.beat()
            refused = a.status()["refused_entries"]
            assert sum(refused.values()) >= 4, refused
            assert client.get("/t/pool/ack/host-q/host-a") is None
            claims = claims_in_etcd(client)
            assert not of(claims, "host-b") and not of(claims, "host-z") and not held(b)
            assert of(claims, "host-a") == set(held(a))
    client.close()


# ---- capacity follows demand ---------------------------------------------------------------------------

def test_capacity_moves_from_a_shrinking_host_to_a_growing_one(etcd, tmp_path, record_property):
    """A's KV shrinks while B's grows: A gives back the extents it no longer needs and B claims them,
    the heartbeats at their cadence (a third of the TTL); the hand-over time is recorded."""
    dev = pool_file(tmp_path, 24)               # 23 extents: A at 6 extents of KV wants 17, idle B 5
    with hosts(config(etcd, dev, "host-a"), config(etcd, dev, "host-b")) as (a, b):
        settle([a, b], lambda: a.member.state == b.member.state == "member" and held(b))
        da, db = Demand(a), Demand(b)
        da.press([a, b], 6 * EXT)
        a_before, b_before = set(held(a)), set(held(b))
        assert len(a_before) > len(b_before)
        da.shrink(da.agent.tier.log.live_bytes)
        t0 = time.monotonic()
        released: set[int] = set()
        for _ in range(ROUNDS):
            beat0 = time.monotonic()
            db.grow(6 * EXT - b.tier.log.live_bytes)
            a.beat()
            b.beat()
            released = a_before - set(held(a))
            if len(released) >= 8 and released <= set(held(b)):
                break
            time.sleep(max(a.heartbeat_s - (time.monotonic() - beat0), 0))
        handover_s = time.monotonic() - t0
        assert len(released) >= 8 and released <= set(held(b)), (sorted(released), held(b))
        assert set(held(b)) >= b_before and in_etcd_as_held([a, b], a.etcd)
        record_property("handover_s", round(handover_s, 2))
        record_property("handover_extents", len(released))
        record_property("lease_ttl_s", TTL)
