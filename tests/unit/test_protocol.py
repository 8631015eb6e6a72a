# SPDX-License-Identifier: Apache-2.0
"""The wire format: round trips, strict decoding with errno-carrying errors, and the C header
(shim/protocol.h) compiled and compared with the Python tables so the two sides cannot drift."""
from __future__ import annotations

import errno
import shutil
import struct
import subprocess

import pytest

from tieringd.shim import protocol as P

from paths import REPO

SAMPLES = [
    P.Hello(pid=1234, min_bytes=4 << 20, policy=P.Policy.FAST, backing=1, agent="tieringd-shim/0.1.0", seq=1),
    P.Reset(seq=2),
    P.Register(region_id=7, start=0x7F0000200000, length=8 << 20, flags=P.Flag.PINNED | P.Flag.HUGEPAGE,
               policy=P.Policy.WEIGHTED, source=P.Source.CUDA_HOST_ALLOC, node=-1, tag="kv-pool", seq=3),
    P.Unregister(region_id=7, start=0x7F0000200000, length=8 << 20, seq=4),
    P.Ack(ref_seq=3, seq=5),
    P.Error(ref_seq=3, code=errno.EFAULT, message="range does not belong to it", seq=6),
    P.Ping(seq=7),
    P.Pong(ref_seq=7, pid=1234, nregions=3, managed_bytes=96 << 20, seq=8),
    P.Resync(seq=9),
    P.Rebind(start=0x7F0000200000, length=2 << 20, nodemask=0b10, policy=P.Policy.BIND, flags=P.REBIND_MOVE,
             seq=10),
    P.Config(fields=P.ConfigField.MIN_BYTES | P.ConfigField.POLICY, policy=P.Policy.SLOW_FIRST,
             min_bytes=8 << 20, seq=11),
    P.Remap(start=0x7F0000200000, length=4 << 20, file_offset=64 << 20, direction=P.RemapDirection.PROMOTE,
            node=0, seq=12),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: m.TYPE.name)
def test_round_trip(msg):
    data = msg.encode()
    assert len(data) == msg.size() <= P.MAX_RECORD
    assert data[:4] == b"TRDK"
    assert P.decode(data) == msg


def test_strict_decoding_names_the_problem():
    good = P.Ping(seq=5).encode()
    with pytest.raises(P.ProtocolError, match="shorter than the 16-byte header") as e:
        P.decode(good[:10])
    assert e.value.code == errno.EBADMSG
    with pytest.raises(P.ProtocolError, match="bad magic") as e:
        P.decode(b"XXXX" + good[4:])
    assert e.value.seq == 5
    v2 = good[:4] + struct.pack("<H", 2) + good[6:]
    with pytest.raises(P.ProtocolError, match="version 2 not supported; this side speaks 1") as e:
        P.decode(v2)
    assert e.value.code == errno.EPROTO
    unknown = good[:6] + struct.pack("<H", 99) + good[8:]
    with pytest.raises(P.ProtocolError, match="unknown message type 99") as e:
        P.decode(unknown)
    assert e.value.code == errno.EOPNOTSUPP
    reg = SAMPLES[2].encode()
    with pytest.raises(P.ProtocolError, match="REGISTER: record is 71 bytes"):
        P.decode(reg[:-1])
    with pytest.raises(P.ProtocolError, match="header says 72"):
        P.decode(reg + b"\0")


def test_policy_names():
    assert P.Policy.parse("slow-first") is P.Policy.SLOW_FIRST
    assert P.Policy.parse("weighted-interleave") is P.Policy.WEIGHTED
    assert [p.label for p in P.ALLOCATION_POLICIES] == ["none", "fast", "slow-first", "interleave", "weighted"]
    with pytest.raises(ValueError, match="unknown policy 'fastest'"):
        P.Policy.parse("fastest")


