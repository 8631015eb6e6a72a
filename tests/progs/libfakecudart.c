// SPDX-License-Identifier: Apache-2.0
// A stand-in for the CUDA runtime/driver entry points that KV-offloading servers call on host memory,
// so the shim's pinned-memory handling and the DMA-copy uprobes can be tested without CUDA or a GPU.
// Signatures follow the CUDA headers closely enough for the ABI (pointers, size_t, int enums).
// Copies are real memcpy()s, so a program's output proves the calls happened.
#include <stdlib.h>
#include <string.h>

typedef int cudaError_t;        /* 0 == cudaSuccess */
typedef void *cudaStream_t;
typedef unsigned long long CUdeviceptr;
typedef int CUresult;

cudaError_t cudaHostRegister(void *ptr, size_t size, unsigned int flags)
{ (void)ptr; (void)size; (void)flags; return 0; }

cudaError_t cudaHostUnregister(void *ptr) { (void)ptr; return 0; }

cudaError_t cudaHostAlloc(void **ptr, size_t size, unsigned int flags)
{
	(void)flags;
	*ptr = malloc(size);
	return *ptr ? 0 : 2; /* cudaErrorMemoryAllocation */
}

cudaError_t cudaMallocHost(void **ptr, size_t size) { return cudaHostAlloc(ptr, size, 0); }

cudaError_t cudaFreeHost(void *ptr) { free(ptr); return 0; }

cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, int kind)
{ (void)kind; memcpy(dst, src, count); return 0; }

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, int kind, cudaStream_t stream)
{ (void)kind; (void)stream; memcpy(dst, src, count); return 0; }

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t count)
{ memcpy((void *)(unsigned long)dst, src, count); return 0; }

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t count, void *stream)
{ (void)stream; memcpy((void *)(unsigned long)dst, src, count); return 0; }
