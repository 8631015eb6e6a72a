// SPDX-License-Identifier: Apache-2.0
// Pinned host memory. GPU servers pin their KV pools (cudaHostAlloc, cudaHostRegister); pinned
// pages cannot migrate, so their regions carry TRD_F_PINNED and the daemon only reports them.
// Placement still matters, and must happen before the driver pins (and so faults in) the pages:
// pools the shim allocates for cudaHostAlloc get TIERINGD_PINNED_POLICY (weighted interleave by
// default), and managed regions handed to cudaHostRegister are re-bound to it, pages moved.
//
// These symbols only do something when the process has a CUDA runtime loaded: the next definition
// is looked up lazily, first with RTLD_NEXT and then in any loaded library whose name contains
// "cudart" (a runtime dlopen()ed RTLD_LOCAL is not on the RTLD_NEXT path). Without one they return
// cudaErrorInsufficientDriver, as a machine without a driver would.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <string.h>

#include "shim.h"

typedef int cudaError_t;
#define cudaSuccess 0
#define cudaErrorInsufficientDriver 35
#define cudaHostAllocPortable 1
#define cudaHostAllocMapped 2
#define cudaHostAllocWriteCombined 4

struct find { const char *name; void *sym; };

static int find_in_cudart(struct dl_phdr_info *info, size_t size, void *data)
{
	(void)size;
	struct find *f = data;
	if (!info->dlpi_name || !strstr(info->dlpi_name, "cudart") || strstr(info->dlpi_name, "tieringd-shim"))
		return 0;
	void *h = dlopen(info->dlpi_name, RTLD_NOLOAD | RTLD_LAZY);
	if (!h)
		return 0;
	f->sym = dlsym(h, f->name);
	dlclose(h);
	return f->sym != NULL;
}

static void *next_sym(const char *name)
{
	void *sym = dlsym(RTLD_NEXT, name);
	if (sym)
		return sym;
	struct find f = { name, NULL };
	dl_iterate_phdr(find_in_cudart, &f);
	return f.sym;
}

