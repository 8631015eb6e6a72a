// SPDX-License-Identifier: Apache-2.0
// shared_prefix: a KV prefix that several processes map, and each process's private KV, read alike.
// Knows nothing of tieringd.
//
//   shared_prefix [--prefix SIZE] [--private SIZE] [--block SIZE] [--processes N] [--seconds S]
//                 [--report S] [--seed N] [--cpu N] [--query-pages N]
//
// The first process allocates the prefix (one malloc) and fills it, then forks N-1 more. Each of
// the N inherits the prefix: with an allocator shim's memfd backing (TIERINGD_BACKING=memfd) they
// all map the same pages; plain anonymous memory would be copy-on-write, and NUMA balancing never
// makes a copy-on-write page that several processes map trap a hint fault (mm/mprotect.c), so a
// sampler would never see it read. Each process's reader thread starts at once, reading every
// 64-byte line of every prefix block, round after round, while its main thread allocates the
// process's own private pool (one malloc: after the fork, so no one else maps it) and fills it with
// bytes of its own; from then on each round reads a prefix block and a private block in turn, so
// that each block of a process is read as often as any other. The main thread then only reports
// (NUMA balancing scans the local pages of multi-threaded processes only). The readers run on --cpu (default: the highest CPU allowed),
// which leaves the others to a daemon.
//
// Output: JSON lines on stdout, each written whole by one write(2) (the N processes share stdout):
//   start   per process: index, pid, prefix and private addresses and sizes, block size
//   report  per process, every --report seconds: which share of the prefix's and of the private
//           pool's pages are on node 0 (move_pages(2) query of --query-pages pages per block,
//           default 16, evenly spaced), rounds read, read errors
//   end     per process: every byte of its private pool and of the prefix verified (contents are a
//           pure function of the seed, the pool and the position)
// Exit: 0 when every process is intact, 3 on corruption, 1 on an error, 2 on usage.
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define LINE_BYTES	64
#define MAX_PROCS	64
#define WORD_STEP	0x9e3779b97f4a7c15ULL

static struct {
	size_t prefix_bytes, private_bytes, block_bytes;
	long processes, cpu, query_pages;
	double seconds, report_s;
	uint64_t seed;
} opt = { 64 << 20, 64 << 20, 2 << 20, 3, -2, 16, 60, 4, 1 };

static char *prefix, *private_pool;
static long index_;			/* this process: 0 the first, 1.. the forked ones */
static atomic_ulong rounds, read_errors;
static atomic_int private_ready;
static volatile sig_atomic_t stop;
static double t0;
static long pagesz;

static double now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

static uint64_t mix64(uint64_t x)
{
	x += 0x9e3779b97f4a7c15ULL;
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
	x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
	return x ^ (x >> 31);
}

// The word at word index w of pool p (0: the prefix, 1 + k: process k's private pool).
static uint64_t word(long p, size_t w)
{
	return mix64(opt.seed ^ ((uint64_t)p << 48)) + (uint64_t)w * WORD_STEP;
}

static void fill(char *pool, size_t bytes, long p)
{
	uint64_t *w = (uint64_t *)pool;

	for (size_t i = 0; i < bytes / 8; i++)
		w[i] = word(p, i);
}

static unsigned long read_block(const char *pool, size_t block, long p)
{
	const volatile uint64_t *w = (const volatile uint64_t *)(pool + block * opt.block_bytes);
	size_t first = block * opt.block_bytes / 8, step = LINE_BYTES / 8;
	unsigned long bad = 0;

	for (size_t i = 0; i < opt.block_bytes / 8; i += step)
		bad += w[i] != word(p, first + i);
	return bad;
}

static unsigned long verify(const char *pool, size_t bytes, long p)
{
	const uint64_t *w = (const uint64_t *)pool;
	unsigned long bad = 0;

	for (size_t i = 0; i < bytes / 8; i++)
		bad += w[i] != word(p, i);
	return bad;
}

static void *reader(void *arg)
{
	size_t nprefix = opt.prefix_bytes / opt.block_bytes, nprivate = opt.private_bytes / opt.block_bytes;
	size_t n = nprefix > nprivate ? nprefix : nprivate;

	(void)arg;
	if (opt.cpu >= 0) {
		cpu_set_t set;
		CPU_ZERO(&set);
		CPU_SET(opt.cpu, &set);
		pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
	}
	while (!stop && now_s() - t0 < opt.seconds) {
		unsigned long bad = 0;
		int both = atomic_load(&private_ready);

		for (size_t b = 0; b < n && !stop; b++) {
			if (b < nprefix)
				bad += read_block(prefix, b, 0);
			if (both && b < nprivate)
				bad += read_block(private_pool, b, 1 + index_);
		}
		if (bad)
			atomic_fetch_add(&read_errors, bad);
		atomic_fetch_add(&rounds, 1);
	}
	return NULL;
}

