// SPDX-License-Identifier: Apache-2.0
// kv_workload: an LLM server's KV cache, as far as memory sees it. Knows nothing of tieringd.
//
//   kv_workload [--pool SIZE] [--block SIZE] [--token SIZE] [--prefix SIZE] [--active N]
//               [--context-blocks N] [--ring N] [--rotate S] [--seconds S] [--report S] [--seed N]
//               [--layout scattered|front] [--threads N] [--cpu N] [--ticker-us N]
//               [--query-pages N] [--report-blocks] [--wait] [--bind-local] [--fill-mib-s R]
//               [--fill-burst-mib M] [--fill-min-free-mib M] [--fork-exec-ms N]
//
// One pool, one malloc (so an LD_PRELOAD allocator shim sees one allocation), cut into blocks.
// The first --prefix bytes' worth of blocks are a shared prefix (a system prompt's KV); the next
// --ring × --context-blocks blocks are the contexts of the requests the server keeps (R blocks each);
// the rest of the pool is filled once and never touched again (cold KV: finished conversations).
//   --layout front       prefix and contexts are the pool's first blocks (first touched: node 0)
//   --layout scattered   they are a seeded random choice of blocks all over the pool (default)
// --active requests decode at once. A decode step of one request reads the prefix and the request's
// blocks 0..newest in order (one 8-byte word per 64-byte line: every cache line is fetched) and writes
// the newest token's KV (--token bytes) into the newest block; a request's context grows from half
// full to full, then starts again at half (a new turn). Every --rotate seconds the oldest active
// request leaves and the next one of the ring enters, so the hot set moves.
//
// Threads: --threads workers (default 1) share the active requests; the main thread only fills,
// reports and verifies, so the process is multi-threaded (NUMA balancing scans the local pages of
// multi-threaded processes only). Workers and main are pinned to --cpu (default: the highest CPU this
// process may use; the next lower ones for more workers; -1 = no pinning), which leaves the other
// CPUs to a daemon.
// Ticker (--ticker-us, default 1000; 0 = off): one small process per worker CPU, pinned beside the
// worker, that sleeps N µs in a loop. Each wake-up switches that CPU to another address space and
// back, i.e. two CR3 writes. Under QEMU/TCG a CR3 write is the only thing that flushes the emulated
// TLB; DAMON and idle-page tracking clear accessed bits without a flush (as x86 allows), so a worker
// alone on its vCPU keeps its cached translations and the page walker never sets an accessed bit
// again. On real CPUs the TLB is far smaller than the hot set, and the ticker merely costs two context
// switches per period. (Hint faults do not need it: NUMA balancing flushes the TLB when it protects
// pages.) A second thread would not do: threads share the address space and switching between them
// writes no CR3. The tickers are forked before the pool exists, so they share none of it.
//
// Output: JSON lines on stdout.
//   start   after the pool is filled: pid, pool address/size, block/token bytes, the prefix block
//           indices and every ring request's blocks, CPUs, ticker pids, fill time, pool pages by node.
//   report  every --report seconds: the blocks touched in that period, and which share of them is on
//           node 0 — move_pages(2) query of --query-pages pages per touched block (default 16, evenly
//           spaced; 0 = every page), node0_share = queried pages on node 0 / queried pages (equal
//           pages per block: the mean over touched blocks of each block's node-0 fraction). 16 pages
//           per block keeps a report's query to a few thousand pages under TCG; a block moves whole
//           (the daemon's moves, a 2 MiB THP) or page by page (kernel demotion), and 16 samples put
//           each block's fraction within 1/16, the share over ~100 blocks far closer. Also the same
//           query over the whole pool, the period's access counts and the workers' user and system
//           CPU seconds (system time: the faults they took). --report-blocks adds the touched
//           block indices.
//   end     every byte verified: contents are a pure function of (seed, position, write count of the
//           token slot), so a lost, stale, zeroed or misplaced byte is found; exit 3 on corruption.
// Reads are checked too (each word read against its expected value): read_errors in the reports.
// With --wait the start line is followed by one line read from stdin before decoding begins.
// --fill-mib-s R: fill the pool at R MiB/s at most (default 0: as fast as it goes), as a server's KV
// grows with its traffic — a pool larger than the machine's memory then fits only if something
// (a tiering daemon's DAX tier) makes room while it fills. --fill-burst-mib M: the first M MiB fill
// as fast as they go (a server's start-up), the pacing applies to the rest.
// --fill-min-free-mib M: the fill also waits while the machine has less than M MiB free (a server
// that admits no request its KV cannot hold), so a slower mover on a busy host delays it, not OOMs it.
// --bind-local (experiments only): after filling, bind each run of blocks to the node its pages are on
// with mbind(MPOL_BIND | MPOL_F_NUMA_BALANCING, MPOL_MF_MOVE) — what a tiering daemon would have an
// allocator shim do, so that NUMA balancing scans the pool and migrates none of it.
// SIGINT/SIGTERM end the run early (then verify as usual). Exit: 0 intact, 3 corrupt, 1 error, 2 usage.
// SIGUSR1: verify every byte now — the workers park between decode steps, the main thread checks the
// whole pool and prints a "verify" line (as "end" does), then they go on: reliability trials check
// the pool after each fault without ending the run.
// SIGUSR2: fork a child that sleeps --fork-exec-ms (default 200) and execs /bin/true — a server
// spawning a helper. Under a preload shim the child inherits the pool copy-on-write, and the exec
// takes it away again while a tiering daemon may be moving it. Prints a "fork" line with its pid.
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/sysinfo.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MPOL_BIND		2
#define MPOL_F_NUMA_BALANCING	(1 << 13)	/* v5.12+, MPOL_BIND only */
#define MPOL_MF_MOVE		(1 << 1)
#define LINE_BYTES		64
#define MAX_NODES		64
#define WORD_STEP		0x9e3779b97f4a7c15ULL	/* odd: w -> w * K is a bijection mod 2^64 */

