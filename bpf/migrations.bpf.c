// SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause
/* migrations: accounts migrate_pages() outcomes per reason. NUMA-balancing promotions run in the
 * context of the task that took the hint fault (reason numa_misplaced), the daemon's move_pages() in
 * the daemon's (syscall_or_cpuset), demotion in kswapd's (demotion). */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "migrations.h"
#define TRACKING_FILTER_ONLY
#include "tracking.bpf.h"
#include "core_fixes.bpf.h"

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MIGRATE_REASONS_MAX);
	__type(key, __u32);
	__type(value, struct migrate_stat);
} migrations SEC(".maps");

SEC("tp/migrate/mm_migrate_pages")
int mm_migrate_pages(void *ctx)
{
	struct trace_event_raw_mm_migrate_pages___core *e = ctx;
	__u32 tgid = bpf_get_current_pid_tgid() >> 32;
	__u32 reason = read_migrate_reason(ctx);
	__u64 ok = e->succeeded;
	struct migrate_stat *s;

	stat_inc(STAT_EVENTS);
	if (reason >= MIGRATE_REASONS_MAX)
		reason = MIGRATE_REASONS_MAX - 1;
	s = bpf_map_lookup_elem(&migrations, &reason);
	if (!s)
		return 0;
	__sync_fetch_and_add(&s->calls, 1);
	__sync_fetch_and_add(&s->succeeded, ok);
	__sync_fetch_and_add(&s->failed, e->failed);
	__sync_fetch_and_add(&s->thp_succeeded, e->thp_succeeded);
	__sync_fetch_and_add(&s->thp_failed, e->thp_failed);
	if (bpf_map_lookup_elem(&tracked_pids, &tgid)) {
		__sync_fetch_and_add(&s->tracked_calls, 1);
		__sync_fetch_and_add(&s->tracked_succeeded, ok);
	}
	return 0;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
