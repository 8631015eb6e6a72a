/* SPDX-License-Identifier: Apache-2.0 */
/* Internal interfaces between the shim's parts: alloc.c (interposition, region table), config.c
 * (environment, logging), place.c (NUMA placement), client.c (registry client, control channel),
 * cuda.c (pinned memory), regions.c (the region table, regions.h). Everything here is hidden; only the interposed symbols are exported. */
#ifndef TIERINGD_SHIM_H
#define TIERINGD_SHIM_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "protocol.h"

#define HIDDEN __attribute__((visibility("hidden")))
#define EXPORT __attribute__((visibility("default")))
#define likely(x) __builtin_expect(!!(x), 1)
#define unlikely(x) __builtin_expect(!!(x), 0)

#define SHIM_AGENT "tieringd-shim/0.1.0"
#define SHIM_PAGE 4096UL         /* the base page on x86-64, the one architecture the shim is built for */
#define REGION_ALIGN (2UL << 20) /* managed regions start on a 2 MiB boundary: one PMD, one THP */
#define MAX_NODES 64             /* the protocol's nodemask is 64 bits */

/* x rounded to a multiple of align (a power of two); align_up wraps to 0 past the top. */
static inline uintptr_t align_down(uintptr_t x, uintptr_t align) { return x & ~(align - 1); }
static inline uintptr_t align_up(uintptr_t x, uintptr_t align) { return (x + align - 1) & ~(align - 1); }
static inline uintptr_t page_down(uintptr_t x) { return align_down(x, SHIM_PAGE); }
static inline uintptr_t page_up(uintptr_t x) { return align_up(x, SHIM_PAGE); }

/* ---- config.c ---------------------------------------------------------------------------------- */
struct shim_config {
	int enabled;             /* TIERINGD_DISABLE=1 turns every wrapper into a pass-through */
	size_t min_bytes;        /* TIERINGD_MIN_BYTES: smallest allocation managed */
	size_t max_bytes;        /* TIERINGD_MAX_BYTES: largest (rule; default unlimited) */
	size_t min_align;        /* TIERINGD_MIN_ALIGN: only allocations asking at least this alignment */
	int policy;              /* TIERINGD_POLICY: TRD_POL_* for ordinary regions */
	int pinned_policy;       /* TIERINGD_PINNED_POLICY: for pools that will be pinned */
	int backing;             /* TIERINGD_BACKING: 0 anonymous, 1 memfd */
	int thp;                 /* TIERINGD_THP: madvise(MADV_HUGEPAGE) */
	int ksm;                 /* TIERINGD_KSM: madvise(MADV_MERGEABLE) */
	int manage_mmap;         /* TIERINGD_MMAP: also manage large anonymous mmap() calls */
	int small_cache;         /* TIERINGD_SMALL_CACHE: per-thread cache of small chunks (smallcache.h) */
	int do_register;         /* TIERINGD_REGISTER: talk to the daemon at all */
	int log_level;           /* TIERINGD_LOG: 0 silent, 1 warnings (default), 2 info, 3 debug */
	char run_dir[96];        /* TIERINGD_RUN_DIR */
	char fs_root[96];        /* TIERINGD_FS_ROOT: prefix for sysfs reads (tests) */
	char tag[24];            /* TIERINGD_TAG */
	unsigned env_set;        /* TRD_CFG_* bits set by the environment: the daemon does not override them */
};
extern struct shim_config shim_cfg HIDDEN;

void shim_config_load(void) HIDDEN;
int shim_parse_policy(const char *s) HIDDEN;
const char *shim_policy_name(int policy) HIDDEN;
/* Logging that never allocates: a tiny formatter into a stack buffer, then write(2) to fd 2.
 * Formats: %s %d %u %ld %lu %lx %zu %p %c %%. */
void shim_log(int level, const char *fmt, ...) HIDDEN __attribute__((format(printf, 2, 3)));
int shim_format(char *buf, size_t size, const char *fmt, ...) HIDDEN __attribute__((format(printf, 3, 4)));
/* A detached helper thread (256 KiB stack) that never takes the application's signals, started
 * with the shim's own allocations passed through (shim_nest). Returns 0 or the pthread error. */
int shim_start_thread(pthread_t *tid, void *(*fn)(void *)) HIDDEN;
#define LOG_WARN 1
#define LOG_INFO 2
#define LOG_DEBUG 3

#include "regions.h"

/* ---- alloc.c ----------------------------------------------------------------------------------- */
/* Used by cuda.c: a managed allocation with a given policy, and its release. */
void *shim_managed_alloc(size_t size, size_t align, int source, int policy, uint32_t extra_flags) HIDDEN;
int shim_managed_free(void *p) HIDDEN;   /* 1 if p was a managed region (now unmapped), 0 otherwise */
int shim_should_manage(size_t size, size_t align) HIDDEN;
/* The daemon's CONFIG changes the size threshold of a running process (client.c). */
void shim_apply_min_bytes(size_t min_bytes) HIDDEN;
/* Initial-exec TLS: a fixed offset from %fs, so reading it never calls __tls_get_addr, which may
 * allocate (and so re-enter malloc) the first time a thread touches a dynamic TLS block. */
extern __thread int shim_nest HIDDEN __attribute__((tls_model("initial-exec")));

/* ---- place.c ----------------------------------------------------------------------------------- */
/* Apply a policy to [addr, addr+len). nodemask != 0 overrides the nodes the policy would choose;
 * flags are TRD_REBIND_* (move present pages, NUMA-balancing bind). Returns 0 or -errno; *node_out
 * gets the preferred node (or -1). */
int shim_place(void *addr, size_t len, int policy, uint64_t nodemask, unsigned flags, int *node_out) HIDDEN;

/* ---- client.c ---------------------------------------------------------------------------------- */
void client_enqueue(int type, const struct region *r) HIDDEN; /* shim_lock held */
void client_kick(void) HIDDEN;                                /* shim_lock NOT held */
void client_fork_child(void) HIDDEN;
/* A reply produced off the client thread (remap.c): sent by the client thread on connection `gen`
 * if that connection is still up (code 0: ACK, else ERROR with msg). */
void client_post_reply(unsigned gen, uint32_t ref_seq, int code, const char *msg) HIDDEN;
unsigned client_generation(void) HIDDEN; /* the current connection's number (client thread) */

/* ---- remap.c ----------------------------------------------------------------------------------- */
/* REMAP from the daemon (client thread): checks what can be checked at once and hands the job to the
 * remap thread, which replies when done. Takes ownership of fds (closes them on every path).
 * Returns 0 when queued, else -errno with msg filled (the caller sends the ERROR). */
int remap_submit(const struct trd_remap *m, int *fds, int nfds, char *msg, size_t msg_size) HIDDEN;
/* The region table forgets [lo, hi) (shim_lock held): shared ranges there leave the table; one that
 * stays mapped in part, or any with fill (moved by mremap), is filled from its file first. */
void remap_share_forget(uintptr_t lo, uintptr_t hi, int fill) HIDDEN;
/* The connection to the daemon dropped (client thread): every shared range is unshared. */
void remap_daemon_lost(void) HIDDEN;
void remap_fork_prepare(void) HIDDEN;
void remap_fork_parent(void) HIDDEN;
void remap_fork_child(void) HIDDEN;

#endif