struct options {
	size_t pool_bytes, block_bytes, token_bytes, prefix_bytes;
	long active, context_blocks, ring, threads, cpu, ticker_us, query_pages, fork_exec_ms;
	double rotate_s, seconds, report_s, fill_mib_s, fill_burst_mib, fill_min_free_mib;
	uint64_t seed;
	int front, report_blocks, wait, bind_local;
};

struct request {
	atomic_int owner;	/* worker holding it, -1 when none */
	long pos;		/* tokens in its context (only the owner touches it) */
	long *blocks;		/* its context_blocks block indices, in context order */
};

struct counters {		/* one per worker; the reporter reads them */
	atomic_ulong steps, block_reads, prefix_reads, bytes_read, bytes_written, read_errors;
	atomic_ulong user_us, sys_us;	/* the worker's CPU time (getrusage(RUSAGE_THREAD)) */
	char pad[64];
};

static struct options opt;
static char *pool;
static long nblocks, tokens_per_block, nslots, nprefix, *prefix_blocks, pagesz;
static struct request *reqs;
static uint32_t *slot_gen;		/* writes of each token slot (content generation) */
static atomic_uint *touched_epoch;	/* per block: last report epoch it was touched in */
static atomic_uint epoch = 1;
static struct counters *counters;
static volatile sig_atomic_t stop, verify_asked, fork_asked;
static atomic_int paused, parked;	/* SIGUSR1: workers park while the pool is verified */
static double t0;
static int cpus[CPU_SETSIZE], ncpus;

static double now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

static uint64_t mix64(uint64_t x)	/* splitmix64's finaliser */
{
	x += 0x9e3779b97f4a7c15ULL;
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
	x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
	return x ^ (x >> 31);
}

// The word at pool word index w of token slot s, written g times: base(s, g) + w * K.
static uint64_t slot_base(long s, uint32_t g)
{
	return mix64(opt.seed ^ mix64(((uint64_t)s << 32) | g));
}

static int parse_size(const char *v, size_t *out)
{
	char *end;
	double x = strtod(v, &end);
	double mult = 1;

	switch (*end) {
	case 'k': case 'K': mult = 1 << 10; end++; break;
	case 'm': case 'M': mult = 1 << 20; end++; break;
	case 'g': case 'G': mult = 1 << 30; end++; break;
	}
	if (*end == 'i' && end[1] == 'B')
		end += 2;
	if (end == v || *end || x < 0)
		return -1;
	*out = (size_t)(x * mult);
	return 0;
}

static void usage(const char *prog)
{
	fprintf(stderr, "usage: %s [--pool SIZE] [--block SIZE] [--token SIZE] [--prefix SIZE] "
		"[--active N] [--context-blocks N] [--ring N] [--rotate S] [--seconds S] [--report S] "
		"[--seed N] [--layout scattered|front] [--threads N] [--cpu N] [--ticker-us N] "
		"[--query-pages N] [--report-blocks] [--wait] [--bind-local] [--fill-mib-s R] "
		"[--fill-burst-mib M] [--fill-min-free-mib M] [--fork-exec-ms N]\n", prog);
}

static int parse_args(int argc, char **argv)
{
	opt = (struct options){ .pool_bytes = (size_t)(1.2 * (1 << 30)), .block_bytes = 2 << 20,
		.token_bytes = 128 << 10, .prefix_bytes = 32 << 20, .active = 4, .context_blocks = 16,
		.ring = 0, .threads = 1, .cpu = -2, .ticker_us = 1000, .query_pages = 16,
		.rotate_s = 8, .seconds = 80, .report_s = 4, .seed = 1, .fork_exec_ms = 200 };
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
		int bad = 0;

		if (!strcmp(a, "--report-blocks")) { opt.report_blocks = 1; continue; }
		if (!strcmp(a, "--wait")) { opt.wait = 1; continue; }
		if (!strcmp(a, "--bind-local")) { opt.bind_local = 1; continue; }
		if (!v) { usage(argv[0]); return -1; }
		i++;
		if (!strcmp(a, "--pool")) bad = parse_size(v, &opt.pool_bytes);
		else if (!strcmp(a, "--block")) bad = parse_size(v, &opt.block_bytes);
		else if (!strcmp(a, "--token")) bad = parse_size(v, &opt.token_bytes);
		else if (!strcmp(a, "--prefix")) bad = parse_size(v, &opt.prefix_bytes);
		else if (!strcmp(a, "--active")) opt.active = atol(v);
		else if (!strcmp(a, "--context-blocks")) opt.context_blocks = atol(v);
		else if (!strcmp(a, "--ring")) opt.ring = atol(v);
		else if (!strcmp(a, "--rotate")) opt.rotate_s = atof(v);
		else if (!strcmp(a, "--seconds")) opt.seconds = atof(v);
		else if (!strcmp(a, "--report")) opt.report_s = atof(v);
		else if (!strcmp(a, "--seed")) opt.seed = strtoull(v, NULL, 0);
		else if (!strcmp(a, "--layout")) {
			opt.front = !strcmp(v, "front");
			bad = !opt.front && strcmp(v, "scattered");
		} else if (!strcmp(a, "--threads")) opt.threads = atol(v);
		else if (!strcmp(a, "--cpu")) opt.cpu = atol(v);
		else if (!strcmp(a, "--ticker-us")) opt.ticker_us = atol(v);
		else if (!strcmp(a, "--query-pages")) opt.query_pages = atol(v);
		else if (!strcmp(a, "--fill-mib-s")) opt.fill_mib_s = atof(v);
		else if (!strcmp(a, "--fill-burst-mib")) opt.fill_burst_mib = atof(v);
		else if (!strcmp(a, "--fill-min-free-mib")) opt.fill_min_free_mib = atof(v);
		else if (!strcmp(a, "--fork-exec-ms")) opt.fork_exec_ms = atol(v);
		else { usage(argv[0]); return -1; }
		if (bad) {
			fprintf(stderr, "kv_workload: bad value for %s: %s\n", a, v);
			return -1;
		}
	}
	if (!opt.ring)
		opt.ring = 2 * opt.active;
	return 0;
}

