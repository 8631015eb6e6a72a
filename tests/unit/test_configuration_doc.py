# SPDX-License-Identifier: Apache-2.0
"""docs/configuration.md against the code: its reference part is what ``tieringd
--print-config-reference`` generates from the tables' dataclasses (tieringd/settings.py), and its
example has every table and passes the daemon's own check.

Run this file as a script to regenerate the reference part in place:
``.venv/bin/python tests/unit/test_configuration_doc.py``."""
import dataclasses
import re
import sys
import tomllib
from pathlib import Path

import pytest

from tieringd import config, settings
from tieringd.contracts import Tier

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
REGENERATE = ("regenerate it with `.venv/bin/python tests/unit/test_configuration_doc.py` (it puts "
              "`tieringd --print-config-reference` between the markers of docs/configuration.md)")


def split(text: str) -> tuple[str, str, str]:
    """(before, generated, after) around the markers; the markers stay in before/after."""
    begin, end = settings.REFERENCE_BEGIN + "\n", settings.REFERENCE_END + "\n"
    assert text.count(begin) == 1 and text.count(end) == 1, \
        f"docs/configuration.md has one {settings.REFERENCE_BEGIN!r} line and one {settings.REFERENCE_END!r} line"
    head, _, rest = text.partition(begin)
    generated, _, tail = rest.partition(end)
    return head + begin, generated, end + tail


def regenerate(path: Path = DOC) -> None:
    head, _, tail = split(path.read_text())
    path.write_text(head + settings.reference_markdown() + tail)


