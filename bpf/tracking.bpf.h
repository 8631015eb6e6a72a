/* SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause */
/* Kernel side of bpf/tracking.h, included by every sampler: the maps the daemon writes (tracked_pids,
 * tracked_ranges, control), the maps it reads (blocks0/1, stats, events) and the in-kernel filter and
 * aggregation. Each object gets its own copy of these maps; the loader makes the tracked_* maps of
 * all samplers one kernel map (bpf_map__reuse_fd), so the daemon writes the tracked set once. */
#ifndef __TIERINGD_TRACKING_BPF_H
#define __TIERINGD_TRACKING_BPF_H

#include "tracking.h"

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, TRACKED_PIDS_MAX);
	__type(key, __u32);
	__type(value, struct tracked_pid);
} tracked_pids SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, TRACKED_PREFIXES_MAX);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct range_key);
	__type(value, struct range_val);
} tracked_ranges SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, STAT__MAX);
	__type(key, __u32);
	__type(value, __u64);
} stats SEC(".maps");

static __always_inline void stat_inc(__u32 idx)
{
	__u64 *v = bpf_map_lookup_elem(&stats, &idx);

	if (v)
		*v += 1;	/* per-CPU slot: no atomics needed */
}

/* A tool that only needs the tracked set (migrations) defines TRACKING_FILTER_ONLY and gets no
 * block maps or ring buffer. */
#ifndef TRACKING_FILTER_ONLY

/* Settings the loader fills before load (rodata). */
const volatile bool targ_raw = false;	/* also send each counted sample to the ring buffer */

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct control);
} control SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, BLOCKS_MAX_DEFAULT);
	__type(key, struct block_key);
	__type(value, struct block_val);
} blocks0 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, BLOCKS_MAX_DEFAULT);
	__type(key, struct block_key);
	__type(value, struct block_val);
} blocks1 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, RAW_RING_BYTES_DEFAULT);
} events SEC(".maps");

/* Highest user-space address on x86-64 with 5-level paging (4-level stops at 2^47); page_fault_kernel
 * also fires for kernel addresses, which are never ours. */
#define USER_ADDR_END (1ULL << 56)

/* The block holding addr in process tgid, or false when the sample is not ours. */
static __always_inline bool tracked_block(__u32 tgid, __u64 addr, struct block_key *key,
					  __u64 *block_len)
{
	struct tracked_pid *tp;
	struct range_val *rv;
	struct range_key rk;

	tp = bpf_map_lookup_elem(&tracked_pids, &tgid);
	if (!tp) {
		stat_inc(STAT_UNTRACKED_PID);
		return false;
	}
	rk.prefixlen = 32 + 64;
	rk.tgid_be = bpf_htonl(tgid);
	rk.addr_be = __builtin_bswap64(addr);
	rv = bpf_map_lookup_elem(&tracked_ranges, &rk);
	key->tgid = tgid;
	key->pad = 0;
	if (rv && addr >= rv->start && addr - rv->start < rv->len && rv->block_len) {
		__u64 idx = (addr - rv->start) / rv->block_len;

		key->block_start = rv->start + idx * rv->block_len;
		*block_len = rv->block_len;
		return true;
	}
	if (tp->flags & TRACK_ALL_ADDRS) {
		__u32 shift = tp->default_block_shift & 63;

		key->block_start = addr & ~((1ULL << shift) - 1);
		*block_len = 1ULL << shift;
		return true;
	}
	stat_inc(STAT_OUTSIDE_RANGES);
	return false;
}

static __always_inline void count_in(void *blocks, struct block_key *key, __u64 block_len,
				     __u64 now, __u64 extra)
{
	struct block_val *v, init = {};

	v = bpf_map_lookup_elem(blocks, key);
	if (!v) {
		init.count = 1;
		init.last_seen_ns = now;
		init.extra = extra;
		init.block_len = block_len;
		if (bpf_map_update_elem(blocks, key, &init, BPF_NOEXIST) == 0) {
			stat_inc(STAT_COUNTED);
			return;
		}
		/* -EEXIST: another CPU created it first; anything else: no room */
		v = bpf_map_lookup_elem(blocks, key);
		if (!v) {
			stat_inc(STAT_BLOCK_FULL);
			return;
		}
	}
	__sync_fetch_and_add(&v->count, 1);
	if (extra)
		__sync_fetch_and_add(&v->extra, extra);
	v->last_seen_ns = now;	/* racy by design: any recent stamp will do */
	stat_inc(STAT_COUNTED);
}

/* Adds one sample to the current epoch's block map. */
static __always_inline void count_block(struct block_key *key, __u64 block_len, __u64 now,
					__u64 extra)
{
	__u32 zero = 0;
	struct control *c = bpf_map_lookup_elem(&control, &zero);

	if (c && (c->epoch & 1))
		count_in(&blocks1, key, block_len, now, extra);
	else
		count_in(&blocks0, key, block_len, now, extra);
}

static __always_inline void emit_raw(__u64 now, __u64 pid_tgid, __u64 addr, __u64 ip, __u64 len,
				     __u32 kind, __u32 aux)
{
	struct sample_event *e;

	if (!targ_raw)
		return;
	e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
	if (!e) {
		stat_inc(STAT_RAW_DROPPED);
		return;
	}
	e->ts_ns = now;
	e->addr = addr;
	e->ip = ip;
	e->len = len;
	e->tgid = pid_tgid >> 32;
	e->tid = (__u32)pid_tgid;
	e->kind = kind;
	e->aux = aux;
	bpf_ringbuf_submit(e, 0);
}

#endif /* !TRACKING_FILTER_ONLY */

#endif /* __TIERINGD_TRACKING_BPF_H */
