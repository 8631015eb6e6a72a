# SPDX-License-Identifier: Apache-2.0
"""Every table at once (tieringd/settings.py): what --check-config, a start and SIGHUP refuse, with
one line naming file:line and key; and the shipped default file (etc/tieringd.toml)."""
import dataclasses
import io
import re

import pytest

from tieringd import config, settings
from tieringd.config import ConfigError


def write(tmp_path, text: str):
    p = tmp_path / "tieringd.toml"
    p.write_text(text)
    return str(p)


def check_text(tmp_path, text: str):
    return settings.check(config.load(write(tmp_path, text)))


def test_an_empty_file_builds_every_table_with_defaults(tmp_path):
    built = check_text(tmp_path, "")
    assert set(built.tables()) == set(settings.TABLES)
    assert built.mover.batch_pages == 4096 and built.metrics.listen == ""


def test_an_unknown_key_is_one_line_naming_file_line_and_key(tmp_path):
    path = write(tmp_path, "[policy]\ninterval_ms = 100\n\n[mover]\nworkers = 2\nbatch_page = 64\n")
    with pytest.raises(ConfigError) as e:
        settings.load(path)
    text = str(e.value)
    assert "\n" not in text
    assert text.startswith(f"{path}:6: [mover] batch_page: unknown key (known: ")


def test_a_wrong_type_is_one_line_naming_file_line_key_expected_and_found(tmp_path):
    path = write(tmp_path, '[sampling]\n\ninterval_ms = "fast"\n')
    with pytest.raises(ConfigError) as e:
        settings.load(path)
    assert str(e.value) == f'{path}:3: [sampling] interval_ms: expected an integer (milliseconds), got "fast"'


def test_values_of_the_service_tables_are_checked(tmp_path):
    with pytest.raises(ConfigError, match=r':2: \[metrics\] listen: expected "ADDRESS:PORT"'):
        check_text(tmp_path, '[metrics]\nlisten = "localhost"\n')
    with pytest.raises(ConfigError, match=r":2: \[control\] max_clients: expected an integer in \[1, 65536\], got 0"):
        check_text(tmp_path, "[control]\nmax_clients = 0\n")


def test_the_memory_tables_docs_dax_md_shows_are_the_daemons_too(tmp_path):
    # the daemon refused [hotplug] as an unknown table, so the configuration docs/dax.md gives a
    # user (and the pmem lab boot) stopped it at start
    built = check_text(tmp_path, '[hotplug]\nonline = ["pmem", "cxl-pmem"]\nact = "never"\n'
                                 '[dax]\npath = "/mnt/pmem/tieringd/kv.log"\n')
    assert built.hotplug.online == ("pmem", "cxl-pmem") and built.hotplug.act == "never"
    assert built.dax.path == "/mnt/pmem/tieringd/kv.log"
    with pytest.raises(ConfigError, match=r':2: \[hotplug\] act: expected auto \| always \| never, got "often"'):
        check_text(tmp_path, '[hotplug]\nact = "often"\n')


def test_an_unknown_table_and_a_key_outside_any_table_are_refused_on_their_line(tmp_path):
    with pytest.raises(ConfigError, match=r":3: \[polcy\]: unknown table \(tables: topology, shim"):
        check_text(tmp_path, "[mover]\n\n[polcy]\ninterval_ms = 5\n")
    with pytest.raises(ConfigError, match=r":1: \[interval_ms\]: a key outside any table"):
        check_text(tmp_path, "interval_ms = 5\n[mover]\n")


def test_check_file_exits_0_or_1_with_the_one_line(tmp_path):
    out, err = io.StringIO(), io.StringIO()
    good = write(tmp_path, "[mover]\nworkers = 1\n")
    assert settings.check_file(good, out, err) == 0
    assert out.getvalue() == f"{good}: ok (mover: given; the rest default)\n" and err.getvalue() == ""
    bad = write(tmp_path, "[mover]\nworkers = -1\n")
    out, err = io.StringIO(), io.StringIO()
    assert settings.check_file(bad, out, err) == 1
    assert err.getvalue() == f"{bad}:2: [mover] workers: expected an integer in [1, 64], got -1\n"
    assert settings.check_file(str(tmp_path / "missing.toml"), out, err) == 1