#define NEXT(var, name) \
	static typeof(&name) var; \
	if (!var) \
		var = (typeof(&name))next_sym(#name)

EXPORT cudaError_t cudaHostRegister(void *ptr, size_t size, unsigned int flags);
EXPORT cudaError_t cudaHostUnregister(void *ptr);
EXPORT cudaError_t cudaHostAlloc(void **ptr, size_t size, unsigned int flags);
EXPORT cudaError_t cudaMallocHost(void **ptr, size_t size);
EXPORT cudaError_t cudaFreeHost(void *ptr);

/* Marks [ptr, ptr+size) pinned: inside a managed region, that region; otherwise a FOREIGN region
 * of its own (page-rounded), so the daemon knows those pages are off limits. Returns the policy to
 * re-place a managed region with (before pinning), or -1. */
static void mark_pinned(void *ptr, size_t size, int source, int *replace, struct region *out)
{
	uintptr_t lo = page_down((uintptr_t)ptr), hi = page_up((uintptr_t)ptr + size);
	*replace = 0;
	pthread_mutex_lock(&shim_lock);
	long i = region_find_containing(lo);
	if (i >= 0 && region_at(i)->start + region_at(i)->len >= hi && !(region_at(i)->flags & TRD_F_FOREIGN)) {
		struct region *r = region_at(i);
		if (!(r->flags & TRD_F_PINNED)) {
			r->flags |= TRD_F_PINNED;
			*replace = r->policy != shim_cfg.pinned_policy && shim_cfg.pinned_policy != TRD_POL_NONE;
			if (*replace)
				r->policy = (uint8_t)shim_cfg.pinned_policy;
			client_enqueue(TRD_REGISTER, r);
		}
		*out = *r;
	} else if (i < 0 || region_at(i)->start != lo) {
		struct region r = { .start = lo, .len = hi - lo, .id = region_new_id(),
				    .flags = TRD_F_PINNED | TRD_F_FOREIGN, .source = (uint8_t)source, .node = -1 };
		if (region_insert(&r) == 0)
			client_enqueue(TRD_REGISTER, &r);
		*out = r;
	}
	pthread_mutex_unlock(&shim_lock);
	client_kick();
}

static void unmark_pinned(void *ptr)
{
	uintptr_t lo = page_down((uintptr_t)ptr);
	pthread_mutex_lock(&shim_lock);
	long i = region_find_containing(lo);
	if (i >= 0) {
		struct region *r = region_at(i);
		if (r->flags & TRD_F_FOREIGN) {
			if (r->start == lo) {
				client_enqueue(TRD_UNREGISTER, r);
				region_remove(i);
			}
		} else if (r->flags & TRD_F_PINNED) {
			r->flags &= ~TRD_F_PINNED;
			client_enqueue(TRD_REGISTER, r);
		}
	}
	pthread_mutex_unlock(&shim_lock);
	client_kick();
}

cudaError_t cudaHostRegister(void *ptr, size_t size, unsigned int flags)
{
	NEXT(next_register, cudaHostRegister);
	if (!next_register)
		return cudaErrorInsufficientDriver;
	if (!shim_cfg.enabled || !ptr || !size)
		return next_register(ptr, size, flags);
	int replace;
	struct region r;
	mark_pinned(ptr, size, TRD_SRC_CUDA_HOST_REGISTER, &replace, &r);
	if (replace) {
		/* Before the driver pins them: pages already there move to the pinned-pool policy. */
		int node;
		shim_nest++;
		shim_place((void *)r.start, r.len, shim_cfg.pinned_policy, 0, TRD_REBIND_MOVE, &node);
		shim_nest--;
	}
	cudaError_t rc = next_register(ptr, size, flags);
	if (rc != cudaSuccess)
		unmark_pinned(ptr);
	return rc;
}

cudaError_t cudaHostUnregister(void *ptr)
{
	NEXT(next_unregister, cudaHostUnregister);
	if (!next_unregister)
		return cudaErrorInsufficientDriver;
	cudaError_t rc = next_unregister(ptr);
	if (rc == cudaSuccess && shim_cfg.enabled && ptr)
		unmark_pinned(ptr);
	return rc;
}

/* A pool the shim maps and places itself, then pins with cudaHostRegister; NULL to fall back. */
static void *pinned_pool(size_t size, unsigned int flags)
{
	NEXT(next_register, cudaHostRegister);
	if (!next_register || (flags & cudaHostAllocWriteCombined) || !shim_should_manage(size, REGION_ALIGN))
		return NULL; /* write-combined memory only the driver can make */
	void *p = shim_managed_alloc(size, REGION_ALIGN, TRD_SRC_CUDA_HOST_ALLOC, shim_cfg.pinned_policy,
				     TRD_F_PINNED | RF_CUDA_ALLOC);
	if (!p)
		return NULL;
	/* cudaHostRegisterPortable/Mapped have the same values as the cudaHostAlloc flags. */
	if (next_register(p, size, flags & (cudaHostAllocPortable | cudaHostAllocMapped)) != cudaSuccess) {
		shim_managed_free(p);
		return NULL;
	}
	return p;
}

static cudaError_t after_driver_alloc(cudaError_t rc, void **ptr, size_t size)
{
	if (rc == cudaSuccess && shim_cfg.enabled && *ptr && size) {
		int replace;
		struct region r;
		mark_pinned(*ptr, size, TRD_SRC_CUDA_HOST_ALLOC, &replace, &r);
	}
	return rc;
}

cudaError_t cudaHostAlloc(void **ptr, size_t size, unsigned int flags)
{
	NEXT(next_alloc, cudaHostAlloc);
	if (!next_alloc)
		return cudaErrorInsufficientDriver;
	void *p = shim_cfg.enabled ? pinned_pool(size, flags) : NULL;
	if (p) {
		*ptr = p;
		return cudaSuccess;
	}
	return after_driver_alloc(next_alloc(ptr, size, flags), ptr, size);
}

cudaError_t cudaMallocHost(void **ptr, size_t size)
{
	NEXT(next_malloc_host, cudaMallocHost);
	if (!next_malloc_host)
		return cudaErrorInsufficientDriver;
	void *p = shim_cfg.enabled ? pinned_pool(size, 0) : NULL;
	if (p) {
		*ptr = p;
		return cudaSuccess;
	}
	return after_driver_alloc(next_malloc_host(ptr, size), ptr, size);
}

cudaError_t cudaFreeHost(void *ptr)
{
	NEXT(next_free_host, cudaFreeHost);
	NEXT(next_unregister, cudaHostUnregister);
	if (!next_free_host)
		return cudaErrorInsufficientDriver;
	if (ptr && shim_nregions) {
		int ours = 0;
		pthread_mutex_lock(&shim_lock);
		long i = region_find_containing((uintptr_t)ptr);
		ours = i >= 0 && region_at(i)->start == (uintptr_t)ptr && (region_at(i)->flags & RF_CUDA_ALLOC);
		pthread_mutex_unlock(&shim_lock);
		if (ours) {
			if (next_unregister)
				next_unregister(ptr);
			shim_managed_free(ptr);
			return cudaSuccess;
		}
		unmark_pinned(ptr);
	}
	return next_free_host(ptr);
}
