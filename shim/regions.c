// SPDX-License-Identifier: Apache-2.0
// The table of managed regions: sorted by start, non-overlapping, guarded by shim_lock. Binary
// search on the slow paths only; the fast paths never look at it (docs/shim.md).
#define _GNU_SOURCE
#include <fcntl.h>
#include <string.h>
#include <unistd.h>

#include "shim.h"

pthread_mutex_t shim_lock = PTHREAD_MUTEX_INITIALIZER;
volatile size_t shim_nregions;
static struct region regions[MAX_REGIONS];
static uint64_t last_id;

uint64_t region_new_id(void) { return ++last_id; }
struct region *region_at(long i) { return &regions[i]; }

/* Index of the first region with start >= addr. */
static long lower_bound(uintptr_t addr)
{
	long lo = 0, hi = (long)shim_nregions;
	while (lo < hi) {
		long mid = (lo + hi) / 2;
		if (regions[mid].start < addr)
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo;
}

long region_find_containing(uintptr_t addr)
{
	long i = lower_bound(addr + 1) - 1;
	return (i >= 0 && addr - regions[i].start < regions[i].len) ? i : -1;
}

long region_next_after(uintptr_t addr)
{
	long i = lower_bound(addr + 1);
	return i < (long)shim_nregions ? i : -1;
}

int region_insert(const struct region *r)
{
	if (shim_nregions >= MAX_REGIONS)
		return -1;
	long i = lower_bound(r->start);
	if ((i < (long)shim_nregions && regions[i].start < r->start + r->len) ||
	    (i > 0 && regions[i - 1].start + regions[i - 1].len > r->start))
		return -1; /* overlaps */
	memmove(&regions[i + 1], &regions[i], (shim_nregions - i) * sizeof *regions);
	regions[i] = *r;
	shim_nregions++;
	return 0;
}

void region_remove(long i)
{
	memmove(&regions[i], &regions[i + 1], (shim_nregions - i - 1) * sizeof *regions);
	shim_nregions--;
}

size_t regions_total_bytes(void)
{
	size_t sum = 0;
	for (size_t i = 0; i < shim_nregions; i++)
		sum += regions[i].len;
	return sum;
}

void regions_forget_range(uintptr_t lo, uintptr_t hi)
{
	remap_share_forget(lo, hi, 0);
	long i = region_find_containing(lo);
	if (i < 0)
		i = region_next_after(lo);
	while (i >= 0 && i < (long)shim_nregions && regions[i].start < hi) {
		struct region r = regions[i];
		uintptr_t end = r.start + r.len;
		int has_memfd = r.flags & TRD_F_MEMFD, left = 0, right = 0;
		client_enqueue(TRD_UNREGISTER, &r);
		region_remove(i);
		/* What is left on either side stays a region of its own (a partial munmap). */
		struct region piece = r;
		piece.flags &= ~RF_CUDA_ALLOC;
		if (r.start < lo) {
			piece.start = r.start;
			piece.len = lo - r.start;
			piece.id = region_new_id();
			if (region_insert(&piece) == 0) {
				client_enqueue(TRD_REGISTER, &piece);
				left = 1;
				i++;
			}
		}
		if (end > hi) {
			piece.start = hi;
			piece.len = end - hi;
			piece.id = region_new_id();
			if (has_memfd) {
				/* Each piece owns its descriptor, so each can be released on its own. */
				piece.memfd_off = r.memfd_off + (hi - r.start);
				piece.memfd = left ? fcntl(r.memfd, F_DUPFD_CLOEXEC, 0) : r.memfd;
			}
			if (region_insert(&piece) == 0) {
				client_enqueue(TRD_REGISTER, &piece);
				right = 1;
			} else if (left) {
				region_release(&piece);     /* the duplicate */
			}
		}
		if (has_memfd && !left && !right)
			region_release(&r);
		if (end > hi)
			break;
	}
}

void region_release(const struct region *r)
{
	if ((r->flags & TRD_F_MEMFD) && r->memfd >= 0)
		close(r->memfd);
}

static pthread_cond_t remap_idle = PTHREAD_COND_INITIALIZER;

void regions_wait_idle(uintptr_t lo, uintptr_t hi)
{
	for (;;) {
		long i = region_find_containing(lo);
		if (i < 0)
			i = region_next_after(lo);
		int busy = 0;
		for (; i >= 0 && i < (long)shim_nregions && regions[i].start < hi; i++)
			busy |= regions[i].flags & RF_REMAPPING;
		if (!busy)
			return;
		pthread_cond_wait(&remap_idle, &shim_lock);
	}
}

void regions_remap_done(void)
{
	pthread_cond_broadcast(&remap_idle);
}

void regions_mark_inherited(void)
{
	/* A remap accepted but not started stays in the parent: the child has no remap thread. */
	for (size_t i = 0; i < shim_nregions; i++)
		regions[i].flags = (regions[i].flags | TRD_F_INHERITED) & ~RF_REMAPPING;
}
