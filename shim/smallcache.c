// SPDX-License-Identifier: Apache-2.0
// The small-chunk cache's slow parts: turning it on, a thread's exit, double frees (smallcache.h
// has the fast path and the reasoning).
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include "smallcache.h"

/* Initial-exec: the fast path reads it at a fixed %fs offset, with no __tls_get_addr call that
 * could allocate (re-entering malloc) or take a lock. */
__thread struct sc_thread sc_tls __attribute__((tls_model("initial-exec")));
uintptr_t sc_key;

static pthread_key_t exit_key;
static void (*glibc_free)(void *);

/* The exported entry points of glibc's allocator: the next allocator must be exactly these. */
extern void *__libc_malloc(size_t);
extern void __libc_free(void *);

static void sc_flush(struct sc_thread *t)
{
	for (size_t idx = 0; idx < SC_CLASSES; idx++) {
		uintptr_t *e = t->head[idx];
		while (e) {
			uintptr_t link = sc_mangle(e, e[0]);
			e[1] = 0;
			glibc_free(e);
			e = (uintptr_t *)link;
		}
		t->head[idx] = NULL;
		/* Full from now on: frees made later in this thread's exit go straight to glibc. */
		t->count[idx] = SC_DEPTH;
	}
}

static void thread_exit(void *arg)
{
	(void)arg;
	sc_flush(&sc_tls);
}

static void thread_start(void)
{
	sc_tls.started = 1;
	/* pthread_setspecific allocates nothing for the first 32 keys, and this key is made in the
	 * constructor. Should it fail, the thread keeps no cache rather than leak one at exit. */
	if (pthread_setspecific(exit_key, (void *)1) != 0)
		memset(sc_tls.count, SC_DEPTH, sizeof sc_tls.count);
}

__attribute__((noreturn)) static void die(const char *msg, size_t n)
{
	ssize_t w = write(2, msg, n);
	(void)w;
	abort();
}

static void double_free_check(void *p, size_t idx)
{
	/* The key can also be there by chance (the program stored it); only a chunk on the list is
	 * a double free. Same test and same outcome as glibc's tcache. */
	for (uintptr_t *e = sc_tls.head[idx]; e; e = (uintptr_t *)sc_mangle(e, e[0]))
		if (e == p) {
			static const char msg[] = "free(): double free detected (tieringd-shim small cache)\n";
			die(msg, sizeof msg - 1);
		}
}

void sc_push_slow(void *p, size_t idx)
{
	uintptr_t *e = p;
	if (!sc_tls.started)
		thread_start();
	if (e[1] == sc_key)
		double_free_check(p, idx);
	if (sc_tls.count[idx] >= SC_DEPTH) { /* the thread could not arm its exit hook */
		glibc_free(p);
		return;
	}
	sc_link(e, idx);
}

void sc_corrupt(void)
{
	static const char msg[] = "malloc(): corrupted free list (tieringd-shim small cache)\n";
	die(msg, sizeof msg - 1);
}

static int malloc_debugging(void)
{
	/* Read with getenv, not secure_getenv: these are glibc's own variables, and a setuid program
	 * for which glibc ignores them loses nothing by the cache staying off. */
	const char *t = getenv("GLIBC_TUNABLES");
	return getenv("MALLOC_CHECK_") || getenv("MALLOC_PERTURB_") || getenv("MALLOC_TOP_PAD_") ||
	       (t && strstr(t, "glibc.malloc."));
}

const char *smallcache_init(void *(*next_malloc)(size_t), void (*next_free)(void *),
			   size_t (*next_usable)(void *))
{
	if (next_malloc != __libc_malloc || next_free != __libc_free)
		return "the next allocator is not glibc's";
	if (malloc_debugging())
		return "glibc malloc debugging or tunables are set";
	/* The layout check: what this glibc returns for malloc(100) must be a 112-byte chunk. */
	uintptr_t *p = next_malloc(100);
	if (!p)
		return "out of memory";
	int layout_ok = (p[-1] & ~(uintptr_t)7) == 112 && !(p[-1] & SC_IS_MMAPPED) &&
			next_usable(p) == 104 && !((uintptr_t)p & 15);
	next_free(p);
	if (!layout_ok)
		return "glibc's chunk layout is not the expected one";
	uintptr_t key = 0;
	if (getrandom(&key, sizeof key, GRND_NONBLOCK) != sizeof key || !key)
		return "no random key (getrandom)";
	if (pthread_key_create(&exit_key, thread_exit) != 0)
		return "no thread-exit key";
	glibc_free = next_free;
	__atomic_store_n(&sc_key, key, __ATOMIC_RELEASE);
	return NULL;
}
