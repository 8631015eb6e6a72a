# SPDX-License-Identifier: Apache-2.0
"""[pool]: every key changes what the pool agent does against a real etcd cluster on loopback, so
each probe is a host test (tests/host/test_pool_etcd.py, marked ``etcd``: ``make test`` runs it, and
fails it where etcd is missing)."""
from __future__ import annotations

from keyprobe import host_probe

HOST = "tests/host/test_pool_etcd.py"

host_probe("pool", "endpoints", HOST, "test_two_hosts_claim_disjoint_extents_of_one_pool",
           "set: the daemon joins the pool through those etcd members and its log writes only the "
           "extents it claimed there")
host_probe("pool", "host", HOST, "test_two_hosts_claim_disjoint_extents_of_one_pool",
           "every key the agent writes is named by it (hosts/<host>, claims/<extent>/<host>)")
host_probe("pool", "device", HOST, "test_a_device_that_is_not_the_pools_memory_is_refused",
           "another file (blank, or a copy of the pool's) is refused: no claim is made through it")
host_probe("pool", "prefix", HOST, "test_two_prefixes_are_two_pools_in_one_etcd",
           "two prefixes in one etcd: two pools, neither sees the other's keys")
host_probe("pool", "extent_bytes", HOST, "test_the_first_host_sets_the_extent_size",
           "the first host's extent size is the pool's and its log's segment size; a later host "
           "follows the pool's")
host_probe("pool", "lease_ttl_s", "tests/host/test_pool_faults.py",
           "test_a_host_process_killed_with_sigkill_frees_its_extents_after_the_lease_and_another_claims_them",
           "a host killed with SIGKILL keeps its claims until its lease's TTL has run out, then they "
           "are free for the other host")
host_probe("pool", "min_bytes", HOST, "test_min_bytes_is_held_by_an_idle_host_and_kept_from_others",
           "an idle host holds min_bytes' worth of extents, and a growing host leaves them to it")
host_probe("pool", "max_bytes", HOST, "test_max_bytes_caps_a_growing_host",
           "a host whose demand keeps growing stops claiming at max_bytes' worth")
host_probe("pool", "weight", HOST, "test_weight_sets_a_hosts_share_when_the_pool_runs_short",
           "when the pool runs short, a host claims up to its weighted share of the pool")
