// SPDX-License-Identifier: Apache-2.0
// The interposed allocator entry points, their bootstrap, managed regions and the fork handlers
// (the region table itself is regions.c).
//
// Fast path first: every wrapper compares the request with one read-mostly global and tail-calls
// the next allocator. Only requests >= TIERINGD_MIN_BYTES, and frees of 2 MiB-aligned pointers
// (managed regions always start on a 2 MiB boundary), take the slow path.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "shim.h"
#include "smallcache.h"

#ifndef MAP_FIXED_NOREPLACE
#define MAP_FIXED_NOREPLACE 0x100000
#endif
#ifndef MADV_HUGEPAGE
#define MADV_HUGEPAGE 14
#endif
#ifndef MADV_MERGEABLE
#define MADV_MERGEABLE 12
#endif

#define ALIGN_MASK (REGION_ALIGN - 1)

/* ---- the next allocator --------------------------------------------------------------------- */

/* Until resolve_next() has run, the table points at these stubs: they resolve, then forward; while
 * dlsym itself is running (shim_nest > 0 on the resolving thread) they answer from a bump buffer. */
static void *boot_malloc(size_t);
static void boot_free(void *);
static void *boot_calloc(size_t, size_t);
static void *boot_realloc(void *, size_t);
static int boot_posix_memalign(void **, size_t, size_t);
static void *boot_aligned_alloc(size_t, size_t);
static void *boot_memalign(size_t, size_t);
static void *boot_valloc(size_t);
static void *boot_pvalloc(size_t);
static size_t boot_malloc_usable_size(void *);
static void *boot_mmap(void *, size_t, int, int, int, off_t);
static int boot_munmap(void *, size_t);
static void *boot_mremap(void *, size_t, size_t, int, ...);

/* Read-mostly, kept apart from anything written often. Until the constructor has read the
 * configuration, fast_min is SIZE_MAX and every call passes straight through. */
static struct {
	size_t fast_min;      /* malloc-family requests below this pass through */
	size_t sc_max;        /* malloc requests up to this may come from the small cache (0: off) */
	size_t mmap_min;      /* mmap requests below this pass through */
	void *(*malloc)(size_t);
	void (*free)(void *);
	void *(*calloc)(size_t, size_t);
	void *(*realloc)(void *, size_t);
	int (*posix_memalign)(void **, size_t, size_t);
	void *(*aligned_alloc)(size_t, size_t);
	void *(*memalign)(size_t, size_t);
	void *(*valloc)(size_t);
	void *(*pvalloc)(size_t);
	size_t (*malloc_usable_size)(void *);
	void *(*mmap)(void *, size_t, int, int, int, off_t);
	int (*munmap)(void *, size_t);
	void *(*mremap)(void *, size_t, size_t, int, ...);
} __attribute__((aligned(64))) next = {
	.fast_min = (size_t)-1, .mmap_min = (size_t)-1,
	.malloc = boot_malloc, .free = boot_free, .calloc = boot_calloc, .realloc = boot_realloc,
	.posix_memalign = boot_posix_memalign, .aligned_alloc = boot_aligned_alloc,
	.memalign = boot_memalign, .valloc = boot_valloc, .pvalloc = boot_pvalloc,
	.malloc_usable_size = boot_malloc_usable_size,
	.mmap = boot_mmap, .munmap = boot_munmap, .mremap = boot_mremap,
};

/* Initial-exec, as lttng-ust's nesting counter: no __tls_get_addr (which may malloc) on any path. */
__thread int shim_nest __attribute__((tls_model("initial-exec")));

/* While dlsym() runs it may allocate (dlerror's buffer); those requests are answered from here.
 * Each gets a 2 MiB-aligned slot of a reserved area (only touched pages cost memory), so that
 * free()'s fast path needs no test of its own for them: like managed regions, they are 2 MiB
 * aligned, and the slow path recognises them by address and never hands them on. */
#define BUMP_SLOTS 32
#define BUMP_SPAN (BUMP_SLOTS * REGION_ALIGN)
static uintptr_t bump_base;
static unsigned bump_next;
static size_t bump_sizes[BUMP_SLOTS];

