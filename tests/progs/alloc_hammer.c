// SPDX-License-Identifier: Apache-2.0
// A threaded allocator hammer for the shim (tests/host/test_shim.py): THREADS threads each run
// ITERS random steps over 32 slots — posix_memalign (alignment 16..4096), realloc (growing and
// shrinking across TIERINGD_MIN_BYTES both ways), free — with sizes from 16 B to 12 MiB. Every
// block carries a pattern derived from its key; each step checks the pattern of the block it
// touches, so lost or corrupted data shows. Meanwhile the main thread forks FORKS children that
// check an inherited 8 MiB buffer, allocate and free their own, and report over a pipe.
// Output is deterministic (per-thread checksums), so runs with and without the shim must match.
// Usage: alloc_hammer [THREADS ITERS FORKS [CHILD_LINGER_MS]] (children stay that long before
// exiting, so that a registry can see them).
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define SLOTS 32
#define BIG (8u << 20)

struct block {
	unsigned char *p;
	size_t size;
	unsigned key;
};

struct worker {
	int id;
	long iters;
	uint64_t checksum;
	long errors;
};

static unsigned rnd(unsigned *x)
{
	*x = *x * 1664525u + 1013904223u;
	return *x >> 8;
}

/* Pattern on sampled offsets: every byte of small blocks, one byte per 4 KiB page of big ones. */
static size_t step_for(size_t size)
{
	return size <= 65536 ? 1 : 4096;
}

static void put(struct block *b)
{
	size_t step = step_for(b->size);
	for (size_t off = 0; off < b->size; off += step)
		b->p[off] = (unsigned char)(b->key + off / step);
	b->p[b->size - 1] = (unsigned char)(b->key ^ 0x5a);
}

/* Checks the first `upto` bytes; returns a checksum of what was checked, counts mismatches. */
static uint64_t check(const struct block *b, size_t upto, long *errors)
{
	size_t step = step_for(b->size);
	uint64_t sum = 0;
	for (size_t off = 0; off < upto && off < b->size - 1; off += step) {
		unsigned char want = (unsigned char)(b->key + off / step);
		if (b->p[off] != want)
			(*errors)++;
		sum = sum * 31 + want;
	}
	if (upto >= b->size && b->p[b->size - 1] != (unsigned char)(b->key ^ 0x5a))
		(*errors)++;
	return sum;
}

static size_t pick_size(unsigned *x)
{
	unsigned r = rnd(x) % 100;
	if (r < 80)
		return 16 + rnd(x) % 4096;
	if (r < 94)
		return 4096 + rnd(x) % (1u << 20);
	return (4u << 20) + rnd(x) % (8u << 20); /* 4..12 MiB: managed by default */
}

static void *hammer(void *arg)
{
	struct worker *w = arg;
	struct block slot[SLOTS] = { { 0 } };
	unsigned x = 777u + (unsigned)w->id * 1000003u;
	for (long i = 0; i < w->iters; i++) {
		struct block *b = &slot[rnd(&x) % SLOTS];
		unsigned op = rnd(&x) % 10;
		if (b->p && op < 3) {
			w->checksum += check(b, b->size, &w->errors);
			free(b->p);
			b->p = NULL;
		} else if (b->p && op < 6) {
			size_t n = op == 5 ? pick_size(&x) : b->size / 2 + 1; /* grow/shrink, or shrink */
			unsigned char *q = realloc(b->p, n);
			if (!q) {
				w->errors++;
				continue;
			}
			size_t keep = n < b->size ? n : b->size;
			struct block old = *b;
			old.p = q;
			w->checksum += check(&old, keep, &w->errors);
			b->p = q;
			b->size = n;
			b->key = rnd(&x);
			put(b);
		} else if (!b->p) {
			size_t align = (size_t)16 << (rnd(&x) % 9); /* 16 .. 4096 */
			size_t n = pick_size(&x);
			void *p;
			if (posix_memalign(&p, align, n) != 0 || ((uintptr_t)p & (align - 1))) {
				w->errors++;
				continue;
			}
			b->p = p;
			b->size = n;
			b->key = rnd(&x);
			put(b);
		} else {
			w->checksum += check(b, b->size, &w->errors);
		}
	}
	for (int s = 0; s < SLOTS; s++)
		if (slot[s].p) {
			w->checksum += check(&slot[s], slot[s].size, &w->errors);
			free(slot[s].p);
		}
	return NULL;
}

/* A child: check the inherited buffer, then allocate, use and free its own big buffer. */
static int linger_ms;

static void child(int fd, const struct block *inherited, int k)
{
	long errors = 0;
	uint64_t sum = check(inherited, inherited->size, &errors);
	struct block own = { malloc(BIG + (size_t)k * 4096), BIG + (size_t)k * 4096, 99u + (unsigned)k };
	put(&own);
	sum += check(&own, own.size, &errors);
	own.p = realloc(own.p, own.size * 2);
	sum += check(&own, own.size, &errors);
	free(own.p);
	if (linger_ms)
		usleep((useconds_t)linger_ms * 1000);
	free(inherited->p);
	char line[128];
	int n = snprintf(line, sizeof line, "child %d: checksum %016llx errors %ld\n", k,
			 (unsigned long long)sum, errors);
	if (write(fd, line, n) != n)
		_exit(3);
	_exit(errors ? 1 : 0);
}

int main(int argc, char **argv)
{
	int threads = argc > 1 ? atoi(argv[1]) : 4;
	long iters = argc > 2 ? atol(argv[2]) : 20000;
	int forks = argc > 3 ? atoi(argv[3]) : 4;
	linger_ms = argc > 4 ? atoi(argv[4]) : 0;
	if (threads < 1 || threads > 64 || iters < 1 || forks < 0 || forks > 64) {
		fprintf(stderr, "usage: alloc_hammer [THREADS ITERS FORKS [CHILD_LINGER_MS]]\n");
		return 2;
	}
	struct block inherited = { malloc(BIG), BIG, 42 };
	put(&inherited);

	pthread_t tid[64];
	struct worker w[64];
	for (int t = 0; t < threads; t++) {
		w[t] = (struct worker){ .id = t, .iters = iters };
		pthread_create(&tid[t], NULL, hammer, &w[t]);
	}
	char results[64][128];
	int status_bad = 0;
	for (int k = 0; k < forks; k++) {
		int fds[2];
		if (pipe(fds) != 0)
			return 1;
		pid_t pid = fork();
		if (pid == 0) {
			close(fds[0]);
			child(fds[1], &inherited, k);
		}
		close(fds[1]);
		ssize_t n = read(fds[0], results[k], sizeof results[k] - 1);
		results[k][n > 0 ? n : 0] = '\0';
		close(fds[0]);
		int st;
		waitpid(pid, &st, 0);
		if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
			status_bad++;
	}
	long errors = 0;
	for (int t = 0; t < threads; t++) {
		pthread_join(tid[t], NULL);
		printf("thread %d: checksum %016llx errors %ld\n", t, (unsigned long long)w[t].checksum, w[t].errors);
		errors += w[t].errors;
	}
	for (int k = 0; k < forks; k++)
		fputs(results[k], stdout);
	check(&inherited, inherited.size, &errors);
	free(inherited.p);
	printf("children failed: %d\ntotal errors: %ld\n", status_bad, errors);
	return errors || status_bad ? 1 : 0;
}
