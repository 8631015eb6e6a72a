# SPDX-License-Identifier: Apache-2.0
import pytest

from tieringd.units import parse_size


def test_suffixes_are_binary_like_the_shim():
    assert parse_size("4M") == parse_size("4MiB") == parse_size("4mb") == 4 << 20
    assert parse_size("64GiB") == 64 << 30
    assert parse_size("1.5G") == 3 << 29
    assert parse_size(4096) == parse_size("4096") == parse_size("0x1000") == 4096


def test_bad_sizes_name_the_setting():
    with pytest.raises(ValueError, match=r"--min-bytes: 'lots' is not a size"):
        parse_size("lots", "--min-bytes")
    with pytest.raises(ValueError, match="not a size"):
        parse_size("4i")
    with pytest.raises(ValueError, match="at least 1 bytes"):
        parse_size("0", minimum=1)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), -0.5, "9" * 400 + "P"])
def test_no_size_is_infinite_or_below_zero(value):
    with pytest.raises(ValueError):
        parse_size(value)