def cells(row: str) -> list[str]:
    """The cells of a markdown table row (an escaped pipe stays in its cell)."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]]


@pytest.fixture(scope="module")
def doc() -> str:
    return DOC.read_text()


@pytest.fixture(scope="module")
def example_text(doc) -> str:
    blocks = re.findall(r"```toml\n(.*?)```", doc, re.S)
    assert len(blocks) == 1, "docs/configuration.md has one ```toml block: the example with every table"
    return blocks[0]


# ---- the generated reference ------------------------------------------------------------------------

def test_the_reference_in_the_doc_is_what_the_code_generates(doc):
    _, generated, _ = split(doc)
    assert generated == settings.reference_markdown(), f"docs/configuration.md's reference is stale: {REGENERATE}"


def test_the_reference_has_every_table_in_order_and_every_key_of_each():
    text = settings.reference_markdown()
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    assert [s.partition("\n")[0] for s in sections] == [f"[{name}]" for name in settings.TABLES]
    for section, (name, (cls, note)) in zip(sections, settings.TABLES.items()):
        rows = [line for line in section.splitlines() if line.startswith("| `")]
        keys = [re.match(r"\| `([^`]+)`", row)[1] for row in rows]
        fields = [f.name for f in dataclasses.fields(cls) if f.init]
        assert len(keys) == len(fields), f"[{name}]: {keys} for the fields {fields}"
        for key, field in zip(keys, fields):
            assert key == field or key in (f"[{name}.{field}]", f"[{name}.{field}.N]"), f"[{name}] {field}: row {key}"
        assert all(len(cells(row)) == 6 for row in rows), f"[{name}]: a row is not 6 cells"


def test_every_key_has_a_type_and_a_meaning():
    text = settings.reference_markdown()
    for line in text.splitlines():
        if not line.startswith("| `"):
            continue
        key, what, default, _range, _unit, meaning = cells(line)
        assert what and default, line
        assert meaning, (f"{key} has no meaning in the reference: give its field a comment on its line "
                         f"(`name: type = default  # what it does`) or a 'doc' in its metadata")


def test_the_count_sentence_counts_the_tables_and_keys():
    keys = sum(len([f for f in dataclasses.fields(cls) if f.init]) for cls, _ in settings.TABLES.values())
    first = settings.reference_markdown().partition("\n")[0]
    assert first.startswith(f"{len(settings.TABLES)} tables, {keys} keys, ")
    assert settings.reference_keys() == {name: [f.name for f in dataclasses.fields(cls) if f.init]
                                         for name, (cls, _) in settings.TABLES.items()}


def test_types_defaults_and_units_are_worded_as_the_checks_word_them():
    text = settings.reference_markdown()
    rows: dict[str, str] = {}
    for line in text.splitlines():          # a key two tables share ([shim], [pool] min_bytes): the first
        if line.startswith("| `"):
            rows.setdefault(re.match(r"\| `([^`]+)`", line)[1], line)
    assert rows["migration_budget_bytes"].startswith(
        '| `migration_budget_bytes` | a size ("4M", "1.5GiB" or bytes) | `"256MiB"` | [1, 1PiB] | bytes |')
    assert rows["batch_pages"].startswith("| `batch_pages` | an integer | `4096` | [1, 1048576] | pages |")
    assert rows["sources"].startswith('| `sources` | a list of strings | `["fault", "pmu", "dma"]` |  |  |')
    assert rows["min_bytes"].startswith('| `min_bytes` | a size ("4M", "1.5GiB" or bytes) | unset | [2MiB, 1PiB] | bytes |')
    assert rows["memory_blocks"].startswith("| `memory_blocks` | true or false | `true` |  |  |")
    assert rows["timeout_s_per_gib"].startswith("| `timeout_s_per_gib` | a number | `120.0` | [0, 86400] | seconds per GiB |")
    assert rows["frequency_quantile"].startswith("| `frequency_quantile` | a number | `0.99` | (0, 1] |  |")
    assert rows["[policy.quotas]"].startswith('| `[policy.quotas]` | a table, each value a size')
    assert rows["[topology.nodes.N]"].startswith("| `[topology.nodes.N]` | a table per N")
    assert 'auto \\| netlink \\| poll' in rows["source"]          # pipes escaped in a cell


def test_the_product_text_names_no_internal_references():
    for text in (settings.reference_markdown(), DOC.read_text(), settings.default_file_text()):
        assert not re.search(r"\bthe brief\b|\bissue \d|\bstop \d", text, re.I)


def test_tieringd_print_config_reference_prints_it(capsys):
    from tieringd.daemon import main
    assert main(["--print-config-reference"]) == 0
    assert capsys.readouterr().out == settings.reference_markdown()


# ---- the example ------------------------------------------------------------------------------------

def test_the_example_has_every_table(example_text):
    assert list(tomllib.loads(example_text)) == list(settings.TABLES)


def test_the_example_passes_the_daemons_check(example_text, tmp_path):
    path = tmp_path / "tieringd.toml"
    path.write_text(example_text)
    built = settings.check(config.load(str(path)))
    assert built.topology.nodes == {2: Tier.PMEM}
    assert built.shim.min_bytes == 4 << 20 and built.sampling.sources == ("fault", "dma")
    assert built.heat.weights == pytest.approx((0.30, 0.25, 0.25, 0.20)) and built.heat.half_life_s == 1.0
    assert built.policy.thresholds == (0.8, 0.5, 0.2) and built.policy.migration_budget_bytes == 256 << 20
    assert built.policy.quotas == {"cgroup:/inference/a": 8 << 30}
    assert built.mover.batch_pages == 4096 and built.metrics.listen == "127.0.0.1:9464"
    assert built.hotplug.act == "auto" and built.hotplug.keep_devdax == ("dax1.0",)
    assert built.dax.path == "/dev/dax1.0" and built.dax.segment_bytes == 64 << 20


def test_a_typo_is_an_error_naming_the_table_and_key(tmp_path):
    path = tmp_path / "tieringd.toml"
    path.write_text("[heat]\nhalf_life = 2\n")
    with pytest.raises(config.ConfigError, match=r":2: \[heat\] half_life: unknown key"):
        settings.check(config.load(str(path)))


if __name__ == "__main__":
    regenerate(Path(sys.argv[1]) if len(sys.argv) > 1 else DOC)
    print(f"{DOC if len(sys.argv) < 2 else sys.argv[1]}: reference regenerated")