// One JSON line, written whole (the processes share stdout).
static void emit(const char *fmt, ...)
{
	char line[1024];
	va_list ap;
	int n;

	va_start(ap, fmt);
	n = vsnprintf(line, sizeof(line) - 1, fmt, ap);
	va_end(ap);
	if (n < 0 || n >= (int)sizeof(line) - 1)
		return;
	line[n++] = '\n';
	if (write(STDOUT_FILENO, line, n) != n)
		stop = 1;
}

// Share of the queried pages of a pool that are on node 0 (move_pages(2) with no target: where
// each page is).
static double node0_share(const char *pool, size_t bytes)
{
	size_t nblocks = bytes / opt.block_bytes, ppb = opt.block_bytes / pagesz;
	size_t per = opt.query_pages > 0 && (size_t)opt.query_pages < ppb ? (size_t)opt.query_pages : ppb;
	void **pages = malloc(nblocks * per * sizeof(void *));
	int *status = malloc(nblocks * per * sizeof(int));
	long on0 = 0, placed = 0;

	for (size_t b = 0; b < nblocks; b++)
		for (size_t k = 0; k < per; k++)
			pages[b * per + k] = (char *)pool + b * opt.block_bytes + (k * ppb / per) * pagesz;
	if (syscall(SYS_move_pages, 0, nblocks * per, pages, NULL, status, 0) == 0)
		for (size_t i = 0; i < nblocks * per; i++) {
			placed += status[i] >= 0;
			on0 += status[i] == 0;
		}
	free(pages);
	free(status);
	return placed ? (double)on0 / placed : 0.0;
}

static int parse_size(const char *v, size_t *out)
{
	char *end;
	double x = strtod(v, &end), mult = 1;

	switch (*end) {
	case 'k': case 'K': mult = 1 << 10; end++; break;
	case 'm': case 'M': mult = 1 << 20; end++; break;
	case 'g': case 'G': mult = 1 << 30; end++; break;
	}
	if (*end == 'i' && end[1] == 'B')
		end += 2;
	if (end == v || *end || x <= 0)
		return -1;
	*out = (size_t)(x * mult);
	return 0;
}

static int parse_args(int argc, char **argv)
{
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
		int bad = 0;

		if (!v)
			return -1;
		i++;
		if (!strcmp(a, "--prefix")) bad = parse_size(v, &opt.prefix_bytes);
		else if (!strcmp(a, "--private")) bad = parse_size(v, &opt.private_bytes);
		else if (!strcmp(a, "--block")) bad = parse_size(v, &opt.block_bytes);
		else if (!strcmp(a, "--processes")) opt.processes = atol(v);
		else if (!strcmp(a, "--seconds")) opt.seconds = atof(v);
		else if (!strcmp(a, "--report")) opt.report_s = atof(v);
		else if (!strcmp(a, "--seed")) opt.seed = strtoull(v, NULL, 0);
		else if (!strcmp(a, "--cpu")) opt.cpu = atol(v);
		else if (!strcmp(a, "--query-pages")) opt.query_pages = atol(v);
		else return -1;
		if (bad)
			return -1;
	}
	if (opt.block_bytes % pagesz || opt.prefix_bytes % opt.block_bytes ||
	    opt.private_bytes % opt.block_bytes || opt.processes < 1 || opt.processes > MAX_PROCS ||
	    opt.seconds <= 0 || opt.report_s <= 0)
		return -1;
	return 0;
}

// The highest CPU this process may use (--cpu -2, the default), or --cpu itself.
static void choose_cpu(void)
{
	cpu_set_t set;

	if (opt.cpu != -2 || sched_getaffinity(0, sizeof(set), &set))
		return;
	for (int c = CPU_SETSIZE - 1; c >= 0; c--)
		if (CPU_ISSET(c, &set)) {
			opt.cpu = c;
			return;
		}
}

static void on_signal(int sig)
{
	(void)sig;
	stop = 1;
}

