/* SPDX-License-Identifier: Apache-2.0 */
/* A per-thread cache of freed small glibc chunks in front of glibc's own (docs/shim.md, "The
 * allocator path", small cache).
 *
 * Why it exists: an LD_PRELOAD malloc adds a call layer to every malloc and free, and on a tight
 * tcache loop (about 10 ns a pair) that layer alone costs 10-20 % (figure P1's pass-through floor).
 * Keeping the last few freed chunks of each size class here lets a malloc that follows a free be
 * answered without reaching glibc at all, which more than pays for the layer.
 *
 * What it relies on: glibc's chunk header (malloc/malloc.c, "malloc_chunk details", unchanged since
 * glibc 2.0 on 64-bit): the word before the user pointer holds the chunk size, a multiple of 16, with
 * flags in bits 0-2 (IS_MMAPPED = 2); malloc(n) returns a chunk of size (n + 23) & ~15, at least 32.
 * smallcache_init() checks this against the running glibc and leaves the cache off if the next
 * allocator is not glibc, or if malloc debugging or tuning is asked for (MALLOC_CHECK_,
 * MALLOC_PERTURB_, MALLOC_TOP_PAD_, any glibc.malloc tunable): those users want glibc to see every
 * call.
 *
 * What it keeps: chunks stay allocated as far as glibc knows; only their first two words change
 * while cached (the list link, mangled as glibc 2.32's safe-linking does, and a key that catches a
 * double free of a cached chunk). At most SC_DEPTH chunks per class and thread (2 MiB-aligned
 * pointers, managed regions, never get here); a thread's cache goes back to glibc when it exits. */
#ifndef TIERINGD_SMALLCACHE_H
#define TIERINGD_SMALLCACHE_H

#include <stddef.h>
#include <stdint.h>

#include "shim.h"

#define SC_MAX_CHUNK 1040            /* largest chunk kept */
#define SC_MAX_REQUEST (SC_MAX_CHUNK - 8) /* largest malloc() served */
#define SC_CLASSES (SC_MAX_CHUNK / 16 + 1) /* index = chunk size / 16, 2..65 */
#define SC_DEPTH 6                   /* chunks kept per class and thread */
#define SC_IS_MMAPPED 2              /* glibc chunk flag */

struct sc_thread {
	void *head[SC_CLASSES];
	uint8_t count[SC_CLASSES];
	uint8_t started;                 /* the exit hook is armed for this thread */
};

extern __thread struct sc_thread sc_tls HIDDEN __attribute__((tls_model("initial-exec")));
extern uintptr_t sc_key HIDDEN;      /* random, nonzero while the cache is on */

/* Turns the cache on; returns NULL, or why it stays off. */
const char *smallcache_init(void *(*next_malloc)(size_t), void (*next_free)(void *),
			    size_t (*next_usable)(void *)) HIDDEN;
/* A push that first arms the thread's exit hook, or checks a possible double free. */
void sc_push_slow(void *p, size_t idx) HIDDEN;
__attribute__((noreturn)) void sc_corrupt(void) HIDDEN;

/* glibc 2.32 safe-linking: the link is stored xor the address it is stored at, shifted by a page,
 * so a stray write through a dangling pointer does not hand out an address of its choosing. */
static inline uintptr_t sc_mangle(const void *where, uintptr_t link)
{
	return link ^ ((uintptr_t)where >> 12);
}

/* Put chunk e on its class's list (the class has room). */
static inline void sc_link(uintptr_t *e, size_t idx)
{
	e[0] = sc_mangle(e, (uintptr_t)sc_tls.head[idx]);
	e[1] = sc_key;
	sc_tls.head[idx] = e;
	sc_tls.count[idx]++;
}

/* A cached chunk for malloc(size), or NULL. The caller has checked size <= SC_MAX_REQUEST. */
static inline void *sc_pop(size_t size)
{
	size_t idx = (size + 23) >> 4;
	idx += idx < 2;                  /* malloc(0..8) gets the 32-byte minimum chunk */
	uintptr_t *e = sc_tls.head[idx];
	if (!e)
		return NULL;
	uintptr_t link = sc_mangle(e, e[0]);
	if (unlikely(link & 15))
		sc_corrupt();
	sc_tls.head[idx] = (void *)link;
	sc_tls.count[idx]--;
	e[1] = 0;
	return e;
}

/* Keep p (not NULL, not 2 MiB-aligned) if it is a small glibc chunk and its class has room.
 * Returns 0 when p must go on to glibc. The caller has checked that the cache is on. */
static inline int sc_push(void *p)
{
	uintptr_t *e = p;
	size_t hdr = e[-1], csize = hdr & ~(size_t)7;
	/* Anything glibc would call invalid (misaligned, odd size) or mmapped is left to glibc. */
	if (unlikely(((uintptr_t)p & 15) | (hdr & (SC_IS_MMAPPED | 8))) || csize - 32 > SC_MAX_CHUNK - 32)
		return 0;
	size_t idx = csize >> 4;
	if (sc_tls.count[idx] >= SC_DEPTH)
		return 0;
	if (unlikely(!sc_tls.started || e[1] == sc_key)) {
		sc_push_slow(p, idx); /* out of line, so the common path saves no registers */
		return 1;
	}
	sc_link(e, idx);
	return 1;
}

#endif
