// SPDX-License-Identifier: Apache-2.0
// membench: the measuring loops behind `tieringctl probe`, loaded through ctypes
// (tieringd/cli/probe.py). Python cannot time a dependent load or stream memory at full speed, so
// the loops are here; the policy (which node, which CPUs, how big) stays in Python.
//
//   mb_alloc      anonymous buffer bound to one node with mbind(MPOL_BIND, MPOL_MF_STRICT), faulted in
//   mb_on_node    how many sampled pages really sit on that node (move_pages with nodes == NULL)
//   mb_read_bw    streaming read bandwidth, N threads pinned to the given CPUs, best of `iters`
//   mb_chase      dependent pointer chase over a random cyclic permutation of cache lines: ns/load
//
// mbind/move_pages are called through syscall(2) so that no libnuma is needed.
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MPOL_BIND 2
#define MPOL_MF_STRICT (1 << 0)
#define MASK_BITS 4096           /* CONFIG_NODES_SHIFT is at most 10: 1024 nodes */
#define LINE 64

void *volatile mb_keep;

static double now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e9 + ts.tv_nsec;
}

// Returns the buffer, or NULL with errno set (EINVAL: no such node, ENOMEM: node full, EIO: the
// strict bind could not be honoured).
void *mb_alloc(size_t len, int node)
{
	unsigned long mask[MASK_BITS / (8 * sizeof(unsigned long))];
	const size_t bits = 8 * sizeof(unsigned long);
	long page = sysconf(_SC_PAGESIZE);
	void *buf;

	if (node < 0 || node >= MASK_BITS) {
		errno = EINVAL;
		return NULL;
	}
	buf = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (buf == MAP_FAILED)
		return NULL;
	madvise(buf, len, MADV_HUGEPAGE);    /* fewer TLB misses in the chase; a hint only */
	memset(mask, 0, sizeof(mask));
	mask[node / bits] |= 1UL << (node % bits);
	if (syscall(SYS_mbind, buf, len, MPOL_BIND, mask, MASK_BITS + 1, MPOL_MF_STRICT)) {
		int e = errno;
		munmap(buf, len);
		errno = e;
		return NULL;
	}
	for (size_t off = 0; off < len; off += page)   /* fault every page in, on `node` */
		((volatile char *)buf)[off] = 1;
	return buf;
}

void mb_free(void *buf, size_t len)
{
	munmap(buf, len);
}

// Pages among `samples` evenly spread ones that are on `node`; -1 with errno on failure.
long mb_on_node(void *buf, size_t len, int node, size_t samples)
{
	long page = sysconf(_SC_PAGESIZE);
	size_t npages = len / page, n = samples < npages ? samples : npages;
	void **pages = calloc(n, sizeof(void *));
	int *status = calloc(n, sizeof(int));
	long on = 0;

	if (!pages || !status) {
		free(pages);
		free(status);
		errno = ENOMEM;
		return -1;
	}
	for (size_t i = 0; i < n; i++)
		pages[i] = (char *)buf + (i * (npages / n)) * page;
	if (syscall(SYS_move_pages, 0, n, pages, NULL, status, 0)) {
		int e = errno;
		free(pages);
		free(status);
		errno = e;
		return -1;
	}
	for (size_t i = 0; i < n; i++)
		on += status[i] == node;
	free(pages);
	free(status);
	return on;
}

struct reader {
	const uint64_t *p;
	size_t words;
	int cpu;
	pthread_barrier_t *start;
	uint64_t sum;
	double t0, t1;              /* this thread's own clock: the caller may be descheduled */
};

static void *read_slice(void *arg)
{
	struct reader *r = arg;
	uint64_t a = 0, b = 0, c = 0, d = 0;

	if (r->cpu >= 0) {
		cpu_set_t set;
		CPU_ZERO(&set);
		CPU_SET(r->cpu, &set);
		pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
	}
	pthread_barrier_wait(r->start);
	r->t0 = now_ns();
	for (size_t i = 0; i + 4 <= r->words; i += 4) {
		a += r->p[i];
		b += r->p[i + 1];
		c += r->p[i + 2];
		d += r->p[i + 3];
	}
	r->sum = a + b + c + d;
	r->t1 = now_ns();
	return NULL;
}

// Best of `iters` passes over the buffer by `nthreads` threads (thread i pinned to cpus[i], or not
// pinned when cpus is NULL): bytes per nanosecond, i.e. GB/s. Returns a negative value on failure.
double mb_read_bw(void *buf, size_t len, int iters, int nthreads, const int *cpus)
{
	static volatile uint64_t sink;
	double best = 0;

	if (nthreads < 1 || nthreads > 1024)
		return -1;
	pthread_t *tid = calloc(nthreads, sizeof(*tid));
	struct reader *rd = calloc(nthreads, sizeof(*rd));
	if (!tid || !rd) {
		free(tid);
		free(rd);
		return -1;
	}
	size_t words = len / sizeof(uint64_t), per = words / nthreads;
	for (int it = 0; it < iters; it++) {
		pthread_barrier_t start;
		pthread_barrier_init(&start, NULL, nthreads + 1);
		for (int t = 0; t < nthreads; t++) {
			rd[t] = (struct reader){ (const uint64_t *)buf + t * per, per, cpus ? cpus[t] : -1,
						 &start, 0, 0, 0 };
			pthread_create(&tid[t], NULL, read_slice, &rd[t]);
		}
		pthread_barrier_wait(&start);
		double t0 = 0, t1 = 0;
		for (int t = 0; t < nthreads; t++) {
			pthread_join(tid[t], NULL);
			sink += rd[t].sum;
			if (t == 0 || rd[t].t0 < t0)
				t0 = rd[t].t0;
			if (rd[t].t1 > t1)
				t1 = rd[t].t1;
		}
		double gbs = (double)(per * nthreads * sizeof(uint64_t)) / (t1 - t0);
		pthread_barrier_destroy(&start);
		if (gbs > best)
			best = gbs;
	}
	free(tid);
	free(rd);
	return best;
}

// Average latency of `steps` dependent loads over a random cycle through every cache line of the
// buffer (lines visited in a random order linked into one cycle: the prefetchers cannot guess).
double mb_chase(void *buf, size_t len, size_t steps, uint64_t seed)
{
	size_t n = len / LINE;
	uint32_t *order = malloc(n * sizeof(uint32_t));
	uint64_t x = seed | 1;

	if (!order || n < 2 || n > UINT32_MAX) {
		free(order);
		return -1;
	}
	for (size_t i = 0; i < n; i++)
		order[i] = i;
	for (size_t i = n - 1; i > 0; i--) {
		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;                      /* xorshift64 */
		size_t j = x % i;
		uint32_t t = order[i];
		order[i] = order[j];
		order[j] = t;
	}
	for (size_t i = 0; i < n; i++)
		*(void **)((char *)buf + (size_t)order[i] * LINE) =
			(char *)buf + (size_t)order[(i + 1) % n] * LINE;
	free(order);

	void *volatile *p = (void *volatile *)buf;
	for (size_t i = 0; i < n && i < steps; i++)   /* warm the TLB/page tables once */
		p = (void *volatile *)*p;
	double t0 = now_ns();
	for (size_t i = 0; i < steps; i++)
		p = (void *volatile *)*p;
	double ns = (now_ns() - t0) / steps;
	mb_keep = (void *)p;     /* the chase has a visible result: the compiler keeps it */
	return ns;
}
