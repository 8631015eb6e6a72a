/* SPDX-License-Identifier: Apache-2.0 */
/* The table of managed regions (regions.c): what the shim mapped or was told about, by address.
 * Included through shim.h; every function here needs shim_lock held. */
#ifndef TIERINGD_SHIM_REGIONS_H
#define TIERINGD_SHIM_REGIONS_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#ifndef HIDDEN
#define HIDDEN __attribute__((visibility("hidden")))
#endif

#define MAX_REGIONS 65536        /* the daemon accepts as many per process (docs/protocol.md) */
#define RF_CUDA_ALLOC (1u << 16) /* made by our cudaHostAlloc: cudaFreeHost unpins and unmaps it */
#define RF_REMAPPING  (1u << 17) /* a DAX remap runs on it: free/munmap/mremap wait (remap.c) */

struct region {
	uintptr_t start;
	size_t len;              /* mapped length (what is registered) */
	uint64_t id;
	uint32_t flags;          /* TRD_F_* | RF_* */
	uint8_t policy;
	uint8_t source;
	int16_t node;
	/* TRD_F_MEMFD only: the region's memfd, kept open (a remap maps it again, and punches the pages
	 * a demotion moved out), its identity (an app may close fds it did not open), and the file
	 * offset of `start`. */
	int memfd;
	uint64_t memfd_ino;
	uint64_t memfd_off;
};

extern pthread_mutex_t shim_lock HIDDEN; /* guards the region table and the client's queue */
extern volatile size_t shim_nregions HIDDEN;

long region_find_containing(uintptr_t addr) HIDDEN;
long region_next_after(uintptr_t addr) HIDDEN; /* first region with start > addr, or -1 */
struct region *region_at(long i) HIDDEN;
int region_insert(const struct region *r) HIDDEN;
void region_remove(long i) HIDDEN;
/* Forget [lo, hi) after the app unmapped or replaced it: trims, splits or drops regions. */
void regions_forget_range(uintptr_t lo, uintptr_t hi) HIDDEN;
uint64_t region_new_id(void) HIDDEN;
size_t regions_total_bytes(void) HIDDEN;
/* Every region gets TRD_F_INHERITED and loses RF_REMAPPING (the child's side of fork). */
void regions_mark_inherited(void) HIDDEN;
/* Waits (releasing shim_lock meanwhile) until no region overlapping [lo, hi) is RF_REMAPPING. */
void regions_wait_idle(uintptr_t lo, uintptr_t hi) HIDDEN;
void regions_remap_done(void) HIDDEN; /* wakes regions_wait_idle() after RF_REMAPPING was cleared */
/* Closes a removed region's memfd, if it holds one. */
void region_release(const struct region *r) HIDDEN;

#endif
