// SPDX-License-Identifier: Apache-2.0
// Small-allocation throughput for figure P1 (scripts/bench/p1_malloc.py): each thread keeps a
// window of 64 live blocks and, per iteration, frees one and mallocs a new one of a size drawn
// from 16..1024 bytes (a fixed pseudo-random sequence), writing its first byte — the churn of
// an interpreter or a server's request path. With "fill", the whole block is written, as code
// that allocates then initialises what it allocated does; without it, only the first byte.
// With "batch", each thread instead mallocs 1024 blocks, then frees them all, and again: a
// pattern that no small per-thread cache can serve (the shim's worst case).
// Prints "pairs_per_cpu_s N wall_pairs_per_s M": N sums, over threads, pairs done per second of
// that thread's own CPU time (CLOCK_THREAD_CPUTIME_ID), which a busy shared machine cannot skew
// by descheduling us; M is plain wall-clock throughput.
// Usage: malloc_bench THREADS PAIRS_PER_THREAD [fill|batch]
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define WINDOW 64

struct job {
	unsigned seed;
	int fill;
	int batch;
	unsigned long long pairs;
	double cpu_s;
};

static double clock_s(clockid_t id)
{
	struct timespec ts;
	clock_gettime(id, &ts);
	return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void *worker(void *arg)
{
	struct job *job = arg;
	void *live[WINDOW] = { 0 };
	unsigned x = job->seed;
	double t0 = clock_s(CLOCK_THREAD_CPUTIME_ID);
	if (job->batch) {
		static __thread char *many[1024];
		for (unsigned long long done = 0; done < job->pairs; done += 1024) {
			for (int k = 0; k < 1024; k++) {
				x = x * 1664525u + 1013904223u;
				many[k] = malloc(16 + (x >> 20) % 1009);
				*many[k] = (char)k;
			}
			for (int k = 0; k < 1024; k++)
				free(many[k]);
		}
		job->cpu_s = clock_s(CLOCK_THREAD_CPUTIME_ID) - t0;
		return NULL;
	}
	for (unsigned long long i = 0; i < job->pairs; i++) {
		x = x * 1664525u + 1013904223u;
		unsigned slot = (x >> 8) % WINDOW;
		free(live[slot]);
		size_t size = 16 + (x >> 20) % 1009;
		char *p = malloc(size);
		if (job->fill)
			memset(p, (int)i, size);
		else
			*p = (char)i;
		live[slot] = p;
	}
	job->cpu_s = clock_s(CLOCK_THREAD_CPUTIME_ID) - t0;
	for (int i = 0; i < WINDOW; i++)
		free(live[i]);
	return NULL;
}

int main(int argc, char **argv)
{
	int threads = argc > 1 ? atoi(argv[1]) : 1;
	unsigned long long pairs = argc > 2 ? strtoull(argv[2], NULL, 10) : 10000000ULL;
	int fill = argc > 3 && strcmp(argv[3], "fill") == 0;
	int batch = argc > 3 && strcmp(argv[3], "batch") == 0;
	if (threads < 1 || threads > 64 || pairs == 0) {
		fprintf(stderr, "usage: malloc_bench THREADS PAIRS_PER_THREAD [fill|batch]\n");
		return 2;
	}
	pthread_t tid[64];
	struct job jobs[64];
	double t0 = clock_s(CLOCK_MONOTONIC);
	for (int i = 0; i < threads; i++) {
		jobs[i] = (struct job){ .seed = 12345u + (unsigned)i, .fill = fill, .batch = batch,
				      .pairs = pairs };
		pthread_create(&tid[i], NULL, worker, &jobs[i]);
	}
	double per_cpu = 0;
	for (int i = 0; i < threads; i++) {
		pthread_join(tid[i], NULL);
		per_cpu += jobs[i].pairs / jobs[i].cpu_s;
	}
	double wall = clock_s(CLOCK_MONOTONIC) - t0;
	printf("pairs_per_cpu_s %.0f wall_pairs_per_s %.0f\n", per_cpu, threads * (double)pairs / wall);
	return 0;
}