static char *aligned_pool(size_t bytes)
{
	size_t align = opt.block_bytes < (2u << 20) ? opt.block_bytes : 2u << 20;
	char *raw = malloc(bytes + align);

	return raw ? (char *)(((uintptr_t)raw + align - 1) & ~(uintptr_t)(align - 1)) : NULL;
}

// One process's life after the fork: its private pool, its reader, its reports, its verification.
static int run(void)
{
	pthread_t tid;
	double last;

	t0 = last = now_s();
	if (pthread_create(&tid, NULL, reader, NULL)) {
		fprintf(stderr, "shared_prefix: pthread_create failed\n");
		return 1;
	}
	private_pool = aligned_pool(opt.private_bytes);
	if (!private_pool) {
		fprintf(stderr, "shared_prefix: cannot allocate the private pool\n");
		stop = 1;
		pthread_join(tid, NULL);
		return 1;
	}
	fill(private_pool, opt.private_bytes, 1 + index_);
	atomic_store(&private_ready, 1);
	emit("{\"event\": \"start\", \"index\": %ld, \"pid\": %d, \"prefix_addr\": %lu, \"prefix_bytes\": %zu, "
	     "\"private_addr\": %lu, \"private_bytes\": %zu, \"block_bytes\": %zu, \"cpu\": %ld}",
	     index_, getpid(), (unsigned long)prefix, opt.prefix_bytes, (unsigned long)private_pool,
	     opt.private_bytes, opt.block_bytes, opt.cpu);
	while (!stop && now_s() - t0 < opt.seconds) {
		double next = last + opt.report_s, now = now_s();

		if (now < next) {
			struct timespec ts = { (time_t)(next - now), (long)((next - now - (time_t)(next - now)) * 1e9) };
			nanosleep(&ts, NULL);
			continue;
		}
		last = now;
		emit("{\"event\": \"report\", \"index\": %ld, \"pid\": %d, \"t_s\": %.3f, \"prefix_node0_share\": %.4f, "
		     "\"private_node0_share\": %.4f, \"rounds\": %lu, \"read_errors\": %lu}", index_, getpid(),
		     now - t0, node0_share(prefix, opt.prefix_bytes), node0_share(private_pool, opt.private_bytes),
		     atomic_load(&rounds), atomic_load(&read_errors));
	}
	stop = 1;
	pthread_join(tid, NULL);
	unsigned long bad = verify(prefix, opt.prefix_bytes, 0) + verify(private_pool, opt.private_bytes, 1 + index_);
	int ok = !bad && !atomic_load(&read_errors);
	emit("{\"event\": \"end\", \"index\": %ld, \"pid\": %d, \"rounds\": %lu, \"corrupt_words\": %lu, "
	     "\"read_errors\": %lu, \"verified_bytes\": %zu, \"ok\": %s}", index_, getpid(), atomic_load(&rounds),
	     bad, atomic_load(&read_errors), opt.prefix_bytes + opt.private_bytes, ok ? "true" : "false");
	return ok ? 0 : 3;
}

int main(int argc, char **argv)
{
	pid_t kids[MAX_PROCS];
	int rc;

	pagesz = sysconf(_SC_PAGESIZE);
	if (parse_args(argc, argv)) {
		fprintf(stderr, "usage: %s [--prefix SIZE] [--private SIZE] [--block SIZE] [--processes N] "
			"[--seconds S] [--report S] [--seed N] [--cpu N] [--query-pages N]\n", argv[0]);
		return 2;
	}
	choose_cpu();
	signal(SIGINT, on_signal);
	signal(SIGTERM, on_signal);
	prefix = aligned_pool(opt.prefix_bytes);
	if (!prefix) {
		fprintf(stderr, "shared_prefix: cannot allocate the prefix\n");
		return 1;
	}
	fill(prefix, opt.prefix_bytes, 0);
	for (long k = 1; k < opt.processes; k++) {
		pid_t pid = fork();

		if (pid < 0) {
			perror("shared_prefix: fork");
			return 1;
		}
		if (pid == 0) {
			index_ = k;
			return run();
		}
		kids[k] = pid;
	}
	rc = run();
	for (long k = 1; k < opt.processes; k++) {
		int st;

		if (waitpid(kids[k], &st, 0) < 0 || !WIFEXITED(st))
			rc = rc ? rc : 1;
		else if (WEXITSTATUS(st))
			rc = WEXITSTATUS(st) > rc ? WEXITSTATUS(st) : rc;
	}
	return rc;
}
