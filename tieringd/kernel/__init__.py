# SPDX-License-Identifier: Apache-2.0
"""The kernel boundary: every file under /sys and /proc (:mod:`.sysfs`, with one reader per /proc
format in :mod:`.procfs`), the NUMA memory-policy system calls (:mod:`.numa`), the kernel settings
the daemon borrows and puts back (:mod:`.knobs`), and the Unix sockets it listens on (:mod:`.unixsock`).
Nothing outside this package opens a kernel file or builds a /proc path."""
