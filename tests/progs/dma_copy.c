// LDLIBS: -Lbuild/tests -lfakecudart -Wl,-rpath,'$ORIGIN'
// SPDX-License-Identifier: Apache-2.0
// An unmodified "server" for the DMA-copy sampler test: it calls the CUDA copy APIs of whatever
// libcudart it was linked with (here build/tests/libfakecudart.so) on host buffers it allocated
// itself, and prints the pointers it passed, so the test can compare them with what the uprobes saw.
//
//   dma_copy [--copies N] [--size BYTES] [--wait]
//
// Prints {"pid", "base", "len", "block_size"} first; with --wait reads a line before copying; then
// one JSON line per call {"api", "host", "len"}; then {"done": true}.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int cudaError_t;
typedef unsigned long long CUdeviceptr;
cudaError_t cudaMallocHost(void **ptr, size_t size);
cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, int kind);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, int kind, void *stream);
int cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t count);
int cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t count, void *stream);

enum { cudaMemcpyHostToDevice = 1, cudaMemcpyDeviceToHost = 2 };

int main(int argc, char **argv)
{
	long copies = 8, size = 16 * 1024, block = 64 * 1024, nblocks = 16;
	int wait = 0;

	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--copies") && i + 1 < argc) copies = atol(argv[++i]);
		else if (!strcmp(argv[i], "--size") && i + 1 < argc) size = atol(argv[++i]);
		else if (!strcmp(argv[i], "--wait")) wait = 1;
		else {
			fprintf(stderr, "usage: %s [--copies N] [--size BYTES] [--wait]\n", argv[0]);
			return 2;
		}
	}
	if (size < 1 || size > block) {
		fprintf(stderr, "dma_copy: --size must be in [1, %ld]\n", block);
		return 2;
	}
	char *host, *dev = malloc(block);	/* the "device" buffer: plain memory in the fake */
	if (cudaMallocHost((void **)&host, block * nblocks) || !dev)
		return 1;
	memset(host, 7, block * nblocks);
	printf("{\"pid\": %d, \"base\": %lu, \"len\": %ld, \"block_size\": %ld}\n", getpid(),
	       (unsigned long)host, block * nblocks, block);
	fflush(stdout);
	if (wait) {
		char line[64];
		if (!fgets(line, sizeof(line), stdin))
			return 0;
	}
	for (long i = 0; i < copies; i++) {
		/* odd offsets, so the test checks exact pointers, not block starts */
		char *p = host + ((i * 5) % nblocks) * block + 64 * (i + 1);
		long n = size - 64 * (i + 1) > 0 ? size - 64 * (i + 1) : 1;
		const char *api;

		switch (i % 4) {
		case 0: cudaMemcpyAsync(dev, p, n, cudaMemcpyHostToDevice, NULL); api = "cudaMemcpyAsync"; break;
		case 1: cudaMemcpy(dev, p, n, cudaMemcpyHostToDevice); api = "cudaMemcpy"; break;
		case 2: cuMemcpyHtoDAsync_v2((CUdeviceptr)(unsigned long)dev, p, n, NULL); api = "cuMemcpyHtoDAsync_v2"; break;
		default: cudaMemcpyAsync(p, dev, n, cudaMemcpyDeviceToHost, NULL); api = "cudaMemcpyAsync"; break;
		}
		printf("{\"api\": \"%s\", \"host\": %lu, \"len\": %ld, \"dir\": \"%s\"}\n", api,
		       (unsigned long)p, n, i % 4 == 3 ? "write" : "read");
	}
	printf("{\"done\": true}\n");
	fflush(stdout);
	if (wait) {
		char line[64];
		if (!fgets(line, sizeof(line), stdin))
			return 0;
	}
	return 0;
}
