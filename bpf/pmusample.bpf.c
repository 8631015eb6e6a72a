// SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause
/* pmusample: a perf_event program, attached by the loader to one event per CPU opened with
 * PERF_SAMPLE_ADDR. The kernel fills bpf_perf_event_data.addr with the sample's data address (PEBS
 * data linear address, IBS DC linear address, the faulting address for software page-fault events),
 * so the same program serves bare-metal PMUs and VMs without one. */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_tracing.h>
#include "pmusample.h"
#include "tracking.bpf.h"

SEC("perf_event")
int pmu_sample(struct bpf_perf_event_data *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u64 addr = ctx->addr, period = ctx->sample_period;
	struct block_key key;
	__u64 block_len, now;

	stat_inc(STAT_EVENTS);
	if (!addr) {
		stat_inc(STAT_NO_ADDR);
		return 0;
	}
	if (!tracked_block(pid_tgid >> 32, addr, &key, &block_len))
		return 0;
	now = bpf_ktime_get_ns();
	count_block(&key, block_len, now, period);
	emit_raw(now, pid_tgid, addr, PT_REGS_IP(&ctx->regs), period, 0, 0);
	return 0;	/* 0: the kernel does not also write the sample to a perf buffer */
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
