# SPDX-License-Identifier: Apache-2.0
"""The control socket against a running loop (tests/unit/daemon_standin.py: the Daemon's interface
over a real registry, block table, mover and policy): framing, errors that never drop a connection
without a word, a client that does not read, deferred replies, who may talk."""
import json
import os
import socket
import struct
import threading
import time

import pytest

from daemon_standin import StandInDaemon
from tieringd import settings
from tieringd.config import ConfigFile
from tieringd.service.control import (Access, Client, ControlConfig, ControlError, Deferred, Peer, clip_ranges,
                                      peer_of,
                              socket_path)
from tieringd.service.service import Service


@pytest.fixture
def service(tmp_path):
    cfg = ConfigFile({"control": {"max_backlog_bytes": 256 << 10, "max_line_bytes": 4096},
                      "lifecycle": {"source": "poll"}})
    d = StandInDaemon(cfg, run_dir=str(tmp_path))
    svc = Service(d, cfg, settings.check(cfg), run_dir=str(tmp_path))
    svc.start()
    d.start_thread()
    yield d, svc, str(tmp_path)
    d.stop_thread()
    svc.stop()


def raw(run_dir: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(socket_path(run_dir))
    return s


def lines(s: socket.socket, n: int) -> list[dict]:
    f = s.makefile("rb")
    return [json.loads(f.readline()) for _ in range(n)]


def test_status_answers_with_its_schema_and_the_signal_in_use(service):
    _, _, run = service
    with Client(run) as c:
        st = c.request("status")
    assert st["schema"] == "tieringd.status/1"
    assert st["signal"]["mechanism"] == "hint-faults"
    assert st["lifecycle"]["mechanism"] == "/proc polling"
    assert st["control"]["path"] == socket_path(run)
    assert st["ticks"]["count"] >= 1 and st["processes"] == 0


def test_bad_requests_are_json_errors_and_the_connection_stays(service):
    _, _, run = service
    s = raw(run)
    s.sendall(b'not json\n{"v": 1, "id": 2, "request": "warp"}\n{"v": 2, "id": 3, "request": "status"}\n'
              b'{"v": 1, "id": 4, "request": "regions", "pidd": 1}\n{"v": 1, "id": 5, "request": "tiers"}\n')
    got = lines(s, 5)
    assert [g.get("error", {}).get("code") for g in got[:4]] == \
        ["bad-request", "unknown-request", "unsupported-version", "bad-request"]
    assert "unknown field 'pidd' (fields: pid)" in got[3]["error"]["message"]
    assert got[4]["ok"] and got[4]["id"] == 5 and got[4]["result"]["schema"] == "tieringd.managed-tiers/1"
    s.close()


def test_what_the_fuzzer_found_is_refused_in_words_and_the_daemon_goes_on(service):
    """An id JSON cannot write back (NaN: Python reads it, and echoing it back killed the daemon),
    a request name that is a list, nesting deeper than the parser goes: bad-request each, with a null
    id where the id was the problem, and the next request is answered."""
    _, _, run = service
    s = raw(run)
    s.sendall(b'{"v": 1, "id": NaN, "request": "status"}\n{"v": 1, "id": [1], "request": "status"}\n'
              b'{"v": 1, "id": 3, "request": ["status"]}\n' + b"[" * 1500 + b"]" * 1500 + b"\n"
              b'{"v": NaN, "id": 5, "request": "status"}\n{"v": 1, "id": 6, "request": "tiers"}\n')
    got = lines(s, 6)
    assert [g.get("error", {}).get("code") for g in got[:5]] == \
        ["bad-request", "bad-request", "unknown-request", "bad-request", "unsupported-version"]
    assert [g["id"] for g in got] == [None, None, 3, None, 5, 6]
    assert "id must be null, a string" in got[0]["error"]["message"]
    assert "nested too deep" in got[3]["error"]["message"]
    assert got[5]["ok"]
    s.close()


def test_a_line_too_long_is_refused_in_words_then_closed(service):
    _, _, run = service
    s = raw(run)
    s.sendall(b'{"request": "status", "x": "' + b"a" * 8192)
    f = s.makefile("rb")
    err = json.loads(f.readline())
    assert err["error"]["code"] == "too-long" and "4096 bytes" in err["error"]["message"]
    assert f.readline() == b""          # then closed
    s.close()


def test_a_client_that_never_reads_is_cut_off_and_the_loop_keeps_answering(service):
    d, svc, run = service
    hog = raw(run)
    hog.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    request = b'{"v": 1, "request": "status"}\n'
    for _ in range(3000):               # ~2 KiB replies: far beyond socket buffers + 256 KiB
        try:
            hog.sendall(request)
        except OSError:
            break
    deadline = time.monotonic() + 10
    while svc.control.status()["clients"] > 0 and time.monotonic() < deadline:
        with Client(run) as c:          # answered while the hog waits
            assert c.request("status")["schema"] == "tieringd.status/1"
        time.sleep(0.05)
    assert d.in_loop(lambda: svc.control.status()["clients"]) == 0
    hog.close()


def test_a_deferred_reply_comes_after_later_requests_are_answered(service):
    d, svc, run = service
    release = threading.Event()
    svc.control.handlers["slow"] = (lambda r: Deferred(lambda: (release.wait(5), {"done": True})[1]), ())
    s = raw(run)
    s.sendall(b'{"id": 1, "request": "slow"}\n{"id": 2, "request": "tiers"}\n')
    f = s.makefile("rb")
    first = json.loads(f.readline())
    assert first["id"] == 2
    release.set()
    second = json.loads(f.readline())
    assert second == {"v": 1, "id": 1, "ok": True, "result": {"done": True}}
    s.close()


def test_a_handler_that_raises_is_an_internal_error_not_a_dead_loop(service):
    _, svc, run = service
    svc.control.handlers["boom"] = (lambda r: 1 / 0, ())
    with Client(run) as c:
        with pytest.raises(ControlError) as e:
            c.request("boom")
        assert e.value.code == "internal" and "ZeroDivisionError" in e.value.message
        assert c.request("tiers")["schema"] == "tieringd.managed-tiers/1"


def test_policy_set_applies_through_the_daemon_and_a_bad_value_changes_nothing(service):
    d, svc, run = service
    with Client(run) as c:
        doc = c.request("policy-set", set={"interval_ms": 250, "mover.workers": 1})
        assert doc["policy"]["interval_ms"] == 250.0
        assert doc["overrides"] == {"policy.interval_ms": 250, "mover.workers": 1}
        with pytest.raises(ControlError) as e:
            c.request("policy-set", set={"low_watermark": 0.99})
        assert e.value.code == "config" and "watermark" in e.value.message
        assert c.request("policy-get")["policy"]["interval_ms"] == 250.0
    assert len(d.applied) == 1


def test_the_control_table_applies_at_policy_set_and_at_a_reload(service, tmp_path):
    d, svc, run = service
    with Client(run) as c:
        c.request("policy-set", set={"control.heat_max_blocks": 3})
    assert svc.control.cfg.heat_max_blocks == 3
    path = tmp_path / "reloaded.toml"
    path.write_text('[control]\nmax_clients = 5\n[lifecycle]\nsource = "poll"\n')
    assert d.in_loop(lambda: svc.reload(str(path))) is None
    assert (svc.control.cfg.max_clients, svc.control.cfg.heat_max_blocks) == (5, 65536)


def test_heat_is_bounded_by_the_table_setting(service):
    _, _, run = service
    with Client(run) as c:
        h = c.request("heat", pid=12345, limit=10 ** 9)
        assert h["blocks_total"] == 0 and h["count"] == 0
        with pytest.raises(ControlError, match="pid is required"):
            c.request("heat")


def test_the_client_says_what_to_do_when_no_daemon_runs(tmp_path):
    with pytest.raises(ConnectionError, match=r"not running: nothing answers on .*control.sock\. Start it "
                                              r"with 'systemctl start tieringd'"):
        Client(str(tmp_path))


# ---- who may talk ---------------------------------------------------------------------------------

def test_root_and_group_members_may_talk_others_are_told_why():
    a = Access("tieringd")
    a.gid = 4242                         # as if the group existed with this gid
    assert a.refusal(Peer(10, 0, 0, ())) is None
    assert a.refusal(Peer(10, 1000, 4242, ())) is None                  # primary group
    assert a.refusal(Peer(10, 1000, 1000, (27, 4242))) is None          # supplementary
    why = a.refusal(Peer(10, 1000, 1000, (27,)))
    assert "uid 1000 may not use" in why and "usermod -aG tieringd USER" in why
    b = Access("no-such-group-here")
    assert b.gid is None and "does not exist" in b.refusal(Peer(1, 1000, 1000, ()))


def test_peer_credentials_are_the_kernel_s(tmp_path):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    p = peer_of(a)
    assert (p.pid, p.uid, p.gid) == (os.getpid(), os.getuid(), os.getgid())
    assert set(p.groups) == set(os.getgroups())
    a.close(), b.close()


def test_control_table_defaults():
    assert ControlConfig().group == "tieringd"


def test_a_member_may_read_but_only_root_may_change_the_policy(service):
    """policy-set changes the daemon for every user: a member of the group is refused in words (and the
    refusal counted), root is not; reading requests are everyone's who may talk."""
    _, svc, _ = service
    member = Peer(10, 1000, 4242, ())
    why = svc.control.refusal(member, "policy-set")
    assert why == "policy-set changes the daemon for every user: root only (this client is uid 1000)"
    assert svc.control.refusal(Peer(10, 0, 0, ()), "policy-set") is None
    for name in ("status", "tiers", "processes", "regions", "heat", "stats", "policy-get", "migrate"):
        assert svc.control.refusal(member, name) is None, name


def test_a_migrate_is_bounded_by_what_the_process_maps():
    """A client's ranges are cut to the process's mappings: 2^64 bytes from 0 is no 32 PiB page list."""
    mapped = [(0x1000, 0x3000), (0x10000, 0x1000)]
    assert clip_ranges([(0, 2**64)], mapped) == mapped
    assert clip_ranges([(0x2000, 0x10000)], mapped) == [(0x2000, 0x2000), (0x10000, 0x1000)]
    assert clip_ranges([(0x5000, 0x1000), (2**63, 2**63)], mapped) == []


def test_migrate_of_memory_the_process_does_not_map_is_refused_in_words(service):
    _, _, run = service
    with Client(run) as c:
        with pytest.raises(ControlError) as e:
            c.request("migrate", pid=os.getpid(), ranges=[[2**62, 2**62]], to=0)
        assert e.value.code == "bad-request" and "hold no memory process" in e.value.message
        with pytest.raises(ControlError) as e:
            c.request("migrate", pid=os.getpid(), ranges=[[0, 4096]] * 5000, to=0)
        assert e.value.code == "bad-request" and "at most 4096" in e.value.message
