// SPDX-License-Identifier: Apache-2.0
// A pool written by 4 threads from user mode and 1 thread from kernel mode (read(2) from a pipe into
// the pool), all the time, with a reference computed in-process: for the DAX-remap tests, which
// move the pool onto a file and back while this runs. Knows nothing of tieringd.
//
//   dax_writers MIB [N [US]]
//                         fills the pool (round 1), prints "pool ADDR LEN", starts N writers (default
//                         5: 4 storing, the 5th read(2)ing; 0: an idle pool), each pausing US
//                         microseconds after a page (default 0: flat out), and prints "running"; on
//                         "stop" (stdin) stops every writer at a page boundary and checks every word;
//                         prints "ok WORDS" or "bad N first at OFFSET: got X want Y"; exit 0 only when
//                         every word holds.
//
// Page p belongs to writer p % 5 (writers 0-3: stores; writer 4: read(2)). Round r writes every word
// of a writer's pages, in order, with (r << 32 | page << 3 | writer); a stopped writer records its
// round and how many pages of it it finished, which is all the check needs.
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define WRITERS 5
#define KERNEL_WRITER 4
#define PAGE 4096UL
#define WORDS_PER_PAGE (PAGE / 8)

static uint64_t *pool;
static size_t npages;
static useconds_t pause_us;
static volatile int stop;

struct progress {
	uint64_t round;     /* the round in progress when stopped (1 = first) */
	size_t pages_done;  /* pages of that round finished */
	uint64_t errors;    /* read(2) failures: EFAULT would mean a kernel write was refused */
} progress[WRITERS];

static uint64_t value(uint64_t round, size_t page, int w)
{
	return round << 32 | (uint64_t)page << 3 | (uint64_t)w;
}

static void *writer(void *arg)
{
	int w = (int)(intptr_t)arg;
	int pipefd[2] = { -1, -1 };
	static __thread uint64_t buf[WORDS_PER_PAGE];
	if (w == KERNEL_WRITER && pipe(pipefd) != 0)
		return NULL;
	for (uint64_t r = 2;; r++) {
		size_t done = 0;
		for (size_t p = (size_t)w; p < npages; p += WRITERS, done++) {
			if (stop) {
				progress[w].round = r;
				progress[w].pages_done = done;
				return NULL;
			}
			uint64_t *page = pool + p * WORDS_PER_PAGE;
			if (pause_us)
				usleep(pause_us);   /* a writer that leaves the (emulated) CPUs to others */
			if (w != KERNEL_WRITER) {
				for (size_t i = 0; i < WORDS_PER_PAGE; i++)
					page[i] = value(r, p, w);
				continue;
			}
			for (size_t i = 0; i < WORDS_PER_PAGE; i++)
				buf[i] = value(r, p, w);
			if (write(pipefd[1], buf, PAGE) != (ssize_t)PAGE)
				progress[w].errors++;
			/* The kernel copies into the pool: a fault there is taken in kernel mode. */
			size_t got = 0;
			while (got < PAGE) {
				ssize_t n = read(pipefd[0], (char *)page + got, PAGE - got);
				if (n <= 0) {
					progress[w].errors++;
					fprintf(stderr, "read(2) into the pool: %s\n", n < 0 ? strerror(errno) : "EOF");
					break;
				}
				got += (size_t)n;
			}
		}
	}
}

int main(int argc, char **argv)
{
	size_t mib = argc > 1 ? strtoul(argv[1], NULL, 10) : 64;
	int nwriters = argc > 2 ? atoi(argv[2]) : WRITERS;
	pause_us = argc > 3 ? (useconds_t)strtoul(argv[3], NULL, 10) : 0;
	if (nwriters < 0 || nwriters > WRITERS)
		return 2;
	npages = mib << 20 >> 12;
	pool = malloc(npages * PAGE);
	if (!pool)
		return 2;
	for (size_t p = 0; p < npages; p++)     /* round 1, by this thread, for every writer's pages */
		for (size_t i = 0; i < WORDS_PER_PAGE; i++)
			pool[p * WORDS_PER_PAGE + i] = value(1, p, (int)(p % WRITERS));
	for (int w = 0; w < WRITERS; w++)
		progress[w].round = 2;          /* a writer that never runs has finished round 1 */
	printf("pool %p %zu\n", (void *)pool, npages * PAGE);
	fflush(stdout);
	pthread_t t[WRITERS];
	for (int w = 0; w < nwriters; w++)
		pthread_create(&t[w], NULL, writer, (void *)(intptr_t)w);
	printf("running\n");
	fflush(stdout);
	char line[64];
	while (fgets(line, sizeof line, stdin) && strncmp(line, "stop", 4) != 0)
		;
	stop = 1;
	for (int w = 0; w < nwriters; w++)
		pthread_join(t[w], NULL);

	size_t bad = 0, first = 0;
	uint64_t got0 = 0, want0 = 0, errors = 0;
	for (int w = 0; w < WRITERS; w++) {
		errors += progress[w].errors;
		size_t k = 0;
		for (size_t p = (size_t)w; p < npages; p += WRITERS, k++) {
			uint64_t r = k < progress[w].pages_done ? progress[w].round : progress[w].round - 1;
			uint64_t want = value(r, p, w);
			for (size_t i = 0; i < WORDS_PER_PAGE; i++) {
				uint64_t got = pool[p * WORDS_PER_PAGE + i];
				if (got != want && !bad++) {
					first = (p * WORDS_PER_PAGE + i) * 8;
					got0 = got;
					want0 = want;
				}
			}
		}
	}
	uint64_t rounds = 0;
	for (int w = 0; w < WRITERS; w++)
		rounds += progress[w].round;
	if (bad || errors) {
		printf("bad %zu first at %zu: got %lx want %lx; read(2) errors %lu\n", bad, first,
		       (unsigned long)got0, (unsigned long)want0, (unsigned long)errors);
		return 1;
	}
	printf("ok %zu words, %lu rounds\n", npages * WORDS_PER_PAGE, (unsigned long)rounds);
	return 0;
}
