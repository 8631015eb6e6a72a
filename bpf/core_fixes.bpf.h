/* SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause */
/* Kernel differences, spelled as CO-RE flavours: libbpf matches "name___suffix" against the kernel's
 * "name" and relocates every field access, and bpf_core_type_exists() picks the branch at load time.
 * No version macros: one object loads on 6.1, 6.12 and 6.18. */
#ifndef __TIERINGD_CORE_FIXES_BPF_H
#define __TIERINGD_CORE_FIXES_BPF_H

#include <bpf/bpf_core_read.h>

/* exceptions:page_fault_user / page_fault_kernel.
 * Up to v6.15 the event class lived in arch/x86/include/asm/trace/exceptions.h as "x86_exceptions",
 * so its record is struct trace_event_raw_x86_exceptions (6.1, 6.12). Commit 06aa9378df01
 * ("x86/tracing, x86/mm: Move page fault tracepoints to generic", Nam Cao, merged for v6.16) moved it
 * to include/trace/events/exceptions.h as class "exceptions": struct trace_event_raw_exceptions (6.18).
 * The tracepoint names and the field layout stayed the same. */
struct trace_event_raw_exceptions___generic {
	unsigned long address;
	unsigned long ip;
	unsigned long error_code;
} __attribute__((preserve_access_index));

struct trace_event_raw_x86_exceptions___x86 {
	unsigned long address;
	unsigned long ip;
	unsigned long error_code;
} __attribute__((preserve_access_index));

/* Read through bpf_core_read(): with two direct ctx loads clang merges the branches into pointer
 * arithmetic on ctx, which the verifier refuses ("dereference of modified ctx ptr"). */
static __always_inline void read_fault_tp(void *ctx, __u64 *address, __u64 *ip, __u64 *error_code)
{
	if (bpf_core_type_exists(struct trace_event_raw_exceptions___generic)) {
		struct trace_event_raw_exceptions___generic *e = ctx;

		*address = BPF_CORE_READ(e, address);
		*ip = BPF_CORE_READ(e, ip);
		*error_code = BPF_CORE_READ(e, error_code);
	} else {
		struct trace_event_raw_x86_exceptions___x86 *e = ctx;

		*address = BPF_CORE_READ(e, address);
		*ip = BPF_CORE_READ(e, ip);
		*error_code = BPF_CORE_READ(e, error_code);
	}
}

/* migrate:mm_migrate_pages. v6.1 records succeeded, failed, thp_succeeded, thp_failed, thp_split,
 * mode, reason; later kernels insert large_folio_split before mode (so mode/reason move: the CO-RE
 * field relocations below absorb that). Only the fields read here are declared. */
struct trace_event_raw_mm_migrate_pages___core {
	unsigned long succeeded;
	unsigned long failed;
	unsigned long thp_succeeded;
	unsigned long thp_failed;
	int reason;
} __attribute__((preserve_access_index));

#endif /* __TIERINGD_CORE_FIXES_BPF_H */