static inline int in_bump(const void *p)
{
	uintptr_t base = __atomic_load_n(&bump_base, __ATOMIC_ACQUIRE);
	return base && (uintptr_t)p - base < BUMP_SPAN;
}

static void *bump_alloc(size_t size, size_t align)
{
	if (size > REGION_ALIGN || align > REGION_ALIGN)
		return NULL;
	if (!__atomic_load_n(&bump_base, __ATOMIC_ACQUIRE)) {
		long raw = syscall(SYS_mmap, NULL, BUMP_SPAN + REGION_ALIGN, PROT_READ | PROT_WRITE,
				   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
		if (raw == -1)
			return NULL;
		uintptr_t base = align_up((uintptr_t)raw, REGION_ALIGN), none = 0;
		if (!__atomic_compare_exchange_n(&bump_base, &none, base, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
			syscall(SYS_munmap, raw, BUMP_SPAN + REGION_ALIGN); /* another thread won */
	}
	unsigned slot = __atomic_fetch_add(&bump_next, 1, __ATOMIC_ACQ_REL);
	if (slot >= BUMP_SLOTS)
		return NULL;
	bump_sizes[slot] = size;
	return (void *)(bump_base + slot * REGION_ALIGN); /* fresh anonymous memory: zero */
}

static size_t bump_size(const void *p)
{
	return bump_sizes[((uintptr_t)p - bump_base) / REGION_ALIGN];
}

static volatile int init_state; /* 0 not yet, 1 running, 2 done */

static void resolve_next(void)
{
	int expected = 0;
	if (!__atomic_compare_exchange_n(&init_state, &expected, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
		if (expected == 1 && shim_nest)
			return; /* this thread is inside dlsym: callers use the bump buffer */
		while (__atomic_load_n(&init_state, __ATOMIC_ACQUIRE) != 2)
			sched_yield();
		return;
	}
	shim_nest++;
#define R(name) typeof(next.name) name = (typeof(next.name))dlsym(RTLD_NEXT, #name)
	R(malloc); R(free); R(calloc); R(realloc); R(posix_memalign); R(aligned_alloc); R(memalign);
	R(valloc); R(pvalloc); R(malloc_usable_size); R(mmap); R(munmap); R(mremap);
#undef R
	if (!malloc || !free || !calloc || !realloc || !posix_memalign || !aligned_alloc || !memalign ||
	    !valloc || !pvalloc || !malloc_usable_size || !mmap || !munmap || !mremap) {
		static const char msg[] = "tieringd-shim: cannot find the next malloc/mmap (dlsym); aborting\n";
		ssize_t w = write(2, msg, sizeof msg - 1);
		(void)w;
		abort();
	}
	next.posix_memalign = posix_memalign; next.aligned_alloc = aligned_alloc;
	next.memalign = memalign; next.valloc = valloc; next.pvalloc = pvalloc;
	next.malloc_usable_size = malloc_usable_size;
	next.mmap = mmap; next.munmap = munmap; next.mremap = mremap;
	next.calloc = calloc; next.realloc = realloc; next.free = free;
	__atomic_store_n(&next.malloc, malloc, __ATOMIC_RELEASE);
	shim_nest--;
	__atomic_store_n(&init_state, 2, __ATOMIC_RELEASE);
}

#define BOOTSTRAPPING() (shim_nest && init_state != 2)

static void *boot_malloc(size_t size)
{
	if (BOOTSTRAPPING())
		return bump_alloc(size, 16);
	resolve_next();
	return next.malloc(size);
}

static void *boot_calloc(size_t n, size_t size)
{
	if (BOOTSTRAPPING()) {
		size_t total;
		if (__builtin_mul_overflow(n, size, &total))
			return NULL;
		return bump_alloc(total, 16);
	}
	resolve_next();
	return next.calloc(n, size);
}

static void *boot_realloc(void *p, size_t size)
{
	if (BOOTSTRAPPING()) {
		void *q = bump_alloc(size, 16);
		if (q && p && in_bump(p))
			memcpy(q, p, bump_size(p) < size ? bump_size(p) : size);
		return q;
	}
	resolve_next();
	return next.realloc(p, size);
}

static void boot_free(void *p)
{
	if (!p || in_bump(p))
		return;
	resolve_next();
	next.free(p);
}

static int boot_posix_memalign(void **out, size_t align, size_t size)
{
	if (BOOTSTRAPPING())
		return (*out = bump_alloc(size, align)) ? 0 : ENOMEM;
	resolve_next();
	return next.posix_memalign(out, align, size);
}

static void *boot_aligned_alloc(size_t align, size_t size)
{
	if (BOOTSTRAPPING())
		return bump_alloc(size, align);
	resolve_next();
	return next.aligned_alloc(align, size);
}

static void *boot_memalign(size_t align, size_t size)
{
	if (BOOTSTRAPPING())
		return bump_alloc(size, align);
	resolve_next();
	return next.memalign(align, size);
}

static void *boot_valloc(size_t size)
{
	if (BOOTSTRAPPING())
		return bump_alloc(size, SHIM_PAGE);
	resolve_next();
	return next.valloc(size);
}

static void *boot_pvalloc(size_t size)
{
	if (BOOTSTRAPPING())
		return bump_alloc(page_up(size), SHIM_PAGE);
	resolve_next();
	return next.pvalloc(size);
}

static size_t boot_malloc_usable_size(void *p)
{
	if (in_bump(p))
		return bump_size(p);
	resolve_next();
	return next.malloc_usable_size(p);
}

static void *boot_mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off)
{
	if (BOOTSTRAPPING())
		return (void *)syscall(SYS_mmap, addr, len, prot, flags, fd, off);
	resolve_next();
	return next.mmap(addr, len, prot, flags, fd, off);
}

static int boot_munmap(void *addr, size_t len)
{
	if (BOOTSTRAPPING())
		return (int)syscall(SYS_munmap, addr, len);
	resolve_next();
	return next.munmap(addr, len);
}

static void *boot_mremap(void *old, size_t old_len, size_t new_len, int flags, ...)
{
	va_list ap;
	va_start(ap, flags);
	void *want = (flags & MREMAP_FIXED) ? va_arg(ap, void *) : NULL;
	va_end(ap);
	if (BOOTSTRAPPING())
		return (void *)syscall(SYS_mremap, old, old_len, new_len, flags, want);
	resolve_next();
	return next.mremap(old, old_len, new_len, flags, want);
}

/* ---- managed regions -------------------------------------------------------------------------- */

static void *sys_mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off)
{
	return (void *)syscall(SYS_mmap, addr, len, prot, flags, fd, off);
}

static void sys_munmap(void *addr, size_t len)
{
	if (len)
		syscall(SYS_munmap, addr, len);
}

/* A mapping of exactly len bytes starting on an `align` boundary: over-map, then trim both ends. */
static void *map_aligned(size_t len, size_t align, int memfd_backing, struct region *r)
{
	size_t span = len + align;
	if (span < len)
		return NULL;
	char *raw = sys_mmap(NULL, span, memfd_backing ? PROT_NONE : PROT_READ | PROT_WRITE,
			     MAP_PRIVATE | MAP_ANONYMOUS | (memfd_backing ? MAP_NORESERVE : 0), -1, 0);
	if (raw == MAP_FAILED)
		return NULL;
	char *p = (char *)align_up((uintptr_t)raw, align);
	sys_munmap(raw, p - raw);
	sys_munmap(p + len, raw + span - (p + len));
	if (memfd_backing) {
		/* The file lets the daemon remap ranges onto DAX (remap.c): the region keeps the descriptor,
		 * to map the file again on promotion and punch the pages a demotion moved out. */
		int fd = (int)syscall(SYS_memfd_create, "tieringd-kv", 1u /* MFD_CLOEXEC */);
		struct stat st;
		if (fd >= 0 && ftruncate(fd, (off_t)len) == 0 && fstat(fd, &st) == 0 &&
		    sys_mmap(p, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) == p) {
			r->flags |= TRD_F_MEMFD;
			r->memfd = fd;
			r->memfd_ino = st.st_ino;
			r->memfd_off = 0;
			fd = -1;
		} else {
			shim_log(LOG_WARN, "memfd backing failed (errno %d); using anonymous memory", errno);
			if (sys_mmap(p, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) != p) {
				sys_munmap(p, len);
				p = NULL;
			}
		}
		if (fd >= 0)
			close(fd);
	}
	return p;
}

/* Placement and advice for a fresh mapping; fills r. */
static void prepare_region(struct region *r, void *p, size_t len, int policy, int source)
{
	int node = -1;
	shim_place(p, len, policy, 0, 0, &node);
	if (shim_cfg.thp && madvise(p, len, MADV_HUGEPAGE) == 0)
		r->flags |= TRD_F_HUGEPAGE;
	if (shim_cfg.ksm && !(r->flags & TRD_F_MEMFD) && madvise(p, len, MADV_MERGEABLE) == 0)
		r->flags |= TRD_F_KSM;
	r->start = (uintptr_t)p;
	r->len = len;
	r->policy = (uint8_t)policy;
	r->source = (uint8_t)source;
	r->node = (int16_t)node;
}

/* Inserts r and queues its registration; on failure (table full) the caller unmaps. */
static int publish(struct region *r)
{
	pthread_mutex_lock(&shim_lock);
	r->id = region_new_id();
	int rc = region_insert(r);
	if (rc == 0)
		client_enqueue(TRD_REGISTER, r);
	pthread_mutex_unlock(&shim_lock);
	if (rc == 0)
		client_kick();
	else
		shim_log(LOG_WARN, "region table full (%d regions): %p left unmanaged", MAX_REGIONS, (void *)r->start);
	return rc;
}

int shim_should_manage(size_t size, size_t align)
{
	return shim_cfg.enabled && !shim_nest && size >= shim_cfg.min_bytes && size <= shim_cfg.max_bytes &&
	       align >= shim_cfg.min_align;
}

void *shim_managed_alloc(size_t size, size_t align, int source, int policy, uint32_t extra_flags)
{
	int saved = errno;
	size_t len = align_up(size, REGION_ALIGN);
	if (len < size)
		return NULL;
	shim_nest++;
	struct region r = { .flags = extra_flags };
	void *p = map_aligned(len, align > REGION_ALIGN ? align : REGION_ALIGN, shim_cfg.backing, &r);
	if (p) {
		prepare_region(&r, p, len, policy, source);
		if (publish(&r) != 0) {
			sys_munmap(p, len);
			region_release(&r);
			p = NULL;
		}
	}
	shim_nest--;
	errno = saved;
	return p;
}

/* Index of the region starting at p that the shim mapped itself (not FOREIGN), or -1; shim_lock held. */
static long owned_region_at(const void *p)
{
	long i = region_find_containing((uintptr_t)p);
	return i >= 0 && region_at(i)->start == (uintptr_t)p && !(region_at(i)->flags & TRD_F_FOREIGN) ? i : -1;
}

/* Removes p's region from the table (p must be a region start the shim mapped itself). */
static int take_owned(void *p, struct region *out)
{
	int found = 0;
	pthread_mutex_lock(&shim_lock);
	long i = owned_region_at(p);
	if (i >= 0 && (region_at(i)->flags & RF_REMAPPING)) {
		/* A DAX remap is copying it: the unmap waits until the remap completed or rolled back. */
		regions_wait_idle((uintptr_t)p, (uintptr_t)p + 1);
		i = owned_region_at(p);
	}
	if (i >= 0) {
		*out = *region_at(i);
		remap_share_forget(out->start, out->start + out->len, 0);
		client_enqueue(TRD_UNREGISTER, out);
		region_remove(i);
		found = 1;
	}
	pthread_mutex_unlock(&shim_lock);
	return found;
}

static int lookup_owned(const void *p, struct region *out)
{
	int found = 0;
	pthread_mutex_lock(&shim_lock);
	long i = owned_region_at(p);
	if (i >= 0) {
		*out = *region_at(i);
		found = 1;
	}
	pthread_mutex_unlock(&shim_lock);
	return found;
}

int shim_managed_free(void *p)
{
	struct region r;
	if (!shim_nregions || !take_owned(p, &r))
		return 0;
	int saved = errno;
	sys_munmap((void *)r.start, r.len);
	region_release(&r);
	client_kick();
	errno = saved;
	return 1;
}

/* ---- malloc family ------------------------------------------------------------------------------ */

static void *slow_alloc(size_t size, size_t align, int source)
{
	if (shim_should_manage(size, align)) {
		void *p = shim_managed_alloc(size, align, source, shim_cfg.policy, 0);
		if (p)
			return p;
	}
	return NULL;
}

/* Out of line, so that malloc's fast paths save no registers. */
__attribute__((noinline)) static void *malloc_large(size_t size)
{
	void *p = slow_alloc(size, 16, TRD_SRC_MALLOC);
	return p ? p : next.malloc(size);
}

EXPORT void *malloc(size_t size)
{
	if (likely(size <= next.sc_max)) {
		void *p = sc_pop(size);
		return likely(p != NULL) ? p : next.malloc(size);
	}
	if (likely(size < next.fast_min))
		return next.malloc(size);
	return malloc_large(size);
}

/* 2 MiB-aligned pointers: NULL, the bootstrap buffer, managed regions, or (rarely) glibc's. */
__attribute__((noinline)) static void free_aligned(void *p)
{
	if (!p || in_bump(p))
		return;
	if (!shim_managed_free(p))
		next.free(p);
}

EXPORT void free(void *p)
{
	if (likely((uintptr_t)p & ALIGN_MASK)) {
		if (next.sc_max && sc_push(p))
			return;
		next.free(p);
		return;
	}
	free_aligned(p);
}

EXPORT void *calloc(size_t n, size_t size)
{
	size_t total;
	if (unlikely(__builtin_mul_overflow(n, size, &total)))
		return next.calloc(n, size); /* sets ENOMEM */
	if (likely(total < next.fast_min))
		return next.calloc(n, size);
	void *p = slow_alloc(total, 16, TRD_SRC_CALLOC);
	return p ? p /* a fresh mapping is zero */ : next.calloc(n, size);
}

static size_t old_size(void *p)
{
	return in_bump(p) ? bump_size(p) : next.malloc_usable_size ? next.malloc_usable_size(p) : 0;
}

EXPORT void *realloc(void *p, size_t size)
{
	if (likely(((uintptr_t)p & ALIGN_MASK) && size < next.fast_min))
		return next.realloc(p, size);
	if (!p)
		return malloc(size);

	struct region r;
	if (!in_bump(p) && shim_nregions && lookup_owned(p, &r)) {
		if (size == 0) {
			free(p);
			return NULL;
		}
		if (size <= r.len)
			return p; /* fits: same region, same registration */
		int saved = errno;
		void *q = shim_managed_alloc(size, REGION_ALIGN, TRD_SRC_REALLOC, r.policy, 0);
		if (!q) {
			q = next.malloc(size);
			if (!q)
				return NULL;
		}
		memcpy(q, p, r.len);
		free(p);
		errno = saved;
		return q;
	}
	if (in_bump(p) || shim_should_manage(size, 16)) {
		/* Grows into a managed region (or leaves the bootstrap buffer): copy what it holds. */
		void *q = in_bump(p) ? malloc(size) : slow_alloc(size, 16, TRD_SRC_REALLOC);
		if (!q)
			return in_bump(p) ? NULL : next.realloc(p, size);
		size_t n = old_size(p);
		memcpy(q, p, n < size ? n : size);
		if (!in_bump(p))
			next.free(p);
		return q;
	}
	return next.realloc(p, size);
}

static int valid_align(size_t align)
{
	return align && !(align & (align - 1));
}

EXPORT int posix_memalign(void **out, size_t align, size_t size)
{
	if (likely(size < next.fast_min))
		return next.posix_memalign(out, align, size);
	if (valid_align(align) && align % sizeof(void *) == 0) {
		void *p = slow_alloc(size, align, TRD_SRC_MEMALIGN);
		if (p) {
			*out = p;
			return 0;
		}
	}
	return next.posix_memalign(out, align, size);
}

static void *aligned_common(size_t align, size_t size, void *(*fallback)(size_t, size_t))
{
	if (valid_align(align)) {
		void *p = slow_alloc(size, align, TRD_SRC_MEMALIGN);
		if (p)
			return p;
	}
	return fallback(align, size);
}

EXPORT void *aligned_alloc(size_t align, size_t size)
{
	if (likely(size < next.fast_min))
		return next.aligned_alloc(align, size);
	return aligned_common(align, size, next.aligned_alloc);
}

EXPORT void *memalign(size_t align, size_t size)
{
	if (likely(size < next.fast_min))
		return next.memalign(align, size);
	return aligned_common(align, size, next.memalign);
}

EXPORT void *valloc(size_t size)
{
	if (likely(size < next.fast_min))
		return next.valloc(size);
	void *p = slow_alloc(size, SHIM_PAGE, TRD_SRC_MEMALIGN);
	return p ? p : next.valloc(size);
}

EXPORT void *pvalloc(size_t size)
{
	if (likely(size < next.fast_min))
		return next.pvalloc(size);
	void *p = slow_alloc(page_up(size), SHIM_PAGE, TRD_SRC_MEMALIGN);
	return p ? p : next.pvalloc(size);
}

EXPORT size_t malloc_usable_size(void *p)
{
	if (likely((uintptr_t)p & ALIGN_MASK))
		return next.malloc_usable_size(p);
	if (!p)
		return 0;
	if (in_bump(p))
		return bump_size(p);
	struct region r;
	if (shim_nregions && lookup_owned(p, &r))
		return r.len;
	return next.malloc_usable_size(p);
}

/* ---- mmap family -------------------------------------------------------------------------------- */

/* Large private anonymous read-write mappings with no address wish: what tcmalloc, jemalloc and
 * hand-rolled pools use for big buffers. Stacks, reservations (PROT_NONE, MAP_NORESERVE), huge-TLB
 * and fixed mappings pass through untouched. */
#define MMAP_PASS_FLAGS (MAP_SHARED | MAP_FIXED | MAP_FIXED_NOREPLACE | MAP_STACK | MAP_GROWSDOWN | \
			 MAP_HUGETLB | MAP_NORESERVE)

static void forget(void *addr, size_t len)
{
	if (!shim_nregions || !len)
		return;
	uintptr_t lo = page_down((uintptr_t)addr);
	uintptr_t hi = page_up((uintptr_t)addr + len);
	pthread_mutex_lock(&shim_lock);
	regions_wait_idle(lo, hi);
	regions_forget_range(lo, hi);
	pthread_mutex_unlock(&shim_lock);
	client_kick();
}

EXPORT void *mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off)
{
	if (len >= next.mmap_min && !addr && (flags & MAP_ANONYMOUS) && (flags & MAP_PRIVATE) &&
	    !(flags & MMAP_PASS_FLAGS) && (prot & (PROT_READ | PROT_WRITE)) == (PROT_READ | PROT_WRITE) &&
	    !(prot & PROT_EXEC) && shim_should_manage(len, 0)) {
		int saved = errno;
		size_t plen = page_up(len);
		shim_nest++;
		struct region r = { 0 };
		/* Exactly the pages asked for (so the app's own munmap(addr, len) frees all of it),
		 * starting on a 2 MiB boundary. */
		void *p = map_aligned(plen, REGION_ALIGN, 0, &r);
		if (p && prot != (PROT_READ | PROT_WRITE))
			mprotect(p, plen, prot);
		if (p) {
			prepare_region(&r, p, plen, shim_cfg.policy, TRD_SRC_MMAP);
			if (publish(&r) != 0) {
				sys_munmap(p, plen);
				p = NULL;
			}
		}
		shim_nest--;
		errno = saved;
		if (p)
			return p;
	}
	void *p = next.mmap(addr, len, prot, flags, fd, off);
	if (p != MAP_FAILED && (flags & MAP_FIXED))
		forget(p, len);
	return p;
}

