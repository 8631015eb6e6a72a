# SPDX-License-Identifier: Apache-2.0
"""Every numeric key has a finite range, and the one configuration check holds it on both ways a
value comes in: the file (``tieringd --check-config``, a start, a reload) and ``policy-set`` on the
control socket (JSON, where NaN and Infinity are numbers too). Whatever number a key is given, the
daemon either takes it — and then it lies in the key's range — or refuses it with one line; nothing
else happens (no exception, no select() handed 1e308 seconds)."""
from __future__ import annotations

import dataclasses
import grp
import json
import math
import os
import threading
import typing
from collections.abc import Mapping

import pytest
from hypothesis import HealthCheck, example, given, settings as hsettings, strategies as st

from tieringd import config, settings
from tieringd.config import ConfigError, ConfigFile
from tieringd.service.control import Client, ControlError
from tieringd.service.service import Service

from tieringd.kernel import sysfs

from test_daemon_hotplug import FIX, daemon_as_started

SPECIALS = (math.nan, math.inf, -math.inf, 0, -1, 1e308, 2 ** 64)


def _shape(hint) -> str | None:
    """scalar, list or table for a numeric key's annotation; None for any other key."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, __import__("types").UnionType):
        inner = [a for a in args if a is not type(None)]
        return _shape(inner[0]) if len(inner) == 1 else None
    if hint in (int, float):
        return "scalar"
    if origin in (tuple, list) and args and args[0] in (int, float):
        return "list"
    if origin in (dict, Mapping) and args[1] in (int, float):
        return "table"
    return None


def numeric_keys() -> list[tuple[str, dataclasses.Field, str]]:
    """(table, field, shape) of every numeric key of every table."""
    out = []
    for name, (cls, _) in settings.TABLES.items():
        hints = typing.get_type_hints(cls)
        out += [(name, f, _shape(hints[f.name])) for f in dataclasses.fields(cls)
                if f.init and _shape(hints[f.name])]
    return out


KEYS = numeric_keys()
IDS = [f"{t}.{f.name}" for t, f, _ in KEYS]


def test_every_numeric_key_has_a_finite_range_holding_its_default():
    assert len(KEYS) > 50
    for table, f, shape in KEYS:
        rng = config.range_of(f)
        assert rng is not None, f"[{table}] {f.name} is a number without a range: declare it with config.ranged()"
        assert math.isfinite(rng.lo) and math.isfinite(rng.hi) and rng.lo <= rng.hi and rng.hi < 2 ** 63
        default = settings.TABLES[table][0]()
        value = getattr(default, f.name)
        values = [] if value is None else list(value.values()) if shape == "table" else \
            list(value) if shape == "list" else [value]
        assert all(v in rng for v in values), f"[{table}] {f.name}: default {value!r} outside {rng.text()}"


def _toml(v) -> str:
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    if isinstance(v, float) and math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return repr(v)


def _file(table: str, key: str, shape: str, v) -> str:
    if shape == "table":
        return f'[{table}.{key}]\n"pid:1" = {_toml(v)}\n'
    return f"[{table}]\n{key} = {'[' + _toml(v) + ']' if shape == 'list' else _toml(v)}\n"


def _wire(key: str, shape: str, v):
    return {"pid:1": v} if shape == "table" else [v] if shape == "list" else v


def _taken(built: settings.Settings, table: str, key: str, shape: str):
    value = getattr(getattr(built, table), key)
    return value["pid:1"] if shape == "table" else value[0] if shape == "list" else value


def _held(f: dataclasses.Field, table: str, v, taken) -> None:
    """A value the check took is in the key's range and is the value given (a size: its bytes)."""
    assert taken in config.range_of(f), f"[{table}] {f.name} = {v!r} was taken as {taken!r}"
    assert taken == (int(v) if f.metadata.get("unit") == "bytes" else v)


NUMBERS = st.one_of(st.sampled_from(SPECIALS), st.floats(), st.integers(), st.integers(-10, 10 ** 6))


def _examples(fn):
    for v in SPECIALS:
        fn = example(v=v)(fn)
    return fn


@pytest.mark.parametrize("table, f, shape", KEYS, ids=IDS)
@hsettings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(v=NUMBERS)
@_examples
def test_the_file_takes_a_number_in_range_or_refuses_it_in_one_line(tmp_path, table, f, shape, v):
    path = tmp_path / "tieringd.toml"
    path.write_text(_file(table, f.name, shape, v))
    try:
        built = settings.check(config.load(str(path)))
    except ConfigError as e:
        text = str(e)
        assert "\n" not in text and text.startswith(f"{path}:"), text
        assert f"[{table}" in text
        return
    _held(f, table, v, _taken(built, table, f.name, shape))


@pytest.fixture(scope="module")
def wire(tmp_path_factory, repo):
    """policy-set over the control socket of a Daemon built from a captured machine (its handlers
    in the loop thread's place: a thread that dispatches what the loop's selector reports)."""
    tmp = tmp_path_factory.mktemp("wire")
    group = grp.getgrgid(os.getgid()).gr_name
    with sysfs.root(repo / FIX / "cxl-6.12"):
        d = daemon_as_started(tmp, f'[control]\ngroup = "{group}"\n')
    cfg = ConfigFile(dict(d.settings.source), None)
    svc = Service(d, cfg, d.settings, run_dir=d.run_dir)
    svc.control.start()
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            for key, _ in d._sel.select(0.02):
                key.data()
    t = threading.Thread(target=loop, daemon=True)
    t.start()
    with Client(d.run_dir, timeout_s=10) as c:
        yield c
    stop.set()
    t.join(5)
    svc.control.close()


@pytest.mark.parametrize("table, f, shape", KEYS, ids=IDS)
@hsettings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(v=NUMBERS)
@_examples
def test_policy_set_takes_a_number_in_range_or_refuses_it_in_one_line(wire, table, f, shape, v):
    try:
        doc = wire.request("policy-set", set={f"{table}.{f.name}": _wire(f.name, shape, v)})
    except ControlError as e:
        assert e.code == "config" and "\n" not in e.message and e.message.startswith(f"[{table}"), e.message
        return
    assert _wire(f.name, shape, v) is not None and v in config.range_of(f)
    assert doc["overrides"][f"{table}.{f.name}"] == json.loads(json.dumps(_wire(f.name, shape, v)))
    wire.request("policy-set", set={f"{table}.{f.name}": _wire(f.name, shape, _default(table, f, shape))})


def _default(table: str, f: dataclasses.Field, shape: str):
    """The key's default, or (unset by default) the range's low end, to set it back after a change."""
    value = getattr(settings.TABLES[table][0](), f.name)
    if value is None or (shape == "table" and not value):
        return config.range_of(f).lo if not config.range_of(f).lo_open else config.range_of(f).hi
    return value["pid:1"] if shape == "table" else value[0] if shape == "list" else value


def test_check_config_refuses_nan_and_infinity_in_one_line(tmp_path, capsys):
    from tieringd.daemon import main
    for text in ("[policy]\ninterval_ms = 1e308\n", "[policy]\ninterval_ms = nan\n",
                 "[heat]\nhalf_life_s = inf\n", '[mover]\nbatch_pages = 18446744073709551616\n',
                 '[shim]\nmin_bytes = "9999999999999999999999999P"\n', "[dax]\nsize_bytes = -inf\n"):
        path = tmp_path / "tieringd.toml"
        path.write_text(text)
        assert main(["--check-config", str(path)]) == 1, text
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and err.startswith(f"{path}:2: ["), err
