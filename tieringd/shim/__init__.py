# SPDX-License-Identifier: Apache-2.0
"""The daemon's side of the ``LD_PRELOAD`` shim (``shim/`` in C): the wire format (:mod:`.protocol`),
the verified regions of every shim process (:mod:`.registry`), the ``[shim]`` table (:mod:`.settings`),
and the DAX-remap tier the shims carry out (:mod:`.remap`, with its append-only log :mod:`.pmemlog`)."""
