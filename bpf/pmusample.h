/* SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause */
/* pmusample: data-address samples from a perf event (Intel PEBS load latency / mem_load_retired.*,
 * AMD IBS op; in tests the software page-fault event), counted per (tgid, block). Shares
 * bpf/tracking.h; block_val.extra is the sample period summed (the accesses one sample stands for),
 * sample_event.len the sample period. */
#ifndef __TIERINGD_PMUSAMPLE_H
#define __TIERINGD_PMUSAMPLE_H

#endif /* __TIERINGD_PMUSAMPLE_H */
