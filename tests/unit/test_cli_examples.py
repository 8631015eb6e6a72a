# SPDX-License-Identifier: Apache-2.0
"""The example outputs of docs/cli.md are what the commands print today.

Each example that needs no lab and no particular machine (scripts/capture-cli-examples.py, kind
``fixture``: captured sysfs trees, the shipped trace, ``--help``, the error paths without a daemon)
is run again, as a subprocess with the script's environment, and compared with its committed capture
under docs/cli/. Only what truly varies between two runs is normalised before the comparison, by the
script's ``normalise``: wall times (``tune``'s "N settings in S s") and process ids (the shim's
``tieringd-shim[PID]`` log lines); every other byte must match. ``host`` examples (``doctor``,
``probe``: this machine's kernel and memory) and ``lab`` ones (the running daemon in a lab guest) are
captured once and only checked for being in docs/cli.md.

docs/cli.md includes every capture verbatim after its ``<!-- capture: cli/NAME.txt -->`` marker, and
has a section for every subcommand of ``tieringctl`` and for the ``tieringd`` daemon.

After changing a command's output: ``python scripts/capture-cli-examples.py [--only NAME]`` re-captures
and syncs docs/cli.md; ``--check`` is this test from the command line.
"""
import importlib.util
import sys

import pytest

from paths import REPO
from tieringd.cli import SUBCOMMANDS


def _script():
    name = "capture_cli_examples"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / "capture-cli-examples.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod              # dataclasses need the module registered while it executes
        spec.loader.exec_module(mod)
    return sys.modules[name]


CAP = _script()
EXAMPLES = CAP.examples()
CHECKED = [e for e in EXAMPLES if e.checked]


def _marks(ex):
    return [pytest.mark.shim] if ex.needs_shim else []


@pytest.mark.parametrize("ex", [pytest.param(e, id=e.name, marks=_marks(e)) for e in CHECKED])
def test_the_capture_is_what_the_command_prints_now(ex):
    assert ex.path.exists(), f"{ex.path} is missing: python scripts/capture-cli-examples.py --only {ex.name}"
    now = CAP.capture(ex)
    assert CAP.normalise(now) == CAP.normalise(ex.path.read_text()), (
        f"{ex.name}: the output changed; re-capture with python scripts/capture-cli-examples.py "
        f"--only {ex.name}\n--- now:\n{now}")


def test_docs_cli_md_includes_every_capture_verbatim():
    doc = (REPO / "docs" / "cli.md").read_text()
    blocks = CAP.doc_blocks(doc)
    files = CAP.committed()
    assert set(files) == {e.name for e in EXAMPLES}, "docs/cli/ and the script's examples differ"
    for name, text in files.items():
        assert name in blocks, f"docs/cli.md has no <!-- capture: cli/{name}.txt --> block"
        assert blocks[name] == text, f"docs/cli.md's block of cli/{name}.txt differs from the file"
    assert set(blocks) <= set(files), set(blocks) - set(files)


def test_docs_cli_md_has_a_section_per_subcommand_and_the_daemon():
    headings = [line[3:].strip() for line in (REPO / "docs" / "cli.md").read_text().splitlines()
                if line.startswith("## ")]
    for name in SUBCOMMANDS:
        assert any(h.startswith(f"`tieringctl {name}") for h in headings), name
    assert any(h.startswith("`tieringd`") for h in headings)


def test_normalise_touches_only_wall_times_and_pids():
    assert CAP.normalise("4 settings in 2 s; mover") == CAP.normalise("4 settings in 13 s; mover")
    assert CAP.normalise("tieringd-shim[27012]: x") == CAP.normalise("tieringd-shim[1]: x")
    assert CAP.normalise("4 settings in 2 s") != CAP.normalise("5 settings in 2 s")
    assert CAP.normalise("hit rate 69.9%") != CAP.normalise("hit rate 69.8%")
