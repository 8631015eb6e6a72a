// SPDX-License-Identifier: Apache-2.0
// token_kv: one sequence's KV cache laid out in token order, as llama.cpp keeps its K and V buffers:
// token t's KV at offset t × --token-bytes of one allocation. Knows nothing of tieringd.
//
//   token_kv [--tokens N] [--token-bytes B] [--prompt P] [--rate R] [--seconds S] [--sweep S]
//            [--report S] [--clear] [--wait]
//
// One posix_memalign of N × B bytes (an LD_PRELOAD allocator shim sees one allocation). With --clear
// it is zeroed first, as llama.cpp clears its KV buffer: every page is populated before decoding, and
// writes show only as NUMA hint faults; without it each new token's pages are first touched by its
// write. The prompt's P tokens are written at once (the prefill); then one token every 1/R seconds
// (decode): its B bytes written with a value of its own, the CPU kept busy in between (a decoder
// computes the next token). Every --sweep seconds (0: never) every token
// written so far is read (one byte per page: every page is touched), as attention reads the tokens
// behind the newest one — all of them alike, so near and far ones are read as rarely. When the buffer
// is full, the next sequence starts again at token 0 (a server reusing its slot for a new request).
//
// A second thread only sleeps: the process is multi-threaded like a server (NUMA balancing scans the
// pages a single-threaded process has on its own node not at all).
//
// Output: JSON lines on stdout.
//   start   pid, base, len, token_bytes, tokens (before anything is written)
//   report  every --report seconds: t_s, token (the next token's index), sequence, read_errors
//   end     tokens written, every written byte verified (ok, corrupt_bytes), read_errors
// With --wait the start line is followed by one line read from stdin before anything is written.
// SIGINT/SIGTERM end the run early (then verify as usual). Exit: 0 intact, 3 corrupt, 1 error, 2 usage.
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static volatile sig_atomic_t stop;

static void on_signal(int sig)
{
	(void)sig;
	stop = 1;
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

/* A decoder computes between tokens: the CPU stays busy until the next one is due. NUMA balancing
 * needs that: it scans a task's memory from the task's own scheduler ticks (task_tick_numa()), which a
 * task that sleeps between tokens rarely takes. */
static void compute_until(double t)
{
	while (!stop && now_s() < t)
		;
}

/* the value token t of sequence seq is written with: never 0 (a cleared, unwritten token) */
static uint8_t value_of(long t, long seq)
{
	return (uint8_t)(1 + (t * 7 + seq * 13) % 255);
}

int main(int argc, char **argv)
{
	long tokens = 4096, token_bytes = 16384, prompt = 64, pagesz = sysconf(_SC_PAGESIZE);
	double rate = 20, seconds = 10, sweep = 2, report = 1;
	int clear = 0, wait = 0;

	for (int i = 1; i < argc; i++) {
		const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
		if (!strcmp(a, "--clear")) clear = 1;
		else if (!strcmp(a, "--wait")) wait = 1;
		else if (v && !strcmp(a, "--tokens")) tokens = atol(v), i++;
		else if (v && !strcmp(a, "--token-bytes")) token_bytes = atol(v), i++;
		else if (v && !strcmp(a, "--prompt")) prompt = atol(v), i++;
		else if (v && !strcmp(a, "--rate")) rate = atof(v), i++;
		else if (v && !strcmp(a, "--seconds")) seconds = atof(v), i++;
		else if (v && !strcmp(a, "--sweep")) sweep = atof(v), i++;
		else if (v && !strcmp(a, "--report")) report = atof(v), i++;
		else {
			fprintf(stderr, "usage: %s [--tokens N] [--token-bytes B] [--prompt P] [--rate R] "
				"[--seconds S] [--sweep S] [--report S] [--clear] [--wait]\n", argv[0]);
			return 2;
		}
	}
	if (tokens < 2 || token_bytes < 1 || prompt < 0 || prompt >= tokens || rate <= 0 || report <= 0) {
		fprintf(stderr, "token_kv: bad arguments\n");
		return 2;
	}
	size_t len = (size_t)tokens * token_bytes;
	uint8_t *buf, *val = calloc(tokens, 1);	/* val[t]: what token t holds now (0: unwritten) */
	pthread_t th;

	if (posix_memalign((void **)&buf, pagesz, len) != 0 || !val) {
		perror("token_kv: allocation");
		return 1;
	}
	pthread_create(&th, NULL, idle, NULL);
	signal(SIGINT, on_signal);
	signal(SIGTERM, on_signal);
	printf("{\"event\": \"start\", \"pid\": %d, \"base\": %lu, \"len\": %zu, \"token_bytes\": %ld, "
	       "\"tokens\": %ld}\n", getpid(), (unsigned long)buf, len, token_bytes, tokens);
	fflush(stdout);
	if (wait) {
		char line[64];
		if (!fgets(line, sizeof(line), stdin))
			return 1;
	}
	if (clear)
		memset(buf, 0, len);

	double t0 = now_s(), next_report = t0 + report, next_sweep = t0 + sweep;
	long t = 0, seq = 0, written = 0, read_errors = 0, step = 0;
	for (; t < prompt; t++, written++) {
		val[t] = value_of(t, seq);
		memset(buf + t * token_bytes, val[t], token_bytes);
	}
	while (!stop && now_s() - t0 < seconds) {
		if (t == tokens) {		/* full: a new sequence in the same buffer */
			t = 0;
			seq++;
		}
		val[t] = value_of(t, seq);
		memset(buf + t * token_bytes, val[t], token_bytes);
		t++, written++;
		double now = now_s();
		if (sweep > 0 && now >= next_sweep) {
			long lo = 0, hi = (seq ? tokens : t) * token_bytes;
			for (long off = lo; off < hi; off += pagesz) {
				uint8_t want = val[off / token_bytes];
				if (*(volatile uint8_t *)(buf + off) != want)
					read_errors++;
			}
			next_sweep = now + sweep;
		}
		if (now >= next_report) {
			printf("{\"event\": \"report\", \"t_s\": %.3f, \"token\": %ld, \"sequence\": %ld, "
			       "\"read_errors\": %ld}\n", now - t0, t, seq, read_errors);
			fflush(stdout);
			next_report += report;
		}
		compute_until(t0 + ++step / rate);
	}

	long corrupt = 0;
	for (long k = 0; k < tokens; k++) {
		const uint8_t *p = buf + k * token_bytes;
		if (!val[k] && !clear)
			continue;		/* never written nor cleared: whatever the allocator left */
		for (long i = 0; i < token_bytes; i++)
			corrupt += p[i] != val[k];
	}
	printf("{\"event\": \"end\", \"written\": %ld, \"token\": %ld, \"sequence\": %ld, \"ok\": %s, "
	       "\"corrupt_bytes\": %ld, \"read_errors\": %ld}\n", written, t, seq, corrupt ? "false" : "true",
	       corrupt, read_errors);
	fflush(stdout);
	return corrupt ? 3 : 0;
}
