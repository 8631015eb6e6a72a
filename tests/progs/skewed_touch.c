// SPDX-License-Identifier: Apache-2.0
// A workload that touches a known set of blocks at known, skewed rates, for the sampler tests.
//
//   skewed_touch [--blocks N] [--block-size BYTES] [--touches T] [--mode fault|read] [--seconds S]
//                [--wait] [--thp] [--repeat] [--idle-thread] [--node N --place move|bind]
//
// One anonymous mapping of N blocks. Block i gets weight[perm[i]] of the touches, weight[k] = T/(k+1)
// (Zipf, s = 1), perm a fixed shuffle so that the hot blocks are not simply the first ones.
//   --mode fault  each touch drops one page (MADV_DONTNEED) and writes it again: exactly one page
//                 fault per touch, so fault and PMU (software page-fault event) samplers can be
//                 checked against exact numbers. Touches are interleaved over the blocks. With
//                 --repeat the whole pattern repeats until --seconds have passed.
//   --mode read   the mapping is populated once; then for S seconds each block is read at its
//                 weight's rate (per round: weight[perm[i]] pages) — no faults but NUMA hint faults
//                 and accessed bits.
//   --node N --place move   populate, then move_pages(2) the mapping to node N (default policy stays,
//                           so NUMA balancing scans it and would migrate it back if it chose to)
//   --node N --place bind   mbind(MPOL_BIND | MPOL_F_NUMA_BALANCING) to node N before populating:
//                           scanned by NUMA balancing, never migrated while the task runs elsewhere
//   --idle-thread           start a thread that only sleeps: the process is then multi-threaded like a
//                           server, and NUMA balancing also scans its pages on the node it runs on
//                           (change_pte_range() skips those of single-threaded processes)
// Prints one JSON line before touching ({"pid", "base", "block_size", "blocks", "touches": [...]}),
// then with --wait reads a line from stdin before starting, and prints {"done": ..., "rounds": R}.
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MPOL_BIND		2
#define MPOL_F_NUMA_BALANCING	(1 << 13)	/* v5.12+, MPOL_BIND only */
#define MPOL_MF_MOVE		(1 << 1)

static int place(char *base, size_t len, long pagesz, int node, int bind)
{
	unsigned long mask = 1UL << node;

	if (bind)
		return syscall(SYS_mbind, base, len, MPOL_BIND | MPOL_F_NUMA_BALANCING, &mask,
			       sizeof(mask) * 8, MPOL_MF_MOVE);
	long n = len / pagesz;
	void **pages = calloc(n, sizeof(void *));
	int *nodes = calloc(n, sizeof(int)), *status = calloc(n, sizeof(int));
	for (long i = 0; i < n; i++) {
		pages[i] = base + i * pagesz;
		nodes[i] = node;
	}
	long rc = syscall(SYS_move_pages, 0, n, pages, nodes, status, MPOL_MF_MOVE);
	free(pages), free(nodes), free(status);
	return rc;
}

static void *idle(void *arg)
{
	(void)arg;
	for (;;)
		pause();
	return NULL;
}

