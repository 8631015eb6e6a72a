// LDLIBS: -Lbuild/tests -lfakecudart
// SPDX-License-Identifier: Apache-2.0
// A GPU server's pinned KV pools, against the fake CUDA runtime (tests/progs/libfakecudart.c):
// a 64 MiB pool from cudaHostAlloc, a 32 MiB malloc()ed buffer pinned with cudaHostRegister, a
// 1 MiB one (below the shim's threshold) pinned too, copies between them, then unpin and free.
// With "wait", it prints "pinned" once everything is pinned and waits for a line on stdin.
// Run with LD_LIBRARY_PATH=build/tests.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int cudaError_t;
cudaError_t cudaHostAlloc(void **ptr, size_t size, unsigned int flags);
cudaError_t cudaFreeHost(void *ptr);
cudaError_t cudaHostRegister(void *ptr, size_t size, unsigned int flags);
cudaError_t cudaHostUnregister(void *ptr);
cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, int kind);

#define POOL (64u << 20)
#define BUF (32u << 20)
#define SMALL (1u << 20)

static uint64_t sum(const unsigned char *p, size_t n)
{
	uint64_t s = 0;
	for (size_t i = 0; i < n; i += 512)
		s = s * 1099511628211ULL + p[i];
	return s;
}

int main(int argc, char **argv)
{
	int wait = argc > 1 && strcmp(argv[1], "wait") == 0;
	void *pool;
	if (cudaHostAlloc(&pool, POOL, 1 /* portable */) != 0) {
		fprintf(stderr, "cudaHostAlloc failed\n");
		return 1;
	}
	unsigned char *buf = malloc(BUF), *small = malloc(SMALL);
	for (size_t i = 0; i < BUF; i++)
		buf[i] = (unsigned char)(i * 7 + 3);
	memset(small, 0x11, SMALL);
	int rc = cudaHostRegister(buf, BUF, 0) | cudaHostRegister(small, SMALL, 0);
	rc |= cudaMemcpy(pool, buf, BUF, 1) | cudaMemcpy((char *)pool + BUF, small, SMALL, 1);
	printf("register %d pool %016llx small %016llx\n", rc, (unsigned long long)sum(pool, BUF),
	       (unsigned long long)sum((unsigned char *)pool + BUF, SMALL));
	fflush(stdout);
	if (wait) {
		char line[16];
		printf("pinned\n");
		fflush(stdout);
		if (!fgets(line, sizeof line, stdin))
			return 1;
	}
	rc = cudaHostUnregister(buf) | cudaHostUnregister(small) | cudaFreeHost(pool);
	free(buf);
	free(small);
	printf("unregister %d\n", rc);
	return rc;
}