_C_CHECK = r"""
#include <stddef.h>
#include <stdio.h>
#include "protocol.h"
#define S(t) printf("size %s %zu\n", #t, sizeof(struct t))
#define O(t, f) printf("off %s.%s %zu\n", #t, #f, offsetof(struct t, f))
#define C(n) printf("const %s %lld\n", #n, (long long)(n))
int main(void) {
    S(trd_hdr); S(trd_hello); S(trd_register); S(trd_unregister); S(trd_ack); S(trd_error);
    S(trd_pong); S(trd_rebind); S(trd_config); S(trd_remap);
    O(trd_hello, pid); O(trd_hello, min_bytes); O(trd_hello, policy); O(trd_hello, agent);
    O(trd_register, region_id); O(trd_register, start); O(trd_register, length); O(trd_register, flags);
    O(trd_register, policy); O(trd_register, source); O(trd_register, node); O(trd_register, tag);
    O(trd_error, code); O(trd_error, message); O(trd_pong, managed_bytes);
    O(trd_rebind, nodemask); O(trd_rebind, policy); O(trd_rebind, flags);
    O(trd_config, policy); O(trd_config, ksm); O(trd_config, min_bytes); O(trd_config, max_bytes);
    O(trd_remap, start); O(trd_remap, length); O(trd_remap, file_offset); O(trd_remap, direction);
    O(trd_remap, flags); O(trd_remap, node); O(trd_remap, reserved);
    C(TRD_MAGIC); C(TRD_VERSION); C(TRD_MAX_RECORD);
    C(TRD_HELLO); C(TRD_RESET); C(TRD_REGISTER); C(TRD_UNREGISTER); C(TRD_ACK); C(TRD_ERROR);
    C(TRD_PING); C(TRD_PONG); C(TRD_RESYNC); C(TRD_REBIND); C(TRD_CONFIG); C(TRD_REMAP);
    C(TRD_REMAP_DEMOTE); C(TRD_REMAP_PROMOTE); C(TRD_REMAP_SHARE); C(TRD_REMAP_UNSHARE);
    C(TRD_REMAP_MAX_FDS);
    C(TRD_F_MEMFD); C(TRD_F_PINNED); C(TRD_F_HUGEPAGE); C(TRD_F_KSM); C(TRD_F_INHERITED); C(TRD_F_FOREIGN);
    C(TRD_F_WIRE_MASK);
    C(TRD_POL_NONE); C(TRD_POL_FAST); C(TRD_POL_SLOW_FIRST); C(TRD_POL_INTERLEAVE); C(TRD_POL_WEIGHTED);
    C(TRD_POL_BIND); C(TRD_POL_PREFERRED);
    C(TRD_SRC_MALLOC); C(TRD_SRC_CALLOC); C(TRD_SRC_REALLOC); C(TRD_SRC_MEMALIGN); C(TRD_SRC_MMAP);
    C(TRD_SRC_CUDA_HOST_ALLOC); C(TRD_SRC_CUDA_HOST_REGISTER);
    C(TRD_CFG_MIN_BYTES); C(TRD_CFG_MAX_BYTES); C(TRD_CFG_POLICY); C(TRD_CFG_PINNED_POLICY);
    C(TRD_CFG_THP); C(TRD_CFG_KSM); C(TRD_REBIND_MOVE); C(TRD_REBIND_NUMA_BALANCING); C(TRD_REBIND_FLAGS);
    return 0;
}
"""


