#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""One guest connection to a port on the lab host's loopback: what QEMU's ``guestfwd=…-cmd:`` runs.

libslirp starts the command once per connection the guest opens to the forwarded address, with that
connection as stdin, stdout and stderr (one end of a socketpair): nothing is printed, an error would
go to the guest. This relays it to ``127.0.0.1:PORT`` until both
sides are done. Loopback only: anything else is refused, so a lab guest never reaches past the host's
loopback even through its forwards.

    fwd.py PORT
"""
from __future__ import annotations

import select
import socket
import sys


def relay(a: socket.socket, b: socket.socket) -> None:
    open_ends = {a: b, b: a}
    while open_ends:
        ready, _, _ = select.select(list(open_ends), [], [])
        for src in ready:
            dst = open_ends[src]
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            if data:
                dst.sendall(data)
                continue
            # EOF from src: pass the half-close on; done when both directions are
            del open_ends[src]
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not argv[1].isdigit():
        return 2
    guest = socket.socket(fileno=0)
    try:
        host = socket.create_connection(("127.0.0.1", int(argv[1])), timeout=10)
    except OSError:
        return 1            # the guest sees its connection closed
    host.settimeout(None)
    relay(guest, host)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
