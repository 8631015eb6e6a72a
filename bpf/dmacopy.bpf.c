// SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause
/* dmacopy: uprobes on the entry of the CUDA copy APIs. A GPU reading offloaded KV by DMA does no CPU
 * load, takes no fault and leaves no PMU sample; the host pointer handed to the copy API is the only
 * trace. The loader attaches these programs by symbol to every library a tracked process maps that
 * exports them (libcudart, libcuda, tests' libfakecudart); the in-kernel filter keeps tracked
 * processes and ranges only, which also drops device pointers (they are in no host range). */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_tracing.h>
#include "dmacopy.h"
#include "tracking.bpf.h"

/* Counts every block of [ptr, ptr + count) that is tracked; returns whether any was. */
static __always_inline bool count_copy(__u64 pid_tgid, __u64 ptr, __u64 count, __u64 now)
{
	__u64 end = ptr + count, cur = ptr, block_len;
	struct block_key key;
	bool any = false;
	int i;

	if (!count || end < ptr)
		return false;
	for (i = 0; i < DMA_MAX_BLOCKS; i++) {
		__u64 block_end, lo, hi;

		if (!tracked_block(pid_tgid >> 32, cur, &key, &block_len))
			return any;
		block_end = key.block_start + block_len;
		lo = cur;
		hi = end < block_end ? end : block_end;
		count_block(&key, block_len, now, hi - lo);
		any = true;
		if (block_end >= end)
			return true;
		cur = block_end;
	}
	stat_inc(STAT_TRUNCATED);
	return true;
}

static __always_inline int handle_copy(struct pt_regs *ctx, __u32 api, __u64 host_src,
				       __u64 host_dst, __u64 count)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u64 now;

	stat_inc(STAT_EVENTS);
	now = bpf_ktime_get_ns();
	/* Whichever side lies in a tracked host range is the host side: cudaMemcpyDefault (UVA) copies
	 * do not say, and device pointers never fall in a registered host range. */
	if (host_src && count_copy(pid_tgid, host_src, count, now))
		emit_raw(now, pid_tgid, host_src, PT_REGS_IP(ctx), count, api, DMA_DIR_READ);
	if (host_dst && count_copy(pid_tgid, host_dst, count, now))
		emit_raw(now, pid_tgid, host_dst, PT_REGS_IP(ctx), count, api, DMA_DIR_WRITE);
	return 0;
}

/* cudaMemcpy(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind)
 * cudaMemcpyAsync(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind, cudaStream_t) */
SEC("uprobe/cudaMemcpy")
int BPF_KPROBE(cuda_memcpy, void *dst, const void *src, size_t count)
{
	return handle_copy(ctx, DMA_API_CUDA_MEMCPY, (__u64)src, (__u64)dst, count);
}

/* cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t count), cuMemcpyHtoDAsync_v2(…, stream) */
SEC("uprobe/cuMemcpyHtoD")
int BPF_KPROBE(cu_memcpy_htod, __u64 dst, const void *src, size_t count)
{
	return handle_copy(ctx, DMA_API_CU_HTOD, (__u64)src, 0, count);
}

/* cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t count), cuMemcpyDtoHAsync_v2(…, stream) */
SEC("uprobe/cuMemcpyDtoH")
int BPF_KPROBE(cu_memcpy_dtoh, void *dst, __u64 src, size_t count)
{
	return handle_copy(ctx, DMA_API_CU_DTOH, 0, (__u64)dst, count);
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
