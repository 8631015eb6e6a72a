# SPDX-License-Identifier: Apache-2.0
"""The pool across hosts: one CXL memory pool that several hosts map, coordinated through etcd.

The one part of tieringd that knows other hosts exist (docs/pool.md). It hands the loop extents of
the pool it may write (the DAX-remap tier's log writes only there) and the shared blocks it may map
read-only; it never moves memory. :mod:`.settings` (``[pool]``), :mod:`.etcd` (the etcd client),
:mod:`.schema` (keys and validated values), :mod:`.device` (the pool device, its header and nonces),
:mod:`.membership` (lease, pool definition, the proof of the device), :mod:`.claims` (who holds
which extent, how many this host wants), :mod:`.agent` (the heartbeat thread).
"""
