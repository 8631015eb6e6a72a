# SPDX-License-Identifier: Apache-2.0
"""tieringd.kernel.numa without system calls: status decoding, nodemasks, error classes and messages."""
import errno

import numpy as np
import pytest

from tieringd.kernel import sysfs, numa


def test_decode_status_covers_every_documented_value():
    assert numa.decode_status(3) == numa.PageStatus(3, numa.PageResult.ON_NODE, 3, None)
    cases = {
        -errno.ENOENT: numa.PageResult.NOT_PRESENT,
        -errno.EBUSY: numa.PageResult.REFUSED,
        -errno.EAGAIN: numa.PageResult.REFUSED,
        -errno.ENOMEM: numa.PageResult.TARGET_FULL,
        -errno.EFAULT: numa.PageResult.FAULT,
        -errno.EACCES: numa.PageResult.SHARED,
        -errno.ENODEV: numa.PageResult.NODE_INVALID,
        -errno.EIO: numa.PageResult.IO_ERROR,
        -errno.EPIPE: numa.PageResult.OTHER,
    }
    for value, result in cases.items():
        st = numa.decode_status(value)
        assert (st.result, st.node, st.errno) == (result, None, -value)
    unrep = numa.decode_status(numa.STATUS_UNREPORTED)
    assert unrep.result is numa.PageResult.UNREPORTED and unrep.errno is None
    assert str(numa.decode_status(-errno.ENOMEM)) == "target-full (ENOMEM)"
    assert str(numa.decode_status(1)) == "node 1"


def test_status_counts_groups_nodes_and_reasons():
    st = np.array([1, 1, 0, -errno.ENOENT, -errno.ENOENT, numa.STATUS_UNREPORTED], dtype=np.int32)
    assert numa.status_counts(st) == {"node 0": 1, "node 1": 2, "not-present": 2, "unreported": 1}
    assert numa.status_counts([-errno.EBUSY, -errno.EAGAIN]) == {"refused": 2}


def test_nodemask_round_trip_and_range_check():
    mask = numa.make_nodemask([0, 3, 64, 127], bits=128)
    assert len(mask) == 2
    assert numa.parse_nodemask(mask) == [0, 3, 64, 127]
    with pytest.raises(numa.NodeUnavailableError, match="node 128 is outside the possible nodes"):
        numa.make_nodemask([128], bits=128)


def test_nodemask_is_sized_from_possible_nodes(tmp_path, monkeypatch):
    node = tmp_path / "sys/devices/system/node"
    node.mkdir(parents=True)
    (node / "possible").write_text("0-129\n")
    (node / "has_memory").write_text("0-1\n")
    monkeypatch.setattr(numa, "_mask_bits_cache", None)
    with sysfs.root(tmp_path):
        assert numa.nodemask_bits() == 192       # 130 nodes → three 64-bit words
        assert numa.memory_nodes() == [0, 1]
    monkeypatch.setattr(numa, "_mask_bits_cache", None)


def test_errors_are_typed_and_say_what_failed(tmp_path):
    node = tmp_path / "sys/devices/system/node"
    node.mkdir(parents=True)
    (node / "has_memory").write_text("0-1\n")
    with sysfs.root(tmp_path):
        with pytest.raises(numa.NodeUnavailableError) as ei:
            numa._raise("move_pages", errno.ENODEV, "pid=7, 4 pages, to node 5")
        assert "move_pages(pid=7, 4 pages, to node 5): node does not exist" in str(ei.value)
        assert "(nodes with memory: 0-1)" in str(ei.value)
        assert ei.value.errno == errno.ENODEV and ei.value.call == "move_pages"
        # mbind says EINVAL for a node without memory: the message names the node
        with pytest.raises(numa.NodeUnavailableError, match="node 4 does not exist"):
            numa._raise("mbind", errno.EINVAL, "x", nodes=[0, 4])
    with pytest.raises(numa.ProcessGoneError) as ei:
        numa._raise("move_pages", errno.ESRCH, "pid=1")
    assert isinstance(ei.value, ProcessLookupError) and isinstance(ei.value, numa.NumaError)
    with pytest.raises(PermissionError):
        numa._raise("move_pages", errno.EPERM, "pid=1")
    for err, cls in [(errno.EACCES, numa.NodeNotAllowedError), (errno.ENOMEM, numa.TargetFullError),
                     (errno.EFAULT, numa.BadAddressError), (errno.EINVAL, numa.InvalidArgumentError),
                     (errno.ENOSYS, numa.NotSupportedError), (errno.E2BIG, numa.NumaError)]:
        with pytest.raises(cls):
            numa._raise("x", err, "y")


def test_move_pages_batch_reports_partial_results_without_raising(monkeypatch):
    def fake(pid, addrs, nodes, status, flags):
        status[:2] = nodes[:2]      # the kernel wrote the first run, then hit a full target
        return -errno.ENOMEM
    monkeypatch.setattr(numa, "_raw_move_pages", fake)
    r = numa.move_pages_batch(1, [0x1000, 0x2000, 0x3000], 1)
    assert r.error == errno.ENOMEM and not r.complete
    assert r.status.tolist() == [1, 1, numa.STATUS_UNREPORTED]
    with pytest.raises(numa.TargetFullError):
        numa.move_pages(1, [0x1000], 1)

    monkeypatch.setattr(numa, "_raw_move_pages", lambda *a: 2)
    r = numa.move_pages_batch(1, [0x1000, 0x2000], [1, 1])
    assert r.not_migrated == 2 and r.error == 0

    monkeypatch.setattr(numa, "_raw_move_pages", lambda *a: -errno.ESRCH)
    with pytest.raises(numa.ProcessGoneError, match="pid=1, 1 pages, to node 1"):
        numa.move_pages_batch(1, [0x1000], 1)
    with pytest.raises(ValueError, match="2 nodes for 1 addresses"):
        numa.move_pages_batch(1, [0x1000], [1, 1])


def test_page_addresses_cover_partial_pages():
    ps = numa.PAGE_SIZE
    a = numa.page_addresses(ps + 10, ps)        # straddles two pages
    assert a.tolist() == [ps, 2 * ps]
    assert numa.page_addresses(0, 0).tolist() == []


def test_mode_names():
    assert numa._mode_name(numa.MPOL_BIND | numa.MPOL_F_STATIC_NODES) == "bind|static"
    assert numa.MemPolicy(numa.MPOL_PREFERRED_MANY, 0, (1,)).mode_name == "preferred-many"
