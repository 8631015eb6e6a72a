# SPDX-License-Identifier: Apache-2.0
"""The [shim] table: the TIERINGD_* variables tieringctl run sets and the CONFIG record the daemon
sends, from the same settings; errors in the one ConfigError shape."""
from __future__ import annotations

import pytest

from tieringd.shim import protocol as P
from tieringd.config import ConfigError
from tieringd.shim.settings import ShimSettings

MiB = 1 << 20


def test_shim_settings_from_config():
    s = ShimSettings.from_config({"min_bytes": "8M", "policy": "slow-first", "thp": False})
    assert s.to_env() == {"TIERINGD_MIN_BYTES": str(8 * MiB), "TIERINGD_POLICY": "slow-first",
                          "TIERINGD_THP": "0"}
    msg = s.to_message()
    assert msg.fields == P.ConfigField.MIN_BYTES | P.ConfigField.POLICY | P.ConfigField.THP
    assert (msg.min_bytes, msg.policy, msg.thp) == (8 * MiB, P.Policy.SLOW_FIRST, 0)
    assert P.decode(msg.encode()) == msg
    assert ShimSettings().to_message() is None and ShimSettings.from_config({}) == ShimSettings()
    # an alias is sent as the policy it names
    assert ShimSettings(pinned_policy="weighted-interleave").to_env() == {"TIERINGD_PINNED_POLICY": "weighted"}
    # memfd backing: the regions the DAX-remap tier can take
    assert ShimSettings.from_config({"backing": "memfd"}).to_env() == {"TIERINGD_BACKING": "memfd"}
    for bad, msg in [({"min_size": 1}, r"\[shim\] min_size: unknown key"),
                     ({"min_bytes": "64k"}, r"\[shim\] min_bytes: expected a size in \[2MiB, 1PiB\], got 65536"),
                     ({"min_bytes": "lots"}, r"\[shim\] min_bytes: expected a size .*, got \"lots\""),
                     ({"policy": "bind"}, r"\[shim\] policy: expected an allocation policy \(none, fast, "),
                     ({"policy": "fastest"}, r"expected an allocation policy .*, got \"fastest\""),
                     ({"backing": "file"}, r"\[shim\] backing: expected \"anon\" or \"memfd\", got \"file\""),
                     ({"thp": "yes"}, r"\[shim\] thp: expected true or false")]:
        with pytest.raises(ConfigError, match=msg):
            ShimSettings.from_config(bad)
