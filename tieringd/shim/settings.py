# SPDX-License-Identifier: Apache-2.0
"""The ``[shim]`` table of tieringd.toml: defaults for ``tieringctl run`` (as ``TIERINGD_*``
variables, docs/shim.md) and the CONFIG record the daemon sends live shims (docs/protocol.md).

Every key is optional: an unset key leaves the shim's own default, and CONFIG carries only the
fields that are set. The registry does not read this table; it is handed the CONFIG record
(:meth:`ShimSettings.to_message`) to send at each HELLO.
"""
from __future__ import annotations

import dataclasses

from tieringd.shim import protocol as P
from tieringd.config import ConfigError, Table, ranged

# The shim maps its regions in whole 2 MiB pages (docs/shim.md); it refuses a smaller minimum too.
MIN_BYTES_FLOOR = 2 << 20
MAX_BYTES = 1 << 50             # 1 PiB: the largest allocation a size key names
_POLICIES = ", ".join(p.label for p in P.ALLOCATION_POLICIES)


@dataclasses.dataclass(frozen=True)
class ShimSettings(Table):
    NAME = "shim"
    min_bytes: int | None = ranged(None, MIN_BYTES_FLOOR, MAX_BYTES, unit="bytes")  # smallest allocation managed (TIERINGD_MIN_BYTES, at least 2 MiB); unset: the shim's 4M
    max_bytes: int | None = ranged(None, MIN_BYTES_FLOOR, MAX_BYTES, unit="bytes")  # largest allocation managed (TIERINGD_MAX_BYTES); unset: no limit
    policy: str | None = None           # an allocation policy's label: fast, slow-first, …
    pinned_policy: str | None = None  # the allocation policy of pools pinned for a GPU (TIERINGD_PINNED_POLICY); unset: weighted
    thp: bool | None = None  # MADV_HUGEPAGE on managed regions (TIERINGD_THP); unset: on
    ksm: bool | None = None  # MADV_MERGEABLE on managed regions (TIERINGD_KSM); unset: off
    backing: str | None = None  # "memfd": regions the DAX-remap tier can take, "anon" (TIERINGD_BACKING); unset: anon

    def validate(self) -> None:
        super().validate()
        if self.min_bytes is not None and self.max_bytes is not None and self.max_bytes < self.min_bytes:
            raise ConfigError.bad_value("shim", "max_bytes", f"a size ≥ min_bytes ({self.min_bytes})",
                                        self.max_bytes)
        for key in ("policy", "pinned_policy"):
            self._policy(key)
        if self.backing not in (None, "anon", "memfd"):
            raise ConfigError.bad_value("shim", "backing", '"anon" or "memfd"', self.backing)

    def _policy(self, key: str) -> P.Policy | None:
        label = getattr(self, key)
        if label is None:
            return None
        try:
            policy = P.Policy.parse(label)
        except ValueError:
            policy = None
        if policy not in P.ALLOCATION_POLICIES:
            raise ConfigError.bad_value("shim", key, f"an allocation policy ({_POLICIES})", label)
        return policy

    def to_env(self) -> dict[str, str]:
        """The ``TIERINGD_*`` variables of the keys that are set."""
        env = {}
        if self.min_bytes is not None:
            env["TIERINGD_MIN_BYTES"] = str(self.min_bytes)
        if self.max_bytes is not None:
            env["TIERINGD_MAX_BYTES"] = str(self.max_bytes)
        for key, var in (("policy", "TIERINGD_POLICY"), ("pinned_policy", "TIERINGD_PINNED_POLICY")):
            policy = self._policy(key)
            if policy is not None:
                env[var] = policy.label
        for key, var in (("thp", "TIERINGD_THP"), ("ksm", "TIERINGD_KSM")):
            value = getattr(self, key)
            if value is not None:
                env[var] = "1" if value else "0"
        if self.backing is not None:
            env["TIERINGD_BACKING"] = self.backing
        return env

    def to_message(self) -> P.Config | None:
        """The CONFIG record of the keys that are set; None when none is."""
        values = {"min_bytes": self.min_bytes, "max_bytes": self.max_bytes,
                  "policy": self._policy("policy"), "pinned_policy": self._policy("pinned_policy"),
                  "thp": self.thp, "ksm": self.ksm}
        fields = P.ConfigField(0)
        msg = P.Config()
        for key, flag in (("min_bytes", P.ConfigField.MIN_BYTES), ("max_bytes", P.ConfigField.MAX_BYTES),
                          ("policy", P.ConfigField.POLICY), ("pinned_policy", P.ConfigField.PINNED_POLICY),
                          ("thp", P.ConfigField.THP), ("ksm", P.ConfigField.KSM)):
            if values[key] is not None:
                fields |= flag
                setattr(msg, key, int(values[key]))
        msg.fields = int(fields)
        return msg if fields else None
