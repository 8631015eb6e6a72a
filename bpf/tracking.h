/* SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause */
/* What every sampler shares with the daemon: the tracked set (processes, address ranges) that the
 * daemon writes, the per-(tgid, block) aggregate it reads, the optional raw-sample record and the
 * statistics slots. Fixed-width types only; tieringd/sampling/tracking.py mirrors each struct and
 * checks its size against the map's key/value size at load time. */
#ifndef __TIERINGD_TRACKING_H
#define __TIERINGD_TRACKING_H

#define TRACKED_PIDS_MAX	4096
/* Prefix entries, not ranges: a range becomes at most ~2×47 aligned prefixes, page-aligned KV
 * allocations usually a handful (tieringd/sampling/tracking.py: range_prefixes). */
#define TRACKED_PREFIXES_MAX	65536
#define BLOCKS_MAX_DEFAULT	32768	/* per epoch map; only blocks touched in one interval need room */
#define RAW_RING_BYTES_DEFAULT	(256 * 1024)

/* tracked_pid.flags */
#define TRACK_ALL_ADDRS		0x1	/* count addresses outside registered ranges too, in default blocks */

/* tracked_pids: tgid → how to account it. */
struct tracked_pid {
	__u32 flags;
	__u32 default_block_shift;	/* log2 of the block size for addresses outside ranges */
};

/* tracked_ranges: an LPM trie over (tgid, address), both big-endian so that a prefix of the key
 * bytes is a prefix of the (tgid, address) pair. prefixlen counts bits of tgid_be then addr_be:
 * 32 + n matches the n high bits of the address within that tgid. */
struct range_key {
	__u32 prefixlen;
	__u32 tgid_be;
	__u64 addr_be;
};

/* One registered range; every prefix of the range maps to the same value. Blocks are counted from
 * the range start in block_len steps (KV blocks need not be a power of two: tokens × bytes/token). */
struct range_val {
	__u64 start;
	__u64 len;
	__u64 block_len;
};

/* blocks0/blocks1 (LRU hashes, one per epoch parity): the aggregate per (tgid, block). */
struct block_key {
	__u32 tgid;
	__u32 pad;
	__u64 block_start;
};

struct block_val {
	__u64 count;		/* samples in the block this epoch */
	__u64 last_seen_ns;	/* bpf_ktime_get_ns() == CLOCK_MONOTONIC */
	__u64 extra;		/* tool-specific, see the tool's header */
	__u64 block_len;
};

/* control[0]: the daemon flips epoch each interval; programs count into blocks<epoch & 1>, the
 * daemon reads and empties the other one. */
struct control {
	__u32 epoch;
	__u32 pad;
};

/* events (ring buffer, only when targ_raw is set): one record per counted sample. */
struct sample_event {
	__u64 ts_ns;
	__u64 addr;
	__u64 ip;		/* faulting / probed instruction */
	__u64 len;		/* bytes (DMA copies), 0 otherwise */
	__u32 tgid;
	__u32 tid;
	__u32 kind;		/* tool-specific: error code, API id … */
	__u32 aux;		/* tool-specific: direction … */
};

/* stats (per-CPU array) slots. */
enum tracking_stat {
	STAT_EVENTS = 0,	/* program invocations */
	STAT_UNTRACKED_PID,	/* tgid not in tracked_pids */
	STAT_OUTSIDE_RANGES,	/* tracked tgid, address in no range (and TRACK_ALL_ADDRS unset) */
	STAT_COUNTED,		/* samples added to a block */
	STAT_BLOCK_FULL,	/* could not insert a new block (map full even after LRU eviction) */
	STAT_RAW_DROPPED,	/* ring buffer full */
	STAT_TRUNCATED,		/* DMA copy spanning more blocks than one probe walks */
	STAT_FILTERED,		/* dropped by a tool-specific filter (e.g. not a protection fault) */
	STAT_NO_ADDR,		/* sample without a data address (PMU) */
	STAT__MAX = 16,
};

#endif /* __TIERINGD_TRACKING_H */
