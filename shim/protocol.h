/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The shim <-> daemon wire format, version 1. The Python side is tieringd/shim/protocol.py; docs/protocol.md
 * is the prose. tests/unit/test_protocol.py compiles this header and checks every size and offset
 * against the Python definitions, so the two cannot drift apart silently.
 *
 * Transport: one AF_UNIX SOCK_SEQPACKET connection per process, shim -> daemon, to
 * $TIERINGD_RUN_DIR/registry.sock (default /run/tieringd/registry.sock). Each datagram is exactly
 * one record: a 16-byte header and a fixed-size body, little-endian, no padding left implicit.
 * The same connection carries the control channel (daemon -> shim requests, types >= 32).
 */
#ifndef TIERINGD_PROTOCOL_H
#define TIERINGD_PROTOCOL_H

#include <stdint.h>

#define TRD_MAGIC   0x4b445254u /* "TRDK" as bytes on the wire */
#define TRD_VERSION 1
#define TRD_SOCKET_NAME "registry.sock"

enum trd_type {
	/* shim -> daemon */
	TRD_HELLO = 1,      /* first message of every connection */
	TRD_RESET = 2,      /* forget every region of mine; a full list follows */
	TRD_REGISTER = 3,   /* a region exists (or, same start and length: its flags changed) */
	TRD_UNREGISTER = 4, /* a region is gone */
	/* replies, both directions */
	TRD_ACK = 16,
	TRD_ERROR = 17,
	/* control channel, daemon -> shim; obeyed only when the daemon's socket belongs to uid 0 */
	TRD_PING = 32,
	TRD_PONG = 33,      /* reply to PING */
	TRD_RESYNC = 34,    /* send RESET and every region again */
	TRD_REBIND = 35,    /* mbind a range of a managed region */
	TRD_CONFIG = 36,    /* configuration from the daemon's config file */
	TRD_REMAP = 37,     /* move a range of a memfd region onto a DAX file, or back; share (carries fds) */
};

/* Region flags (trd_register.flags). Bits 16..31 are never sent. */
#define TRD_F_MEMFD     (1u << 0) /* backed by a memfd named "tieringd-kv" (else private anonymous) */
#define TRD_F_PINNED    (1u << 1) /* registered with the GPU driver: pages cannot migrate */
#define TRD_F_HUGEPAGE  (1u << 2) /* madvise(MADV_HUGEPAGE) applied */
#define TRD_F_KSM       (1u << 3) /* madvise(MADV_MERGEABLE) applied */
#define TRD_F_INHERITED (1u << 4) /* mapping inherited from the parent across fork() */
#define TRD_F_FOREIGN   (1u << 5) /* memory the shim did not map (pinned by the app): placement not applied */
#define TRD_F_WIRE_MASK 0x3fu

/* Placement policies (trd_register.policy, trd_rebind.policy, trd_config.policy). */
enum trd_policy {
	TRD_POL_NONE = 0,       /* leave placement to the kernel's default policy */
	TRD_POL_FAST = 1,       /* preferred: the DRAM node nearest the allocating CPU */
	TRD_POL_SLOW_FIRST = 2, /* preferred: the nearest CPU-less memory node */
	TRD_POL_INTERLEAVE = 3, /* MPOL_INTERLEAVE over every memory node */
	TRD_POL_WEIGHTED = 4,   /* MPOL_WEIGHTED_INTERLEAVE (kernel >= 6.9) over every memory node */
	TRD_POL_BIND = 5,       /* MPOL_BIND to an explicit nodemask (REBIND only) */
	TRD_POL_PREFERRED = 6,  /* MPOL_PREFERRED to the first node of an explicit nodemask (REBIND only) */
};

/* Where a region came from (trd_register.source). */
enum trd_source {
	TRD_SRC_MALLOC = 1, TRD_SRC_CALLOC = 2, TRD_SRC_REALLOC = 3, TRD_SRC_MEMALIGN = 4,
	TRD_SRC_MMAP = 5, TRD_SRC_CUDA_HOST_ALLOC = 6, TRD_SRC_CUDA_HOST_REGISTER = 7,
};

struct trd_hdr {
	uint32_t magic;
	uint16_t version;
	uint16_t type;
	uint32_t size;      /* whole record, header included */
	uint32_t seq;       /* sender's counter; replies quote it in ref_seq */
};

struct trd_hello {          /* TRD_HELLO, 64 bytes */
	struct trd_hdr h;
	int32_t pid;        /* must equal SO_PEERCRED's pid */
	uint32_t reserved;
	uint64_t min_bytes;
	uint8_t policy;
	uint8_t backing;    /* 0 anonymous, 1 memfd */
	uint8_t pad[6];
	char agent[24];     /* "tieringd-shim/0.1.0", NUL-padded */
};

