# SPDX-License-Identifier: Apache-2.0
"""``tieringctl migrate`` (tieringd/cli/migrate.py): argument handling — bad input gets a one-line error,
never a traceback — and the mappings ``--all`` takes."""
import click
import pytest
from click.testing import CliRunner

from tieringd.kernel import sysfs
from tieringd.cli import main
from tieringd.cli import migrate as cli_migrate
from tieringd.contracts import Tier


def test_parse_range_forms():
    assert cli_migrate.parse_range("0x1000-0x3000") == (0x1000, 0x2000)
    assert cli_migrate.parse_range("4096+8K") == (4096, 8192)
    assert cli_migrate.parse_range("0x7f0000000000+256M") == (0x7F0000000000, 256 << 20)
    for bad in ("zz", "0x3000-0x1000", "10", "0x1000+0", "a-b"):
        with pytest.raises(click.BadParameter):
            cli_migrate.parse_range(bad)


def test_parse_target_node_or_tier():
    assert cli_migrate.parse_target("cxl-dram") is Tier.CXL_DRAM
    assert cli_migrate.parse_target("PMEM") is Tier.PMEM
    with pytest.raises(click.BadParameter, match="does not exist or has no memory"):
        cli_migrate.parse_target("4095")
    with pytest.raises(click.BadParameter, match="unknown tier"):
        cli_migrate.parse_target("ssd")


@pytest.mark.parametrize("args, message", [
    (["--pid", "1", "--to", "0"], "give either --range"),
    (["--pid", "1", "--all", "--range", "0x1000+4K", "--to", "0"], "give either --range"),
    (["--pid", "999999999", "--all", "--to", "0"], "no process 999999999"),
    (["--pid", "1", "--range", "nope", "--to", "0"], "expected START-END"),
    (["--pid", "1", "--all", "--to", "ssd"], "unknown tier"),
])
def test_bad_input_is_one_clear_line(args, message):
    r = CliRunner().invoke(main, ["migrate", *args])
    assert r.exit_code != 0
    assert message in r.output
    assert "Traceback" not in r.output


MAPS = """\
55d0c0a00000-55d0c0a21000 rw-p 00000000 00:00 0                          [heap]
7f0000000000-7f0010000000 rw-p 00000000 00:00 0
7f3a1c000000-7f3a1c200000 r--p 00000000 fd:01 1234                       /usr/lib/x86_64-linux-gnu/libc.so.6
7ffc1a2b0000-7ffc1a2d1000 rw-p 00000000 00:00 0                          [stack]
7ffc1a3f0000-7ffc1a3f4000 r--p 00000000 00:00 0                          [vvar]
7ffc1a3f4000-7ffc1a3f6000 r--p 00000000 00:00 0                          [vvar_vclock]
7ffc1a3f6000-7ffc1a3f8000 r-xp 00000000 00:00 0                          [vdso]
ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0                  [vsyscall]
"""


def test_all_takes_every_mapping_with_struct_pages(tmp_path):
    (tmp_path / "proc/42").mkdir(parents=True)
    (tmp_path / "proc/42/maps").write_text(MAPS)
    with sysfs.root(tmp_path):
        spans = cli_migrate.process_ranges(42)
    assert spans == [(0x55D0C0A00000, 0x21000), (0x7F0000000000, 0x10000000), (0x7F3A1C000000, 0x200000),
                     (0x7FFC1A2B0000, 0x21000)]
