# SPDX-License-Identifier: Apache-2.0
"""The /metrics endpoint over a running loop (tests/unit/daemon_standin.py): names and units, the
snapshot the loop publishes, and a loop too busy to answer."""
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemon_standin import BLOCK_BYTES, StandInDaemon
from tieringd.service import reports
from tieringd import settings
from tieringd.config import ConfigError, ConfigFile, from_table
from tieringd.contracts import Tier
from tieringd.service.metrics import MetricsConfig, TickHistogram, parse_listen
from tieringd.service.service import Service


@pytest.fixture
def running(tmp_path):
    cfg = ConfigFile({"metrics": {"listen": "127.0.0.1:0", "snapshot_timeout_ms": 200},
                      "lifecycle": {"source": "poll"}})
    d = StandInDaemon(cfg, run_dir=str(tmp_path))
    d.table.add_region(777, 0x7f0000000000, 4 * BLOCK_BYTES, BLOCK_BYTES, node=1, tier=Tier.CXL_DRAM)
    svc = Service(d, cfg, settings.check(cfg), run_dir=str(tmp_path))
    svc.start()
    d.start_thread()
    yield d, svc
    d.stop_thread()
    svc.stop()


def scrape(svc) -> dict:
    host, port = svc.metrics.address
    text = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_the_endpoint_reports_bytes_per_tier_ticks_and_queue(running):
    d, svc = running
    time.sleep(0.3)
    m = scrape(svc)
    assert m[("tieringd_process_tier_bytes", (("comm", ""), ("pid", "777"), ("tier", "cxl-dram")))] == 8 << 20
    assert m[("tieringd_tier_managed_bytes", (("tier", "cxl-dram"),))] == \
        d.in_loop(lambda: reports.bytes_by_tier(d)["cxl-dram"]) == 8 << 20
    assert m[("tieringd_ticks_total", ())] >= 1
    assert m[("tieringd_tick_duration_seconds_count", ())] >= 1
    assert ("tieringd_mover_queue_jobs", ()) in m and ("tieringd_regions", ()) in m
    assert m[("tieringd_sampler_events_total", (("counter", "counted"), ("sampler", "fault")))] == 0
    assert m[("tieringd_info", (("lifecycle", "/proc polling"), ("signal", "hint-faults"),
                                ("version", "0.1.0")))] == 1
    assert ("process_cpu_seconds_total", ()) in m
    names = {n for n, _ in m}
    assert all(n.startswith(("tieringd_", "process_")) for n in names)


def test_a_busy_loop_gets_the_previous_snapshot_with_its_age(running):
    d, svc = running
    scrape(svc)                                  # a first snapshot exists
    d.call_soon(lambda: time.sleep(1.5))         # the loop is busy for longer than the timeout
    time.sleep(0.05)
    m = scrape(svc)
    assert m[("tieringd_snapshot_age_seconds", ())] > 0.1
    assert m[("tieringd_tier_managed_bytes", (("tier", "cxl-dram"),))] == 8 << 20


def test_metrics_are_off_unless_listen_is_set(tmp_path):
    cfg = ConfigFile({"lifecycle": {"source": "poll"}})
    d = StandInDaemon(cfg, run_dir=str(tmp_path))
    svc = Service(d, cfg, settings.check(cfg), run_dir=str(tmp_path)).start()
    try:
        assert svc.metrics is None
    finally:
        svc.stop()


def test_tick_histogram_buckets_are_cumulative():
    h = TickHistogram((0.01, 0.1))
    for ms in (5, 50, 50, 500):
        h.observe_ms(ms)
    assert h.cumulative() == [("0.01", 1), ("0.1", 3), ("+Inf", 4)]
    assert h.sum_s == pytest.approx(0.605)


def test_listen_addresses():
    assert parse_listen("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert parse_listen("[::1]:9464") == ("::1", 9464)
    assert parse_listen(":9464") == ("0.0.0.0", 9464)
    for bad in ("9464", "localhost:9464", "127.0.0.1:99999"):
        with pytest.raises(ConfigError, match=r"\[metrics\] listen: expected"):
            from_table(MetricsConfig, "metrics", {"listen": bad})