static int check_geometry(void)
{
	const char *why = NULL;

	if (opt.block_bytes < (size_t)pagesz || opt.block_bytes % pagesz)
		why = "--block must be a multiple of the page size";
	else if (opt.token_bytes < LINE_BYTES || opt.token_bytes % LINE_BYTES ||
		 opt.block_bytes % opt.token_bytes)
		why = "--token must be a multiple of 64 bytes that divides --block";
	else if (opt.active < 1 || opt.ring < opt.active)
		why = "--active must be >= 1 and --ring >= --active";
	else if (opt.context_blocks < 2)
		why = "--context-blocks must be >= 2";
	else if (opt.threads < 1 || opt.threads > opt.active)
		why = "--threads must be between 1 and --active";
	else if (opt.rotate_s <= 0 || opt.seconds <= 0 || opt.report_s <= 0)
		why = "--rotate, --seconds and --report must be positive";
	else if (opt.fill_mib_s < 0 || opt.fill_burst_mib < 0 || opt.fill_min_free_mib < 0)
		why = "--fill-mib-s and --fill-burst-mib must be >= 0";
	else if (opt.query_pages < 0)
		why = "--query-pages must be >= 0";
	if (why) {
		fprintf(stderr, "kv_workload: %s\n", why);
		return -1;
	}
	nblocks = opt.pool_bytes / opt.block_bytes;
	nprefix = (opt.prefix_bytes + opt.block_bytes - 1) / opt.block_bytes;
	if (nprefix + opt.ring * opt.context_blocks > nblocks) {
		fprintf(stderr, "kv_workload: the pool (%ld blocks) cannot hold the prefix (%ld) and %ld "
			"contexts of %ld blocks\n", nblocks, nprefix, opt.ring, opt.context_blocks);
		return -1;
	}
	tokens_per_block = opt.block_bytes / opt.token_bytes;
	nslots = nblocks * tokens_per_block;
	return 0;
}

// Which blocks are the prefix and which each request's context: the pool's first ones (front) or a
// seeded random choice (scattered).
static void lay_out(void)
{
	long *order = malloc(nblocks * sizeof(long));
	uint64_t r = opt.seed;

	for (long i = 0; i < nblocks; i++)
		order[i] = i;
	if (!opt.front)
		for (long i = nblocks - 1; i > 0; i--) {	/* Fisher–Yates */
			r = mix64(r);
			long j = (long)(r % (uint64_t)(i + 1)), t = order[i];
			order[i] = order[j];
			order[j] = t;
		}
	prefix_blocks = malloc((nprefix + 1) * sizeof(long));
	memcpy(prefix_blocks, order, nprefix * sizeof(long));
	reqs = calloc(opt.ring, sizeof(*reqs));
	for (long q = 0; q < opt.ring; q++) {
		reqs[q].blocks = malloc(opt.context_blocks * sizeof(long));
		memcpy(reqs[q].blocks, order + nprefix + q * opt.context_blocks,
		       opt.context_blocks * sizeof(long));
		reqs[q].pos = opt.context_blocks * tokens_per_block / 2;
		atomic_init(&reqs[q].owner, -1);
	}
	free(order);
}

/* --fill-min-free-mib: the fill waits while the machine has less free memory than that, as a server
 * admits no new request when its KV pool cannot grow. A machine without swap meets the OOM killer
 * otherwise whenever the fill outruns the moves that free memory (a DAX tier's, on a busy host). */
static void wait_for_room(void)
{
	struct sysinfo si;

	while (opt.fill_min_free_mib > 0 && sysinfo(&si) == 0 &&
	       (double)si.freeram * si.mem_unit / (1 << 20) < opt.fill_min_free_mib)
		usleep(20000);
}

