/* SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause */
/* pagefault: user page faults of tracked processes (first touch, NUMA-balancing hint faults, COW),
 * counted per (tgid, block). Shares bpf/tracking.h; block_val.extra holds two counts (below):
 * protection faults (present PTE: COW, write-protect — not NUMA hint faults, whose PROT_NONE PTEs
 * the MMU sees as not present) and write faults (PF_ERR_WRITE: a first touch by a write, a hint
 * fault taken by a write, COW). sample_event.kind is the x86 error code and sample_event.aux is 1
 * for faults taken in kernel mode on a user address. */
/* tieringd/sampling/pagefault.py copies every #define below; tests/unit/test_sampling_headers.py
 * compiles this header and compares. */
#ifndef __TIERINGD_PAGEFAULT_H
#define __TIERINGD_PAGEFAULT_H

/* x86 page-fault error code bits (arch/x86/include/asm/trap_pf.h) */
#define PF_ERR_PROT	0x1	/* the PTE was present: protection fault (COW, write-protect) */
#define PF_ERR_WRITE	0x2
#define PF_ERR_USER	0x4
#define PF_ERR_INSTR	0x10

/* block_val.extra: protection faults in the low half, write faults in the high half. One atomic add
 * counts both; a half cannot carry into the other below 2^32 faults per block and interval. */
#define PF_EXTRA_PROT_MASK	0xffffffff
#define PF_EXTRA_WRITE_SHIFT	32

#endif /* __TIERINGD_PAGEFAULT_H */