def test_c_header_matches(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (make setup brings gcc)")
    src = tmp_path / "check.c"
    src.write_text(_C_CHECK)
    subprocess.run([cc, "-std=gnu11", "-I", str(REPO / "shim"), "-o", str(tmp_path / "check"), str(src)],
                   check=True)
    out = subprocess.run([str(tmp_path / "check")], check=True, capture_output=True, text=True).stdout
    c = {}
    for line in out.splitlines():
        kind, name, value = line.split()
        c[(kind, name)] = int(value)

    sizes = {"trd_hdr": P.HEADER.size, "trd_hello": P.Hello.size(), "trd_register": P.Register.size(),
             "trd_unregister": P.Unregister.size(), "trd_ack": P.Ack.size(), "trd_error": P.Error.size(),
             "trd_pong": P.Pong.size(), "trd_rebind": P.Rebind.size(), "trd_config": P.Config.size(),
             "trd_remap": P.Remap.size()}
    for name, size in sizes.items():
        assert c[("size", name)] == size, name
    assert c[("size", "trd_hdr")] + P.Reset.BODY.size == P.Reset.size()

    def off(cls, fmt_prefix):  # offset of a field = header + the packed size of the fields before it
        return P.HEADER.size + struct.calcsize("<" + fmt_prefix)

    offsets = {
        "trd_hello.pid": off(P.Hello, ""), "trd_hello.min_bytes": off(P.Hello, "iI"),
        "trd_hello.policy": off(P.Hello, "iIQ"), "trd_hello.agent": off(P.Hello, "iIQBB6x"),
        "trd_register.region_id": off(P.Register, ""), "trd_register.start": off(P.Register, "Q"),
        "trd_register.length": off(P.Register, "QQ"), "trd_register.flags": off(P.Register, "QQQ"),
        "trd_register.policy": off(P.Register, "QQQI"), "trd_register.source": off(P.Register, "QQQIB"),
        "trd_register.node": off(P.Register, "QQQIBB"), "trd_register.tag": off(P.Register, "QQQIBBh"),
        "trd_error.code": off(P.Error, "I"), "trd_error.message": off(P.Error, "Ii"),
        "trd_pong.managed_bytes": off(P.Pong, "IiII"),
        "trd_rebind.nodemask": off(P.Rebind, "QQ"), "trd_rebind.policy": off(P.Rebind, "QQQ"),
        "trd_rebind.flags": off(P.Rebind, "QQQB"),
        "trd_config.policy": off(P.Config, "I"), "trd_config.ksm": off(P.Config, "IBBB"),
        "trd_config.min_bytes": off(P.Config, "IBBBB"), "trd_config.max_bytes": off(P.Config, "IBBBBQ"),
        "trd_remap.start": off(P.Remap, ""), "trd_remap.length": off(P.Remap, "Q"),
        "trd_remap.file_offset": off(P.Remap, "QQ"), "trd_remap.direction": off(P.Remap, "QQQ"),
        "trd_remap.flags": off(P.Remap, "QQQB"), "trd_remap.node": off(P.Remap, "QQQBB"),
        "trd_remap.reserved": off(P.Remap, "QQQBBh"),
    }
    for name, value in offsets.items():
        assert c[("off", name)] == value, name
    assert P.Register.BODY.format == "<QQQIBBh24s"   # the prefixes above follow these formats
    assert P.Remap.BODY.format == "<QQQBBhI"

    assert c[("const", "TRD_MAGIC")] == P.MAGIC and c[("const", "TRD_VERSION")] == P.VERSION
    assert c[("const", "TRD_MAX_RECORD")] == P.MAX_RECORD
    for t in P.MsgType:
        assert c[("const", f"TRD_{t.name}")] == t.value, t
    for f in P.Flag:
        assert c[("const", f"TRD_F_{f.name}")] == f.value, f
    assert c[("const", "TRD_F_WIRE_MASK")] == P.WIRE_FLAGS
    for p in P.Policy:
        assert c[("const", f"TRD_POL_{p.name}")] == p.value, p
    for s in P.Source:
        assert c[("const", f"TRD_SRC_{s.name}")] == s.value, s
    for f in P.ConfigField:
        assert c[("const", f"TRD_CFG_{f.name}")] == f.value, f
    for d in P.RemapDirection:
        assert c[("const", f"TRD_REMAP_{d.name}")] == d.value, d
    assert c[("const", "TRD_REMAP_MAX_FDS")] == P.REMAP_MAX_FDS
    for f in P.RebindFlag:
        assert c[("const", f"TRD_REBIND_{f.name}")] == f.value, f
    assert c[("const", "TRD_REBIND_FLAGS")] == sum(P.RebindFlag)
