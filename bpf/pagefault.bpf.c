// SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause
/* pagefault: counts the page faults of tracked processes per (tgid, block).
 *
 * On machines without a data-address PMU (VMs) this is the access signal: NUMA-balancing scanning
 * (kernel.numa_balancing) turns PTEs PROT_NONE so that the next access to an already-populated page
 * faults again — a "hint fault" — and these tracepoints see it like any other user fault. The MMU
 * sees a PROT_NONE PTE as not present, so a hint fault's error code looks like a first touch (no
 * PF_PROT): on memory that is already populated, every fault is a hint fault (or swap-in).
 *
 * Page size: one hint fault on a PMD-mapped THP unprotects 512 base pages, one on a 4 KiB page one.
 * The tracepoint does not say which it was (its record is address, ip and error_code, 6.1 to 7.3, and
 * the error code of a PMD hint fault equals a PTE one), so user space tells it afterwards, per 2 MiB
 * chunk, from pagemap and kpageflags (tieringd/sampling/pagefault.py). For that a block is counted per
 * piece: its part within one 2 MiB-aligned chunk. A block inside one chunk is one piece.
 *
 * Writes: every fault's error code says whether a write took it (PF_ERR_WRITE), a hint fault's as
 * well as a first touch's, so each piece also counts its write faults (pagefault.h, in extra's high
 * half): where a region is written, per interval, is its decode frontier when it holds one
 * sequence's KV in token order (tieringd/daemon/position.py). */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "pagefault.h"
#include "tracking.bpf.h"
#include "core_fixes.bpf.h"

/* x86-64's PMD size (tieringd.kernel.procfs.HPAGE_PMD_SIZE); the same with 4- and 5-level paging. */
#define PMD_CHUNK_SIZE	(1ULL << 21)

/* Narrows the block [block_start, +block_len) to its piece within addr's 2 MiB-aligned chunk. */
static __always_inline void clip_to_chunk(struct block_key *key, __u64 *block_len, __u64 addr)
{
	__u64 lo = addr & ~(PMD_CHUNK_SIZE - 1), hi = lo + PMD_CHUNK_SIZE;
	__u64 end = key->block_start + *block_len;

	if (key->block_start < lo)
		key->block_start = lo;
	if (end > hi)
		end = hi;
	*block_len = end - key->block_start;
}

static __always_inline int handle_fault(__u64 addr, __u64 ip, __u64 error_code, __u32 in_kernel)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	struct block_key key;
	__u64 block_len, now;
	bool prot = error_code & PF_ERR_PROT, write = error_code & PF_ERR_WRITE;

	stat_inc(STAT_EVENTS);
	if (!tracked_block(pid_tgid >> 32, addr, &key, &block_len))
		return 0;
	clip_to_chunk(&key, &block_len, addr);
	now = bpf_ktime_get_ns();
	/* the write count tells user space where a region is being written (its decode frontier) */
	count_block(&key, block_len, now, (prot ? 1ULL : 0) | (write ? 1ULL << PF_EXTRA_WRITE_SHIFT : 0));
	emit_raw(now, pid_tgid, addr, ip, 0, (__u32)error_code, in_kernel);
	return 0;
}

SEC("tp/exceptions/page_fault_user")
int page_fault_user(void *ctx)
{
	__u64 addr, ip, error_code;

	read_fault_tp(ctx, &addr, &ip, &error_code);
	return handle_fault(addr, ip, error_code, 0);
}

/* Faults the kernel takes on user memory on a task's behalf (copy_to_user into a hint-faulting page). */
SEC("tp/exceptions/page_fault_kernel")
int page_fault_kernel(void *ctx)
{
	__u64 addr, ip, error_code;

	read_fault_tp(ctx, &addr, &ip, &error_code);
	if (addr >= USER_ADDR_END)
		return 0;
	return handle_fault(addr, ip, error_code, 1);
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
