// SPDX-License-Identifier: Apache-2.0
// Small-allocation checks for the shim's small cache (tests/host/test_shim_smallcache.py).
//   small_churn churn ROUNDS   ROUNDS rounds of 4 short-lived threads; each pair hands blocks across
//                              (allocated and written by one thread, checked and freed by the other,
//                              which then allocates from what it freed). Prints a checksum of every
//                              byte checked and "held_after_exit N": the bytes glibc still counts
//                              in use once every thread has exited (mallinfo2), minus those at start.
//   small_churn double-free    free()s one small block twice: the allocator must abort.
#include <malloc.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BATCH 256

struct pipe {
	pthread_mutex_t lock;
	pthread_cond_t cond;
	unsigned char *blocks[BATCH];
	size_t sizes[BATCH];
	int full;
};

struct pair {
	struct pipe pipe;
	unsigned seed;
	uint64_t sum;
	int bad;
};

static unsigned next_rand(unsigned *x)
{
	*x = *x * 1664525u + 1013904223u;
	return *x >> 8;
}

static unsigned char pattern(size_t size, size_t i)
{
	return (unsigned char)(size * 31 + i * 7);
}

static void *producer(void *arg)
{
	struct pair *pr = arg;
	unsigned x = pr->seed;
	for (int batch = 0; batch < 8; batch++) {
		pthread_mutex_lock(&pr->pipe.lock);
		while (pr->pipe.full)
			pthread_cond_wait(&pr->pipe.cond, &pr->pipe.lock);
		for (int i = 0; i < BATCH; i++) {
			size_t size = 1 + next_rand(&x) % 1100;
			unsigned char *p = malloc(size);
			for (size_t j = 0; j < size; j++)
				p[j] = pattern(size, j);
			pr->pipe.blocks[i] = p;
			pr->pipe.sizes[i] = size;
		}
		pr->pipe.full = 1;
		pthread_cond_broadcast(&pr->pipe.cond);
		pthread_mutex_unlock(&pr->pipe.lock);
		/* Churn of its own: freed and reused within this thread. */
		for (int i = 0; i < 2000; i++) {
			size_t size = 1 + next_rand(&x) % 1100;
			unsigned char *p = malloc(size);
			memset(p, 0x5a, size);
			free(p);
		}
	}
	return NULL;
}

static void *consumer(void *arg)
{
	struct pair *pr = arg;
	for (int batch = 0; batch < 8; batch++) {
		pthread_mutex_lock(&pr->pipe.lock);
		while (!pr->pipe.full)
			pthread_cond_wait(&pr->pipe.cond, &pr->pipe.lock);
		unsigned char *mine[BATCH];
		size_t my_sizes[BATCH];
		for (int i = 0; i < BATCH; i++) {
			unsigned char *p = pr->pipe.blocks[i];
			size_t size = pr->pipe.sizes[i];
			for (size_t j = 0; j < size; j++) {
				pr->bad |= p[j] != pattern(size, j);
				pr->sum += p[j];
			}
			free(p); /* another thread's block, cached here */
			/* ...and reused here at once, written, checked. */
			my_sizes[i] = size;
			mine[i] = malloc(size);
			memset(mine[i], (int)i, size);
		}
		pr->pipe.full = 0;
		pthread_cond_broadcast(&pr->pipe.cond);
		pthread_mutex_unlock(&pr->pipe.lock);
		for (int i = 0; i < BATCH; i++) {
			for (size_t j = 0; j < my_sizes[i]; j++)
				pr->bad |= mine[i][j] != (unsigned char)i;
			free(mine[i]);
		}
	}
	return NULL;
}

static int churn(int rounds)
{
	/* Warm glibc up first so that its own arenas and tcache are part of the baseline. */
	struct pair warm = { .pipe = { PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER }, .seed = 1 };
	pthread_t a, b;
	pthread_create(&a, NULL, producer, &warm);
	pthread_create(&b, NULL, consumer, &warm);
	pthread_join(a, NULL);
	pthread_join(b, NULL);
	malloc_trim(0);
	size_t before = mallinfo2().uordblks;

	uint64_t sum = 0;
	int bad = warm.bad;
	for (int r = 0; r < rounds; r++) {
		struct pair pairs[2];
		pthread_t t[4];
		for (int k = 0; k < 2; k++) {
			pairs[k] = (struct pair){ .pipe = { PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER },
						  .seed = 1000u * (unsigned)r + (unsigned)k };
			pthread_create(&t[2 * k], NULL, producer, &pairs[k]);
			pthread_create(&t[2 * k + 1], NULL, consumer, &pairs[k]);
		}
		for (int k = 0; k < 4; k++)
			pthread_join(t[k], NULL);
		for (int k = 0; k < 2; k++) {
			sum += pairs[k].sum;
			bad |= pairs[k].bad;
		}
	}
	malloc_trim(0);
	long held = (long)mallinfo2().uordblks - (long)before;
	printf("checksum %llu corrupt %d\n", (unsigned long long)sum, bad);
	printf("held_after_exit %ld\n", held);
	return bad;
}

int main(int argc, char **argv)
{
	if (argc >= 2 && strcmp(argv[1], "double-free") == 0) {
		void *volatile p = malloc(100);
		free(p);
		free(p);
		puts("double free went unnoticed");
		return 0;
	}
	if (argc >= 3 && strcmp(argv[1], "churn") == 0)
		return churn(atoi(argv[2]));
	fprintf(stderr, "usage: small_churn churn ROUNDS | double-free\n");
	return 2;
}
