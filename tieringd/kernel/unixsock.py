# SPDX-License-Identifier: Apache-2.0
"""The Unix sockets the daemon listens on (the registry's, the control socket): a path left by a
daemon that died is taken over, one where another daemon still answers is not."""
from __future__ import annotations

import os
import socket
import stat


def remove_stale_socket(path: str, sock_type: int, who: str) -> None:
    """Unlink ``path`` when it is a socket nobody accepts on (a leftover of a dead daemon).

    Raises RuntimeError when it is not a socket, or when ``who`` (e.g. "another registry") still
    answers there: two daemons must never share a run directory."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise RuntimeError(f"{path} exists and is not a socket; remove it first")
    probe = socket.socket(socket.AF_UNIX, sock_type)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)
        return
    finally:
        probe.close()
    raise RuntimeError(f"{who} answers on {path}")


def close_listener(sel, sock: socket.socket, path: str) -> None:
    """Stop listening on ``path``: the socket out of the selector, closed, its path unlinked."""
    sel.unregister(sock)
    sock.close()
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
