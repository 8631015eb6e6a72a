# SPDX-License-Identifier: Apache-2.0
"""The loop's pure parts (tieringd/daemon/loop.py, settings.py): hint faults ingested as touches, the
whole configuration validated before anything starts, a bad new configuration refused with the old
one kept, and the thread-safe entry points of the Daemon contract."""
import threading

import numpy as np
import pytest

from tieringd import config
from tieringd.contracts import ACCESS_DELTA_DTYPE, SampleSource
from tieringd.daemon import main
from tieringd.daemon.loop import Daemon
from tieringd.sampling import touches
from tieringd.settings import Settings


def rows(*specs):
    out = np.zeros(len(specs), ACCESS_DELTA_DTYPE)
    for i, (count, source) in enumerate(specs):
        out[i] = (1, 0x200000 * (i + 1), 0x200000, count, 10, int(source))
    return out


def test_hint_faults_count_once_per_block_and_interval_other_sources_keep_counts():
    d = rows((1, SampleSource.FAULT), (512, SampleSource.FAULT), (7, SampleSource.PMU),
             (3, SampleSource.ACCESSED))
    t = touches(d)
    assert t["count"].tolist() == [1, 1, 7, 3]
    assert d["count"].tolist() == [1, 512, 7, 3]          # the input is left alone
    assert len(touches(rows())) == 0


def load(tmp_path, text: str) -> config.ConfigFile:
    p = tmp_path / "tieringd.toml"
    p.write_text(text)
    return config.load(str(p))


def test_settings_read_every_table(tmp_path):
    s = Settings.from_config(load(tmp_path, "[policy]\ninterval_ms = 50\n[mover]\nworkers = 1\n"
                                  "[blocksize]\nkv_bytes_per_token = 65536\n"))
    assert s.policy.interval_ms == 50 and s.mover.workers == 1
    assert s.blocksize.kv_bytes_per_token == 65536


@pytest.mark.parametrize("text, where", [
    ("[mover]\nworkers = \"two\"\n", "tieringd.toml:2: [mover] workers"),
    ("[sampling]\nsorces = [\"fault\"]\n", "tieringd.toml:2: [sampling] sorces"),
    ("[shim]\npolicy = \"bind\"\n", "tieringd.toml:2: [shim] policy"),
])
def test_a_bad_table_is_refused_with_file_line_and_key(tmp_path, text, where):
    with pytest.raises(config.ConfigError) as e:
        Daemon(load(tmp_path, text), run_dir=str(tmp_path / "run"))
    assert str(e.value).startswith(str(tmp_path / where))
    assert not (tmp_path / "run").exists()                 # nothing started


def test_a_bad_new_configuration_keeps_the_old_settings(tmp_path):
    d = Daemon(load(tmp_path, "[policy]\ninterval_ms = 50\n"), run_dir=str(tmp_path / "run"))
    with pytest.raises(config.ConfigError):
        d.apply_config(load(tmp_path, "[policy]\ninterval_ms = 20\n[mover]\nbatch_pages = 0\n"))
    assert d.settings.policy.interval_ms == 50
    d.apply_config(load(tmp_path, "[policy]\ninterval_ms = 20\n"))
    assert d.settings.policy.interval_ms == 20


def test_call_soon_and_request_stop_are_safe_from_other_threads(tmp_path):
    d = Daemon(config.ConfigFile(), run_dir=str(tmp_path / "run"))
    ran = []
    threads = [threading.Thread(target=d.call_soon, args=(lambda i=i: ran.append(i),)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    d.request_stop()
    d._woken()                                              # what the loop does when the fd is readable
    assert sorted(ran) == list(range(8)) and d._stopping


def test_main_refuses_to_run_without_root(monkeypatch, caplog):
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    assert main(["--run-dir", "/nonexistent"]) == 1
    assert "runs as root" in caplog.text


def test_a_reader_whose_callback_raises_is_logged_and_the_loop_goes_on(caplog):
    calls = []

    def boom():
        calls.append(1)
        raise ValueError("a bug in a handler")
    Daemon._ready(boom)
    Daemon._ready(lambda: calls.append(2))
    assert calls == [1, 2]
    assert "a reader's callback failed (the loop goes on)" in caplog.text and "a bug in a handler" in caplog.text