static double now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(int argc, char **argv)
{
	long nblocks = 16, block_size = 64 * 1024, touches = 4096, pagesz = sysconf(_SC_PAGESIZE);
	double seconds = 10;
	int wait = 0, thp = 0, mode_read = 0, node = -1, bind = 0, repeat = 0, idle_thread = 0;

	for (int i = 1; i < argc; i++) {
		const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;

		if (!strcmp(a, "--blocks") && v) nblocks = atol(v), i++;
		else if (!strcmp(a, "--block-size") && v) block_size = atol(v), i++;
		else if (!strcmp(a, "--touches") && v) touches = atol(v), i++;
		else if (!strcmp(a, "--seconds") && v) seconds = atof(v), i++;
		else if (!strcmp(a, "--mode") && v) mode_read = !strcmp(v, "read"), i++;
		else if (!strcmp(a, "--wait")) wait = 1;
		else if (!strcmp(a, "--thp")) thp = 1;
		else if (!strcmp(a, "--repeat")) repeat = 1;
		else if (!strcmp(a, "--idle-thread")) idle_thread = 1;
		else if (!strcmp(a, "--node") && v) node = atoi(v), i++;
		else if (!strcmp(a, "--place") && v) bind = !strcmp(v, "bind"), i++;
		else {
			fprintf(stderr, "usage: %s [--blocks N] [--block-size B] [--touches T] "
				"[--mode fault|read] [--seconds S] [--wait] [--thp] [--repeat] [--idle-thread] "
				"[--node N --place move|bind]\n", argv[0]);
			return 2;
		}
	}
	if (nblocks < 1 || nblocks > 4096 || block_size < pagesz || block_size % pagesz) {
		fprintf(stderr, "skewed_touch: bad --blocks/--block-size\n");
		return 2;
	}

	pthread_t tid;
	if (idle_thread && pthread_create(&tid, NULL, idle, NULL)) {
		fprintf(stderr, "skewed_touch: pthread_create failed\n");
		return 1;
	}
	size_t len = (size_t)nblocks * block_size;
	size_t align = thp ? 2 << 20 : pagesz;
	char *raw = mmap(NULL, len + align, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (raw == MAP_FAILED) {
		perror("mmap");
		return 1;
	}
	char *base = (char *)(((uintptr_t)raw + align - 1) & ~(uintptr_t)(align - 1));
	if (thp && madvise(base, len, MADV_HUGEPAGE))
		perror("madvise(MADV_HUGEPAGE)");
	if (node >= 0 && bind && place(base, len, pagesz, node, 1)) {
		perror("mbind");
		return 1;
	}
	memset(base, 1, len);	/* populate: later faults are the ones we cause */
	if (node >= 0 && !bind && place(base, len, pagesz, node, 0) < 0) {
		perror("move_pages");
		return 1;
	}

	long *perm = calloc(nblocks, sizeof(long)), *weight = calloc(nblocks, sizeof(long));
	for (long i = 0; i < nblocks; i++)
		perm[i] = i;
	unsigned long long seed = 0x9e3779b97f4a7c15ULL;
	for (long i = nblocks - 1; i > 0; i--) {	/* fixed Fisher–Yates shuffle */
		seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
		long j = (long)((seed >> 33) % (unsigned long long)(i + 1)), t = perm[i];
		perm[i] = perm[j];
		perm[j] = t;
	}
	for (long i = 0; i < nblocks; i++) {
		weight[i] = touches / (perm[i] + 1);
		if (weight[i] < 1)
			weight[i] = 1;
	}

	printf("{\"pid\": %d, \"base\": %lu, \"block_size\": %ld, \"blocks\": %ld, \"mode\": \"%s\", "
	       "\"touches\": [", getpid(), (unsigned long)base, block_size, nblocks,
	       mode_read ? "read" : "fault");
	for (long i = 0; i < nblocks; i++)
		printf("%s%ld", i ? ", " : "", weight[i]);
	printf("]}\n");
	fflush(stdout);
	if (wait) {
		char line[64];
		if (!fgets(line, sizeof(line), stdin))
			return 0;
	}

	long pages_per_block = block_size / pagesz, rounds = 0;
	volatile char *vb = base;
	unsigned long sum = 0;

	long passes = 0;

	if (!mode_read) {
		double end = now_s() + seconds;
	again:;
		/* interleave: round r touches every block whose weight exceeds r */
		long left = 1;
		for (long r = 0; left; r++) {
			left = 0;
			for (long i = 0; i < nblocks; i++) {
				if (weight[i] <= r)
					continue;
				left = 1;
				char *p = base + i * block_size + (r % pages_per_block) * pagesz;
				madvise(p, pagesz, MADV_DONTNEED);
				*(volatile char *)p = (char)r;
			}
			rounds++;
		}
		passes++;
		if (repeat && now_s() < end)
			goto again;
	} else {
		double end = now_s() + seconds;
		while (now_s() < end) {
			for (long i = 0; i < nblocks; i++)
				for (long k = 0; k < weight[i]; k++)
					sum += vb[i * block_size + ((rounds + k) % pages_per_block) * pagesz];
			rounds++;
		}
	}
	printf("{\"done\": true, \"rounds\": %ld, \"passes\": %ld, \"sum\": %lu}\n", rounds, passes,
	       sum);
	fflush(stdout);
	if (wait) {	/* stay alive until told, so the test can still read this pid's counts */
		char line[64];
		if (!fgets(line, sizeof(line), stdin))
			return 0;
	}
	return 0;
}