static void fill(void)
{
	uint64_t *w = (uint64_t *)pool;
	long words_per_slot = opt.token_bytes / 8;
	double t0 = now_s(), slot_mib = (double)opt.token_bytes / (1 << 20);

	for (long s = 0; s < nslots; s++) {
		double paced_mib = s * slot_mib - opt.fill_burst_mib;

		if (opt.fill_mib_s > 0 && s % 256 == 0 && paced_mib <= 0)
			t0 = now_s();			/* the pacing's clock starts where the burst ends */
		else if (opt.fill_mib_s > 0 && s % 256 == 0) {	/* paced: sleep until the rate allows this slot */
			double ahead = paced_mib / opt.fill_mib_s - (now_s() - t0);
			if (ahead > 0)
				usleep((useconds_t)(ahead * 1e6));
		}
		if (s % 16 == 0)
			wait_for_room();
		uint64_t v = slot_base(s, 0) + (uint64_t)(s * words_per_slot) * WORD_STEP;

		for (long i = 0; i < words_per_slot; i++, v += WORD_STEP)
			w[s * words_per_slot + i] = v;
	}
}

// Reads every cache line of block b (one word each) and checks it; returns the mismatches.
static unsigned long read_block(long b)
{
	long words_per_slot = opt.token_bytes / 8, step = LINE_BYTES / 8;
	const uint64_t stride = (uint64_t)step * WORD_STEP;
	volatile uint64_t *w = (volatile uint64_t *)pool;
	unsigned long bad = 0;

	for (long s = b * tokens_per_block; s < (b + 1) * tokens_per_block; s++) {
		long first = s * words_per_slot;
		uint64_t v = slot_base(s, slot_gen[s]) + (uint64_t)first * WORD_STEP;

		for (long i = first; i < first + words_per_slot; i += step, v += stride)
			bad += w[i] != v;
	}
	return bad;
}

static void write_slot(long s)
{
	long words_per_slot = opt.token_bytes / 8, first = s * words_per_slot;
	uint32_t g = slot_gen[s] + 1;
	uint64_t v = slot_base(s, g) + (uint64_t)first * WORD_STEP;
	uint64_t *w = (uint64_t *)pool;

	for (long i = first; i < first + words_per_slot; i++, v += WORD_STEP)
		w[i] = v;
	slot_gen[s] = g;
}

static void decode_step(struct request *rq, struct counters *c)
{
	unsigned int ep = atomic_load_explicit(&epoch, memory_order_relaxed);
	long newest = rq->pos / tokens_per_block;
	unsigned long bad = 0;

	for (long i = 0; i < nprefix; i++) {
		bad += read_block(prefix_blocks[i]);
		atomic_store_explicit(&touched_epoch[prefix_blocks[i]], ep, memory_order_relaxed);
	}
	for (long i = 0; i <= newest; i++) {
		bad += read_block(rq->blocks[i]);
		atomic_store_explicit(&touched_epoch[rq->blocks[i]], ep, memory_order_relaxed);
	}
	write_slot(rq->blocks[newest] * tokens_per_block + rq->pos % tokens_per_block);
	if (++rq->pos == opt.context_blocks * tokens_per_block)
		rq->pos = opt.context_blocks * tokens_per_block / 2;	/* a new turn */
	atomic_fetch_add_explicit(&c->steps, 1, memory_order_relaxed);
	atomic_fetch_add_explicit(&c->block_reads, nprefix + newest + 1, memory_order_relaxed);
	atomic_fetch_add_explicit(&c->prefix_reads, nprefix, memory_order_relaxed);
	atomic_fetch_add_explicit(&c->bytes_read, (nprefix + newest + 1) * opt.block_bytes,
				  memory_order_relaxed);
	atomic_fetch_add_explicit(&c->bytes_written, opt.token_bytes, memory_order_relaxed);
	if (bad)
		atomic_fetch_add_explicit(&c->read_errors, bad, memory_order_relaxed);
	/* kernel time of the worker = the cost of faults it takes (hint faults, TLB shootdowns) */
	struct rusage ru;
	if (!getrusage(RUSAGE_THREAD, &ru)) {
		atomic_store_explicit(&c->user_us, ru.ru_utime.tv_sec * 1000000UL + ru.ru_utime.tv_usec,
				      memory_order_relaxed);
		atomic_store_explicit(&c->sys_us, ru.ru_stime.tv_sec * 1000000UL + ru.ru_stime.tv_usec,
				      memory_order_relaxed);
	}
}

// The active set after `events` rotations is ring positions [events, events + active); position p is
// decoded in lane p % active, so each rotation replaces the request of exactly one lane.
static long lane_request(long lane, long events)
{
	long p = events + (((lane - events) % opt.active) + opt.active) % opt.active;

	return p % opt.ring;
}

static long rotations(void)
{
	return (long)((now_s() - t0) / opt.rotate_s);
}

static void *worker(void *arg)
{
	long id = (long)arg, lanes = opt.active;
	long *held = malloc(lanes * sizeof(long));

	for (long l = 0; l < lanes; l++)
		held[l] = -1;
	while (!stop && now_s() - t0 < opt.seconds) {
		long ev = rotations();
		int stepped = 0;

		if (atomic_load(&paused)) {	/* SIGUSR1: hold still while the pool is verified */
			atomic_fetch_add(&parked, 1);
			while (atomic_load(&paused))
				usleep(1000);
			atomic_fetch_sub(&parked, 1);
			continue;
		}

		for (long l = id; l < lanes && !stop; l += opt.threads) {
			long q = lane_request(l, ev);

			if (held[l] != q) {
				int none = -1;

				if (held[l] >= 0)
					atomic_store(&reqs[held[l]].owner, -1);
				held[l] = -1;
				/* another worker may still hold it for a moment around a rotation */
				if (!atomic_compare_exchange_strong(&reqs[q].owner, &none, (int)id))
					continue;
				held[l] = q;
			}
			decode_step(&reqs[q], &counters[id]);
			stepped = 1;
		}
		if (!stepped)
			sched_yield();
	}
	for (long l = 0; l < lanes; l++)
		if (held[l] >= 0)
			atomic_store(&reqs[held[l]].owner, -1);
	free(held);
	return NULL;
}

