/* SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause */
/* Kernel differences, spelled as CO-RE flavours: libbpf matches "name___suffix" against the kernel's
 * "name" and relocates every field access, and bpf_core_type_exists() picks the branch at load time.
 * No version macros: one object loads on 6.1, 6.12, 6.18 and 7.3. */
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
 * field relocations absorb that). Up to 6.18 `reason` is an `int`; Debian's 7.3 (7.3.4+deb13) types it
 * `enum migrate_reason` (TP_PROTO and TP_STRUCT__entry of mm_migrate_pages and mm_migrate_pages_start
 * take the enum, as in the linux-mm tree's include/trace/events/migrate.h, which also adds MR_NEVER
 * "never_migrated" to the printed reasons; the upstream commit could not be identified here). libbpf
 * matches a field only when the types are compatible, and an int is not an enum
 * (bpf_core_fields_are_compat()), so one `int reason` declaration fails to load on 7.3 with "failed to
 * resolve CO-RE relocation ... reason". Hence two flavours, picked by bpf_core_field_exists(); the
 * other fields have the same types everywhere. Only the fields read here are declared. */
struct trace_event_raw_mm_migrate_pages___core {
	unsigned long succeeded;
	unsigned long failed;
	unsigned long thp_succeeded;
	unsigned long thp_failed;
} __attribute__((preserve_access_index));

struct trace_event_raw_mm_migrate_pages___old {		/* ≤ 6.18: int reason */
	int reason;
} __attribute__((preserve_access_index));

struct trace_event_raw_mm_migrate_pages___new {		/* 7.x: enum migrate_reason reason */
	enum migrate_reason reason;
} __attribute__((preserve_access_index));

/* enum migrate_reason's value for this record (MR_* as numbered by the running kernel). Read through
 * BPF_CORE_READ for the same reason as read_fault_tp(): two direct ctx loads in two branches get
 * merged into ctx pointer arithmetic. */
static __always_inline __u32 read_migrate_reason(void *ctx)
{
	if (bpf_core_field_exists(((struct trace_event_raw_mm_migrate_pages___new *)0)->reason))
		return BPF_CORE_READ((struct trace_event_raw_mm_migrate_pages___new *)ctx, reason);
	return BPF_CORE_READ((struct trace_event_raw_mm_migrate_pages___old *)ctx, reason);
}

#endif /* __TIERINGD_CORE_FIXES_BPF_H */
