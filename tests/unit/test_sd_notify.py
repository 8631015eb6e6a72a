# SPDX-License-Identifier: Apache-2.0
"""sd_notify over a real datagram socket, bound where systemd would bind it (a path, or an abstract
name), read back as systemd reads it."""
import os
import socket

import pytest

from tieringd.service.sd_notify import Notifier


@pytest.fixture(params=["path", "abstract"])
def notify_socket(request, tmp_path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if request.param == "path":
        name = str(tmp_path / "notify")
        s.bind(name)
    else:
        name = f"@tieringd-test-{os.getpid()}-{id(s)}"
        s.bind("\0" + name[1:])
    s.settimeout(2)
    yield name, s
    s.close()


def fields(datagram: bytes) -> dict:
    return dict(line.split("=", 1) for line in datagram.decode().split("\n"))


def test_ready_status_and_stopping_arrive_as_key_value_lines(notify_socket):
    name, s = notify_socket
    n = Notifier.from_env({"NOTIFY_SOCKET": name})
    assert n.enabled
    assert n.ready("2 regions\nof 1 process")
    got = fields(s.recv(4096))
    assert got["READY"] == "1" and got["MAINPID"] == str(os.getpid())
    assert got["STATUS"] == "2 regions of 1 process"           # one line: newlines flattened
    assert n.stopping("stopping (SIGTERM)")
    assert fields(s.recv(4096)) == {"STOPPING": "1", "STATUS": "stopping (SIGTERM)"}
    n.close()


def test_without_notify_socket_nothing_is_sent_and_nothing_fails():
    n = Notifier.from_env({})
    assert not n.enabled and not n.ready("x") and not n.watchdog()


def test_a_vanished_socket_is_a_logged_false_not_an_exception(tmp_path, caplog):
    n = Notifier.from_env({"NOTIFY_SOCKET": str(tmp_path / "gone")})
    assert n.send(STATUS="x") is False
    assert n.send(STATUS="y") is False
    assert sum("sd_notify" in r.message for r in caplog.records) == 1


def test_watchdog_interval_is_half_the_unit_s_and_only_for_this_pid():
    env = {"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "30000000"}
    assert Notifier.from_env(env).watchdog_interval_s == 15.0
    assert Notifier.from_env({**env, "WATCHDOG_PID": str(os.getpid())}).watchdog_usec == 30000000
    assert Notifier.from_env({**env, "WATCHDOG_PID": "1"}).watchdog_interval_s is None
    assert not Notifier.from_env({"NOTIFY_SOCKET": "vsock:2:3"}).enabled