// ---------------------------------------------------------------------------------------------
// Where the blocks are: move_pages(2) with no target nodes answers each page's node. Before v6.5
// it cannot see a page that NUMA balancing has made PROT_NONE (follow_page() honoured NUMA faults
// until commit d74943a2f3cd "mm/gup: reintroduce FOLL_NUMA as FOLL_HONOR_NUMA_FAULT") and answers
// -ENOENT (a base page) or -EFAULT (a THP: FOLL_DUMP's no_page_table()); such pages are looked up
// in /proc/self/pagemap instead (PFN → memory block → node; PFNs need CAP_SYS_ADMIN), which reads
// the page table without faulting.

struct node_count {
	long pages[MAX_NODES], other;	/* other: not present, or an error */
	long queried, via_pagemap;
};

static int pagemap_fd = -1;
static signed char *block_node;		/* memory block index → node, -1 unknown */
static long nmem_blocks;
static unsigned long mem_block_bytes;

static void load_memory_blocks(void)
{
	char path[128], name[64];
	FILE *f = fopen("/sys/devices/system/memory/block_size_bytes", "r");

	if (!f || fscanf(f, "%lx", &mem_block_bytes) != 1 || !mem_block_bytes) {
		if (f)
			fclose(f);
		return;
	}
	fclose(f);
	for (int node = 0; node < MAX_NODES; node++) {
		snprintf(path, sizeof(path), "/sys/devices/system/node/node%d", node);
		DIR *d = opendir(path);
		struct dirent *e;

		if (!d)
			continue;
		while ((e = readdir(d))) {
			long idx;

			if (sscanf(e->d_name, "memory%ld%63s", &idx, name) != 1 || idx < 0)
				continue;
			if (idx >= nmem_blocks) {
				long n = idx + 1024;
				block_node = realloc(block_node, n);
				memset(block_node + nmem_blocks, -1, n - nmem_blocks);
				nmem_blocks = n;
			}
			block_node[idx] = node;
		}
		closedir(d);
	}
	pagemap_fd = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
}

static int node_by_pagemap(const void *addr)
{
	uint64_t ent;

	if (pagemap_fd < 0 || pread(pagemap_fd, &ent, 8, (uintptr_t)addr / pagesz * 8) != 8 ||
	    !(ent >> 63 & 1))
		return -1;
	uint64_t pfn = ent & ((1ULL << 55) - 1);
	long idx = pfn ? (long)(pfn * pagesz / mem_block_bytes) : -1;	/* PFN 0: hidden */
	return idx >= 0 && idx < nmem_blocks ? block_node[idx] : -1;
}

// move_pages(2)'s status for a page, or, where it cannot see the page (-ENOENT/-EFAULT: before v6.5
// a page NUMA balancing protected reads as absent), the node pagemap places it on.
static int page_node(const void *addr, int status, long *via_pagemap)
{
	int node;

	if (status != -ENOENT && status != -EFAULT)
		return status;
	node = node_by_pagemap(addr);
	if (node >= 0 && via_pagemap)
		(*via_pagemap)++;
	return node >= 0 ? node : status;
}

static void query_blocks(const long *blocks, long n, struct node_count *nc, long *all_node0)
{
	long per = opt.query_pages ? opt.query_pages : (long)(opt.block_bytes / pagesz);
	long pages_in_block = opt.block_bytes / pagesz;

	if (per > pages_in_block)
		per = pages_in_block;
	void **pages = malloc(n * per * sizeof(void *));
	int *status = malloc(n * per * sizeof(int));
	for (long i = 0; i < n; i++)
		for (long k = 0; k < per; k++)
			pages[i * per + k] = pool + blocks[i] * opt.block_bytes +
					     (k * pages_in_block / per) * pagesz;
	memset(nc, 0, sizeof(*nc));
	if (all_node0)
		*all_node0 = 0;
	if (n && syscall(SYS_move_pages, 0, n * per, pages, NULL, status, 0) < 0) {
		nc->other = n * per;
		nc->queried = n * per;
		free(pages), free(status);
		return;
	}
	for (long i = 0; i < n; i++) {
		long on0 = 0;

		for (long k = 0; k < per; k++) {
			int st = page_node(pages[i * per + k], status[i * per + k], &nc->via_pagemap);

			if (st >= 0 && st < MAX_NODES)
				nc->pages[st]++;
			else
				nc->other++;
			on0 += st == 0;
		}
		if (all_node0 && on0 == per)
			(*all_node0)++;
	}
	nc->queried = n * per;
	free(pages), free(status);
}

static void print_nodes(const struct node_count *nc)
{
	int first = 1;

	printf("{");
	for (int n = 0; n < MAX_NODES; n++)
		if (nc->pages[n]) {
			printf("%s\"%d\": %ld", first ? "" : ", ", n, nc->pages[n]);
			first = 0;
		}
	if (nc->other)
		printf("%s\"none\": %ld", first ? "" : ", ", nc->other);
	printf("}");
}

