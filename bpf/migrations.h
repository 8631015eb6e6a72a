/* SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause */
/* migrations: page migrations the kernel reports in migrate:mm_migrate_pages, per migrate reason
 * (enum migrate_reason: compaction, syscall_or_cpuset, numa_misplaced, demotion, damon …), so the
 * daemon's own moves and the kernel's (NUMA-balancing promotion, demotion on reclaim) can be told
 * apart and compared with /proc/vmstat. Uses tracked_pids from bpf/tracking.h. */
#ifndef __TIERINGD_MIGRATIONS_H
#define __TIERINGD_MIGRATIONS_H

#define MIGRATE_REASONS_MAX	16	/* enum migrate_reason has 10 values on 6.18 */

struct migrate_stat {
	__u64 calls;			/* migrate_pages() calls that reported */
	__u64 succeeded;		/* base pages (and folios counted by the kernel as such) */
	__u64 failed;
	__u64 thp_succeeded;
	__u64 thp_failed;
	__u64 tracked_calls;		/* calls made in the context of a tracked process */
	__u64 tracked_succeeded;
	__u64 pad;
};

#endif /* __TIERINGD_MIGRATIONS_H */