EXPORT void *mmap64(void *addr, size_t len, int prot, int flags, int fd, off_t off)
	__attribute__((alias("mmap")));

EXPORT int munmap(void *addr, size_t len)
{
	/* Forget first: once unmapped, another thread could map (and register) the same addresses. */
	if (shim_nregions && page_down((uintptr_t)addr) == (uintptr_t)addr && len)
		forget(addr, len);
	return next.munmap(addr, len);
}

EXPORT void *mremap(void *old, size_t old_len, size_t new_len, int flags, ...)
{
	void *want = NULL;
	if (flags & MREMAP_FIXED) {
		va_list ap;
		va_start(ap, flags);
		want = va_arg(ap, void *);
		va_end(ap);
	}
	if (!shim_nregions)
		return next.mremap(old, old_len, new_len, flags, want);

	/* A whole region moved or resized by the app keeps being managed; anything else is forgotten.
	 * The VMA's mempolicy travels with it, so placement needs no redoing. */
	struct region r;
	int whole = 0;
	pthread_mutex_lock(&shim_lock);
	regions_wait_idle((uintptr_t)old, (uintptr_t)old + page_up(old_len));
	if (want)
		regions_wait_idle((uintptr_t)want, (uintptr_t)want + page_up(new_len));
	long i = owned_region_at(old);
	if (i >= 0 && region_at(i)->len == page_up(old_len) && !(flags & MREMAP_DONTUNMAP)) {
		r = *region_at(i);
		whole = 1;
	}
	/* A shared range moves without its registration (no UFFD_FEATURE_EVENT_REMAP): filled first. */
	remap_share_forget((uintptr_t)old, (uintptr_t)old + page_up(old_len), 1);
	regions_forget_range((uintptr_t)old, (uintptr_t)old + page_up(old_len));
	if (want)
		regions_forget_range((uintptr_t)want, (uintptr_t)want + page_up(new_len));
	pthread_mutex_unlock(&shim_lock);

	void *p = next.mremap(old, old_len, new_len, flags, want);
	if (p != MAP_FAILED && whole && new_len) {
		r.start = (uintptr_t)p;
		r.len = page_up(new_len);
		publish(&r);
	} else if (p == MAP_FAILED && whole) {
		publish(&r); /* unchanged: register it again */
	} else {
		client_kick();
	}
	return p;
}