static long *all_blocks(void)
{
	long *b = malloc(nblocks * sizeof(long));

	for (long i = 0; i < nblocks; i++)
		b[i] = i;
	return b;
}

// ---------------------------------------------------------------------------------------------

static void report(double period_s, unsigned long prev[8], long *every)
{
	unsigned int ep = atomic_fetch_add(&epoch, 1);
	long *touched = malloc(nblocks * sizeof(long)), n = 0, on0 = 0;
	struct node_count nc, pool_nc;
	unsigned long cur[8] = { 0 };

	/* >= ep: a block touched again just after the epoch moved on was touched in this period too */
	for (long b = 0; b < nblocks; b++)
		if (atomic_load_explicit(&touched_epoch[b], memory_order_relaxed) >= ep)
			touched[n++] = b;
	query_blocks(touched, n, &nc, &on0);
	query_blocks(every, nblocks, &pool_nc, NULL);
	for (long t = 0; t < opt.threads; t++) {
		cur[0] += atomic_load(&counters[t].steps);
		cur[1] += atomic_load(&counters[t].block_reads);
		cur[2] += atomic_load(&counters[t].prefix_reads);
		cur[3] += atomic_load(&counters[t].bytes_read);
		cur[4] += atomic_load(&counters[t].bytes_written);
		cur[5] += atomic_load(&counters[t].read_errors);
		cur[6] += atomic_load(&counters[t].user_us);
		cur[7] += atomic_load(&counters[t].sys_us);
	}
	long ev = rotations();
	printf("{\"event\": \"report\", \"t_s\": %.3f, \"period_s\": %.3f, \"touched_blocks\": %ld, "
	       "\"node0_share\": %.4f, \"blocks_on_node0\": %ld, \"pages_per_block\": %ld, "
	       "\"touched_pages\": ", now_s() - t0, period_s, n,
	       nc.queried > nc.other ? (double)nc.pages[0] / (nc.queried - nc.other) : 0.0, on0,
	       n ? nc.queried / n : 0);
	print_nodes(&nc);
	printf(", \"pool_pages\": ");
	print_nodes(&pool_nc);
	printf(", \"via_pagemap\": %ld, \"steps\": %lu, \"block_reads\": %lu, \"prefix_block_reads\": %lu, "
	       "\"bytes_read\": %lu, \"bytes_written\": %lu, \"read_errors\": %lu, \"rotations\": %ld, "
	       "\"active\": [", nc.via_pagemap + pool_nc.via_pagemap, cur[0] - prev[0], cur[1] - prev[1], cur[2] - prev[2], cur[3] - prev[3],
	       cur[4] - prev[4], cur[5] - prev[5], ev);
	for (long l = 0; l < opt.active; l++)
		printf("%s%ld", l ? ", " : "", lane_request(l, ev));
	printf("], \"worker_user_s\": %.3f, \"worker_sys_s\": %.3f", (cur[6] - prev[6]) / 1e6,
	       (cur[7] - prev[7]) / 1e6);
	if (opt.report_blocks) {
		printf(", \"touched\": [");
		for (long i = 0; i < n; i++)
			printf("%s%ld", i ? ", " : "", touched[i]);
		printf("]");
	}
	printf("}\n");
	fflush(stdout);
	memcpy(prev, cur, sizeof(cur));
	free(touched);
}

// Every byte of the pool against the pure function of (seed, position, slot generation).
static void verify(unsigned long *corrupt_bytes, long *first_bad)
{
	long words_per_slot = opt.token_bytes / 8;
	const uint64_t *w = (const uint64_t *)pool;

	*corrupt_bytes = 0;
	*first_bad = -1;
	for (long s = 0; s < nslots; s++) {
		long first = s * words_per_slot;
		uint64_t v = slot_base(s, slot_gen[s]) + (uint64_t)first * WORD_STEP;

		for (long i = first; i < first + words_per_slot; i++, v += WORD_STEP) {
			uint64_t x = w[i] ^ v;

			if (!x)
				continue;
			for (int k = 0; k < 8; k++)
				*corrupt_bytes += (x >> (8 * k) & 0xff) != 0;
			if (*first_bad < 0)	/* little endian: the lowest differing byte */
				*first_bad = i * 8 + __builtin_ctzll(x) / 8;
		}
	}
}

// Bind each run of blocks to the node its first page is on (experiments: see the header), found as
// query_blocks() finds it (page_node): without pagemap, on 6.1 most of the pool stayed unbound.
static long bind_local(void)
{
	long runs = 0;
	int *node = malloc(nblocks * sizeof(int));
	void **pages = malloc(nblocks * sizeof(void *));

	for (long b = 0; b < nblocks; b++)
		pages[b] = pool + b * opt.block_bytes;
	if (syscall(SYS_move_pages, 0, nblocks, pages, NULL, node, 0) < 0) {
		perror("kv_workload: move_pages (query)");
		return -1;
	}
	for (long b = 0; b < nblocks; b++)
		node[b] = page_node(pages[b], node[b], NULL);
	for (long b = 0; b < nblocks;) {
		long e = b;

		while (e < nblocks && node[e] == node[b])
			e++;
		if (node[b] >= 0 && node[b] < MAX_NODES) {
			unsigned long mask[MAX_NODES / 64] = { 0 };

			mask[node[b] / 64] |= 1UL << (node[b] % 64);
			if (syscall(SYS_mbind, pool + b * opt.block_bytes, (e - b) * opt.block_bytes,
				    MPOL_BIND | MPOL_F_NUMA_BALANCING, mask, MAX_NODES, MPOL_MF_MOVE)) {
				perror("kv_workload: mbind");
				return -1;
			}
			runs++;
		}
		b = e;
	}
	free(node), free(pages);
	return runs;
}