def test_a_file_that_does_not_parse_names_its_line(tmp_path):
    """As every other error: FILE:LINE: first (tomllib says "at line 2, column 11" at the end)."""
    with pytest.raises(ConfigError) as e:
        check_text(tmp_path, "[mover]\nworkers = = 2\n")
    assert str(e.value) == f"{tmp_path / 'tieringd.toml'}:2: invalid TOML: Invalid value (column 11)"
    with pytest.raises(ConfigError) as e:
        check_text(tmp_path, "[mover]\nworkers = ")
    assert str(e.value) == f"{tmp_path / 'tieringd.toml'}:2: invalid TOML: Invalid value (at the end of the file)"


def test_a_file_that_is_not_utf8_names_its_line(tmp_path):
    p = tmp_path / "tieringd.toml"
    p.write_bytes(b"[mover]\n# caf\xe9\n")
    with pytest.raises(ConfigError) as e:
        settings.load(str(p))
    assert str(e.value) == f"{p}:2: not UTF-8 text (byte 0xe9 at column 6)"


@pytest.mark.parametrize("text, line", [
    ('[blocksize]\nsmall_tokens = 8\nmodel = "no-such-model"\n', 3),
    ('shim = { nosuch = true }\n', 1),
    ('x.y = 1\n', 1),
    ('[policy]\nquotas.x = { a = 1 }\n', 2),
    ('[shim]\n[policy.nosuch]\nx = 1\n', 2),
])
def test_errors_in_keys_a_header_does_not_name_are_placed_on_their_line(tmp_path, text, line):
    """A model the [blocksize] check refuses, tables given inline or as dotted keys: still FILE:LINE."""
    with pytest.raises(ConfigError) as e:
        check_text(tmp_path, text)
    assert str(e.value).startswith(f"{tmp_path / 'tieringd.toml'}:{line}: "), str(e.value)


# ---- the shipped file -------------------------------------------------------------------------------

def test_the_shipped_default_file_is_what_the_code_generates(repo):
    shipped = (repo / "etc" / "tieringd.toml").read_text()
    assert shipped == settings.default_file_text(), \
        "etc/tieringd.toml is stale: regenerate it with `.venv/bin/tieringd --print-default-config > etc/tieringd.toml`"


def test_every_key_of_every_table_is_in_the_shipped_file(repo):
    text = (repo / "etc" / "tieringd.toml").read_text()
    for name, (cls, _) in settings.TABLES.items():
        if name == "topology":
            assert "\n[topology]\n" in text and "# probe_file =" in text and "[topology.nodes.2]" in text
            continue
        assert f"\n[{name}]\n" in text
        for f in dataclasses.fields(cls):
            assert re.search(rf"^# (\[{name}\.)?{f.name}\b", text, re.M), f"[{name}] {f.name} is not documented"


def test_the_shipped_file_uncommented_is_valid_and_is_the_defaults(repo, tmp_path):
    text = (repo / "etc" / "tieringd.toml").read_text()
    lines = [re.sub(r"^# (\w+ = .*?)(  # .*)?$", r"\1", line) if re.match(r"^# \w+ = \S", line) else line
             for line in text.splitlines()]
    uncommented = "\n".join(lines)
    assert uncommented.count("\n# ") < text.count("\n# ")        # something was uncommented
    built = check_text(tmp_path, uncommented)
    defaults = check_text(tmp_path, "")
    assert built == defaults


def test_the_documented_example_passes_every_table(repo, tmp_path):
    text = (repo / "docs" / "configuration.md").read_text()
    example = re.search(r"```toml\n(.*?)```", text, re.S)[1]
    built = check_text(tmp_path, example)
    assert built.metrics.listen == "127.0.0.1:9464" and built.control.group == "tieringd"
    assert [name for name in settings.TABLES if name in built.source] == list(settings.TABLES)


def test_tieringd_check_config_refuses_an_unknown_key_and_a_wrong_type_in_one_line_each(tmp_path, capsys):
    from tieringd.daemon import main
    for text, line in (("[policy]\ninterval_ms = 50\nintervall_ms = 5\n", ":3: [policy] intervall_ms: unknown key"),
                       ('[heat]\n\n[policy]\ninterval_ms = "fast"\n',
                        ':4: [policy] interval_ms: expected a number (milliseconds), got "fast"')):
        path = write(tmp_path, text)
        assert main(["--check-config", path]) == 1
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and err.startswith(f"{path}{line}"), err
    assert main(["--check-config", write(tmp_path, "[policy]\ninterval_ms = 50\n")]) == 0
    assert capsys.readouterr().out.endswith(": ok (policy: given; the rest default)\n")