/* ---- process lifecycle ---------------------------------------------------------------------------- */

static void fork_prepare(void)
{
	remap_fork_prepare(); /* a remap in progress finishes first: the child copies a settled range */
	pthread_mutex_lock(&shim_lock);
}

static void fork_parent(void)
{
	pthread_mutex_unlock(&shim_lock);
	remap_fork_parent();
}

static void fork_child(void)
{
	pthread_mutex_init(&shim_lock, NULL);
	remap_fork_child();
	/* The child owns copy-on-write copies of every region at the same addresses. */
	regions_mark_inherited();
	client_fork_child();
}

/* The small cache serves malloc() below both its own limit and the managed-size threshold. */
static void set_sc_max(void)
{
	size_t m = __atomic_load_n(&sc_key, __ATOMIC_ACQUIRE) ? SC_MAX_REQUEST : 0;
	if (m && m >= shim_cfg.min_bytes)
		m = shim_cfg.min_bytes - 1;
	__atomic_store_n(&next.sc_max, m, __ATOMIC_RELEASE);
}

__attribute__((constructor(101))) static void shim_init(void)
{
	resolve_next();
	shim_config_load();
	if (!shim_cfg.enabled)
		return;
	pthread_atfork(fork_prepare, fork_parent, fork_child);
	__atomic_store_n(&next.mmap_min, shim_cfg.manage_mmap ? shim_cfg.min_bytes : (size_t)-1, __ATOMIC_RELEASE);
	__atomic_store_n(&next.fast_min, shim_cfg.min_bytes, __ATOMIC_RELEASE);
	const char *why_not = shim_cfg.small_cache ?
		smallcache_init(next.malloc, next.free, next.malloc_usable_size) : "TIERINGD_SMALL_CACHE=0";
	set_sc_max();
	shim_log(LOG_INFO, "managing allocations >= %zu bytes, policy %s", shim_cfg.min_bytes,
		 shim_policy_name(shim_cfg.policy));
	if (why_not)
		shim_log(LOG_INFO, "small cache off: %s", why_not);
	else
		shim_log(LOG_INFO, "small cache on: up to %d chunks of each size to %d bytes per thread",
			 SC_DEPTH, SC_MAX_REQUEST);
}

/* The daemon's CONFIG message changes the size threshold at run time. */
void shim_apply_min_bytes(size_t min_bytes)
{
	shim_cfg.min_bytes = min_bytes;
	__atomic_store_n(&next.mmap_min, shim_cfg.manage_mmap ? min_bytes : (size_t)-1, __ATOMIC_RELEASE);
	__atomic_store_n(&next.fast_min, min_bytes, __ATOMIC_RELEASE);
	set_sc_max();
}