static void on_signal(int sig)
{
	if (sig == SIGUSR1)
		verify_asked = 1;
	else if (sig == SIGUSR2)
		fork_asked = 1;
	else
		stop = 1;
}

// SIGUSR1: park the workers (each between two decode steps), verify every byte, let them go on.
static void verify_now(long threads_running)
{
	unsigned long corrupt, read_errors = 0;
	long first_bad;

	atomic_store(&paused, 1);
	/* a worker past --seconds has left its loop and never parks: the run is ending anyway */
	while (atomic_load(&parked) < threads_running && !stop && now_s() - t0 < opt.seconds)
		usleep(1000);
	for (long t = 0; t < opt.threads; t++)
		read_errors += atomic_load(&counters[t].read_errors);
	double tv = now_s();
	verify(&corrupt, &first_bad);
	printf("{\"event\": \"verify\", \"t_s\": %.3f, \"verified_bytes\": %zu, \"corrupt_bytes\": %lu, "
	       "\"first_corrupt_offset\": %ld, \"read_errors\": %lu, \"verify_s\": %.3f, \"ok\": %s}\n",
	       tv - t0, nblocks * opt.block_bytes, corrupt, first_bad, read_errors, now_s() - tv,
	       !corrupt && !read_errors ? "true" : "false");
	fflush(stdout);
	atomic_store(&paused, 0);
}

// SIGUSR2: a child that inherits the pool, lives --fork-exec-ms, then execs /bin/true.
static void fork_exec(void)
{
	fflush(stdout);
	pid_t pid = fork();

	if (pid == 0) {
		usleep((useconds_t)opt.fork_exec_ms * 1000);
		execl("/bin/true", "true", (char *)NULL);
		_exit(127);
	}
	printf("{\"event\": \"fork\", \"t_s\": %.3f, \"child\": %d}\n", now_s() - t0, (int)pid);
	fflush(stdout);
}

static int pin(int cpu)
{
	cpu_set_t set;

	CPU_ZERO(&set);
	CPU_SET(cpu, &set);
	return sched_setaffinity(0, sizeof(set), &set);
}

// The CPUs the workers use: --cpu and the next lower allowed ones (default: the highest allowed).
static int choose_cpus(void)
{
	cpu_set_t set;
	int allowed[CPU_SETSIZE], n = 0;

	if (opt.cpu == -1)
		return 0;
	if (sched_getaffinity(0, sizeof(set), &set))
		return -1;
	for (int c = 0; c < CPU_SETSIZE; c++)
		if (CPU_ISSET(c, &set) && (opt.cpu < 0 || c <= opt.cpu))
			allowed[n++] = c;
	if (opt.cpu >= 0 && (n == 0 || allowed[n - 1] != opt.cpu)) {
		fprintf(stderr, "kv_workload: CPU %ld is not allowed\n", opt.cpu);
		return -1;
	}
	if (n < opt.threads) {
		fprintf(stderr, "kv_workload: %ld workers need %ld CPUs at or below %ld\n", opt.threads,
			opt.threads, opt.cpu);
		return -1;
	}
	for (ncpus = 0; ncpus < opt.threads; ncpus++)
		cpus[ncpus] = allowed[n - 1 - ncpus];
	cpu_set_t mine;
	CPU_ZERO(&mine);
	for (int i = 0; i < ncpus; i++)
		CPU_SET(cpus[i], &mine);
	return sched_setaffinity(0, sizeof(mine), &mine);
}

static pid_t start_ticker(int cpu)
{
	pid_t parent = getpid(), pid = fork();

	if (pid)
		return pid;
	prctl(PR_SET_PDEATHSIG, SIGKILL);
	if (getppid() != parent)
		_exit(0);
	pin(cpu);
	struct timespec ts = { opt.ticker_us / 1000000, (opt.ticker_us % 1000000) * 1000 };
	for (;;)
		nanosleep(&ts, NULL);
}

