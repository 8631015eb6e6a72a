/* SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause */
/* dmacopy: host memory that DMA-copy APIs read or write (cudaMemcpy*, cuMemcpy*HtoD/DtoH*), seen by
 * uprobes on the API entry, counted per (tgid, block). Shares bpf/tracking.h; block_val.extra is the
 * bytes of the copy that fell in the block, sample_event.kind the API family (DMA_API_*),
 * sample_event.aux the direction (DMA_DIR_*), sample_event.addr the host pointer and .len the
 * copy size. */
/* tieringd/sampling/dmacopy.py copies every #define below; tests/unit/test_sampling_headers.py
 * compiles this header and compares. */
#ifndef __TIERINGD_DMACOPY_H
#define __TIERINGD_DMACOPY_H

/* The API families, one program each (arguments differ). */
#define DMA_API_CUDA_MEMCPY	1	/* cudaMemcpy(dst, src, count, kind), cudaMemcpyAsync(…, stream) */
#define DMA_API_CU_HTOD		2	/* cuMemcpyHtoD*(CUdeviceptr dst, const void *src, size_t count) */
#define DMA_API_CU_DTOH		3	/* cuMemcpyDtoH*(void *dst, CUdeviceptr src, size_t count) */

#define DMA_DIR_READ		1	/* host memory is the source (host → device: the GPU reads it) */
#define DMA_DIR_WRITE		2	/* host memory is the destination (device → host: offload) */

/* One probe walks at most this many blocks of a copy; longer copies count their first
 * DMA_MAX_BLOCKS blocks and bump STAT_TRUNCATED. */
#define DMA_MAX_BLOCKS		64

#endif /* __TIERINGD_DMACOPY_H */