struct trd_register {       /* TRD_REGISTER, 72 bytes */
	struct trd_hdr h;
	uint64_t region_id; /* per-process counter, for log correlation only */
	uint64_t start;
	uint64_t length;
	uint32_t flags;     /* TRD_F_* */
	uint8_t policy;     /* TRD_POL_* applied at allocation */
	uint8_t source;     /* TRD_SRC_* */
	int16_t node;       /* preferred node chosen, -1 when none */
	char tag[24];       /* $TIERINGD_TAG, NUL-padded */
};

struct trd_unregister {     /* TRD_UNREGISTER, 40 bytes */
	struct trd_hdr h;
	uint64_t region_id;
	uint64_t start;
	uint64_t length;
};

struct trd_ack {            /* TRD_ACK, 24 bytes */
	struct trd_hdr h;
	uint32_t ref_seq;
	int32_t status;     /* 0 */
};

struct trd_error {          /* TRD_ERROR, 128 bytes */
	struct trd_hdr h;
	uint32_t ref_seq;
	int32_t code;       /* a Linux errno value, positive */
	char message[104];  /* NUL-terminated, human-readable */
};

struct trd_pong {           /* TRD_PONG, 40 bytes */
	struct trd_hdr h;
	uint32_t ref_seq;
	int32_t pid;
	uint32_t nregions;
	uint32_t reserved;
	uint64_t managed_bytes;
};

struct trd_rebind {         /* TRD_REBIND, 48 bytes */
	struct trd_hdr h;
	uint64_t start;
	uint64_t length;
	uint64_t nodemask;  /* nodes 0..63; 0: derive the nodes from the policy */
	uint8_t policy;
	uint8_t flags;      /* TRD_REBIND_* */
	uint8_t pad[6];
};
#define TRD_REBIND_MOVE 1u  /* also move pages already present (MPOL_MF_MOVE) */
/* Bind with MPOL_F_NUMA_BALANCING (Linux 5.12, commit bda420b98505): NUMA balancing takes hint
 * faults on the range and migrates only within the nodemask, so a one-node mask gives hint faults
 * (an access signal) and no kernel migration. Policy bind only; a kernel that refuses says EINVAL. */
#define TRD_REBIND_NUMA_BALANCING 2u
#define TRD_REBIND_FLAGS (TRD_REBIND_MOVE | TRD_REBIND_NUMA_BALANCING)

struct trd_config {         /* TRD_CONFIG, 48 bytes */
	struct trd_hdr h;
	uint32_t fields;    /* TRD_CFG_* present in this record */
	uint8_t policy;
	uint8_t pinned_policy;
	uint8_t thp;
	uint8_t ksm;
	uint64_t min_bytes;
	uint64_t max_bytes;
	uint64_t reserved;
};
#define TRD_CFG_MIN_BYTES     (1u << 0)
#define TRD_CFG_MAX_BYTES     (1u << 1)
#define TRD_CFG_POLICY        (1u << 2)
#define TRD_CFG_PINNED_POLICY (1u << 3)
#define TRD_CFG_THP           (1u << 4)
#define TRD_CFG_KSM           (1u << 5)

struct trd_remap {          /* TRD_REMAP, 48 bytes; SCM_RIGHTS: the file, then optionally /dev/userfaultfd */
	struct trd_hdr h;
	uint64_t start;
	uint64_t length;
	uint64_t file_offset; /* where the range goes in the file (demote) or lives now (promote, the
			       * shared copy: share, unshare) */
	uint8_t direction;  /* TRD_REMAP_* */
	uint8_t flags;      /* 0 (reserved) */
	int16_t node;       /* promote, unshare: the NUMA node for the pages, -1 for the region's own policy */
	uint32_t reserved;
};
#define TRD_REMAP_DEMOTE  1 /* memory -> file: the range ends up MAP_SHARED from the file */
#define TRD_REMAP_PROMOTE 2 /* file -> memory: the range ends up on the region's memfd again */
/* The range's bytes equal the file's at file_offset (a copy published in a shared pool): its memfd
 * pages are punched and each page is filled from the file when first touched, privately (writes
 * never reach the file). docs/pool.md, "Identical KV stored once". */
#define TRD_REMAP_SHARE   3
#define TRD_REMAP_UNSHARE 4 /* a shared range: every page not filled yet is filled, then it is plain memfd */
#define TRD_REMAP_MAX_FDS 2

#define TRD_MAX_RECORD 128

_Static_assert(sizeof(struct trd_hdr) == 16, "hdr");
_Static_assert(sizeof(struct trd_hello) == 64, "hello");
_Static_assert(sizeof(struct trd_register) == 72, "register");
_Static_assert(sizeof(struct trd_unregister) == 40, "unregister");
_Static_assert(sizeof(struct trd_ack) == 24, "ack");
_Static_assert(sizeof(struct trd_error) == 128, "error");
_Static_assert(sizeof(struct trd_pong) == 40, "pong");
_Static_assert(sizeof(struct trd_rebind) == 48, "rebind");
_Static_assert(sizeof(struct trd_config) == 48, "config");
_Static_assert(sizeof(struct trd_remap) == 48, "remap");

#endif