int main(int argc, char **argv)
{
	pid_t tickers[CPU_SETSIZE];
	int ntickers = 0;

	pagesz = sysconf(_SC_PAGESIZE);
	if (parse_args(argc, argv) || check_geometry())
		return 2;
	load_memory_blocks();
	if (choose_cpus())
		return 1;
	/* before the pool exists: a forked child must share none of it (copy-on-write) */
	for (int i = 0; opt.ticker_us > 0 && i < ncpus; i++)
		if ((tickers[ntickers++] = start_ticker(cpus[i])) < 0) {
			perror("kv_workload: fork");
			return 1;
		}
	signal(SIGINT, on_signal);
	signal(SIGTERM, on_signal);
	signal(SIGUSR1, on_signal);
	signal(SIGUSR2, on_signal);
	signal(SIGCHLD, SIG_IGN);	/* SIGUSR2's children: nobody waits for them */

	/* one allocation: a shim manages it as one region; blocks aligned to min(block, 2 MiB) */
	size_t align = opt.block_bytes < (2 << 20) ? opt.block_bytes : 2 << 20;
	if (align & (align - 1))
		align = pagesz;
	char *raw = malloc(nblocks * opt.block_bytes + align);
	slot_gen = calloc(nslots, sizeof(uint32_t));
	touched_epoch = calloc(nblocks, sizeof(atomic_uint));
	counters = calloc(opt.threads, sizeof(*counters));
	if (!raw || !slot_gen || !touched_epoch || !counters) {
		fprintf(stderr, "kv_workload: cannot allocate a %zu-byte pool\n", nblocks * opt.block_bytes);
		return 1;
	}
	pool = (char *)(((uintptr_t)raw + align - 1) & ~(uintptr_t)(align - 1));
	lay_out();
	double tf = now_s();
	fill();
	double fill_s = now_s() - tf;
	long bound = opt.bind_local ? bind_local() : 0;
	if (bound < 0)
		return 1;

	long *every = all_blocks();
	struct node_count pool_nc;
	query_blocks(every, nblocks, &pool_nc, NULL);
	printf("{\"event\": \"start\", \"schema\": \"kv_workload/1\", \"pid\": %d, \"pool_addr\": %lu, "
	       "\"pool_bytes\": %zu, \"block_bytes\": %zu, \"blocks\": %ld, \"token_bytes\": %zu, "
	       "\"layout\": \"%s\", \"seed\": %llu, \"active\": %ld, \"ring\": %ld, "
	       "\"context_blocks\": %ld, \"rotate_s\": %g, \"seconds\": %g, \"report_s\": %g, "
	       "\"threads\": %ld, \"bound_runs\": %ld, \"fill_s\": %.3f, \"cpus\": [",
	       getpid(), (unsigned long)pool, nblocks * opt.block_bytes, opt.block_bytes, nblocks,
	       opt.token_bytes, opt.front ? "front" : "scattered", (unsigned long long)opt.seed,
	       opt.active, opt.ring, opt.context_blocks, opt.rotate_s, opt.seconds, opt.report_s,
	       opt.threads, bound, fill_s);
	for (int i = 0; i < ncpus; i++)
		printf("%s%d", i ? ", " : "", cpus[i]);
	printf("], \"ticker_pids\": [");
	for (int i = 0; i < ntickers; i++)
		printf("%s%d", i ? ", " : "", tickers[i]);
	printf("], \"pool_pages\": ");
	print_nodes(&pool_nc);
	printf(", \"prefix\": [");
	for (long i = 0; i < nprefix; i++)
		printf("%s%ld", i ? ", " : "", prefix_blocks[i]);
	printf("], \"requests\": [");
	for (long q = 0; q < opt.ring; q++) {
		printf("%s[", q ? ", " : "");
		for (long i = 0; i < opt.context_blocks; i++)
			printf("%s%ld", i ? ", " : "", reqs[q].blocks[i]);
		printf("]");
	}
	printf("]}\n");
	fflush(stdout);
	if (opt.wait) {
		char line[64];

		if (!fgets(line, sizeof(line), stdin))
			stop = 1;
	}

	t0 = now_s();
	pthread_t *tids = calloc(opt.threads, sizeof(pthread_t));
	for (long t = 0; t < opt.threads; t++) {
		if (pthread_create(&tids[t], NULL, worker, (void *)t)) {
			fprintf(stderr, "kv_workload: pthread_create failed\n");
			return 1;
		}
		if (ncpus) {
			cpu_set_t set;
			CPU_ZERO(&set);
			CPU_SET(cpus[t], &set);
			pthread_setaffinity_np(tids[t], sizeof(set), &set);
		}
	}
	unsigned long prev[8] = { 0 };
	double last = t0;
	while (!stop) {
		if (verify_asked) {
			verify_asked = 0;
			verify_now(opt.threads);
		}
		if (fork_asked) {
			fork_asked = 0;
			fork_exec();
		}
		double next = last + opt.report_s, end = t0 + opt.seconds, now = now_s();
		if (next > end)
			next = end;
		if (now < next) {
			struct timespec ts = { (time_t)(next - now), (long)((next - now - (time_t)(next - now)) * 1e9) };
			nanosleep(&ts, NULL);	/* EINTR on a signal: stop is set */
			continue;
		}
		report(now - last, prev, every);
		last = now;
		if (now >= end)
			break;
	}
	stop = 1;
	for (long t = 0; t < opt.threads; t++)
		pthread_join(tids[t], NULL);
	for (int i = 0; i < ntickers; i++) {
		kill(tickers[i], SIGKILL);
		waitpid(tickers[i], NULL, 0);
	}

	unsigned long steps = 0, read_errors = 0, corrupt;
	long first_bad;
	for (long t = 0; t < opt.threads; t++) {
		steps += atomic_load(&counters[t].steps);
		read_errors += atomic_load(&counters[t].read_errors);
	}
	double tv = now_s();
	verify(&corrupt, &first_bad);
	int ok = !corrupt && !read_errors;
	printf("{\"event\": \"end\", \"t_s\": %.3f, \"steps\": %lu, \"verified_bytes\": %zu, "
	       "\"corrupt_bytes\": %lu, \"first_corrupt_offset\": %ld, \"read_errors\": %lu, "
	       "\"verify_s\": %.3f, \"ok\": %s}\n", tv - t0, steps, nblocks * opt.block_bytes, corrupt,
	       first_bad, read_errors, now_s() - tv, ok ? "true" : "false");
	fflush(stdout);
	return ok ? 0 : 3;
}
