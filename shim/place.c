// SPDX-License-Identifier: Apache-2.0
// Initial placement of managed regions with mbind(2). The shim reads the few sysfs files it needs
// itself (node masks, distances, bandwidth), once, under $TIERINGD_FS_ROOT when tests set it.
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "shim.h"

#define MPOL_DEFAULT 0
#define MPOL_PREFERRED 1
#define MPOL_BIND 2
#define MPOL_INTERLEAVE 3
#define MPOL_WEIGHTED_INTERLEAVE 6 /* Linux 6.9, commit fa3bea4e1f82 */
#define MPOL_F_NUMA_BALANCING (1 << 13) /* mode flag, Linux 5.12 (bda420b98505) */
#define MPOL_MF_MOVE (1 << 1)

static struct {
	uint64_t online, has_memory, has_cpu;
	unsigned char distance[MAX_NODES][MAX_NODES]; /* 0: unknown */
	unsigned long read_bw_mb_s[MAX_NODES];        /* HMAT access0 bandwidth, 0: unknown */
	int weighted_unsupported;
} topo;
static pthread_once_t topo_once = PTHREAD_ONCE_INIT;
static pthread_once_t weights_once = PTHREAD_ONCE_INIT;

/* Reads a small sysfs file into buf (NUL-terminated); returns length or -1. */
static int read_sys(const char *path, char *buf, size_t size)
{
	char full[256];
	shim_format(full, sizeof full, "%s%s", shim_cfg.fs_root, path);
	int fd = open(full, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -1;
	ssize_t n = read(fd, buf, size - 1);
	close(fd);
	if (n < 0)
		return -1;
	buf[n] = '\0';
	return (int)n;
}

/* Kernel list format "0-3,8" -> bitmask of nodes < 64. */
static uint64_t parse_list(const char *s)
{
	uint64_t mask = 0;
	while (*s && *s != '\n') {
		char *end;
		long lo = strtol(s, &end, 10), hi = lo;
		if (end == s)
			break;
		if (*end == '-')
			hi = strtol(end + 1, &end, 10);
		for (long i = lo; i <= hi && i < MAX_NODES; i++)
			if (i >= 0)
				mask |= 1ULL << i;
		s = *end == ',' ? end + 1 : end;
	}
	return mask;
}

static uint64_t read_mask(const char *path)
{
	char buf[256];
	return read_sys(path, buf, sizeof buf) > 0 ? parse_list(buf) : 0;
}

static void load_topology(void)
{
	char path[128], buf[512];
	topo.online = read_mask("/sys/devices/system/node/online");
	topo.has_memory = read_mask("/sys/devices/system/node/has_memory");
	topo.has_cpu = read_mask("/sys/devices/system/node/has_cpu");
	if (!topo.online)
		topo.online = topo.has_memory = topo.has_cpu = 1; /* no NUMA in this kernel: node 0 */
	for (int n = 0; n < MAX_NODES; n++) {
		if (!(topo.online & (1ULL << n)))
			continue;
		shim_format(path, sizeof path, "/sys/devices/system/node/node%d/distance", n);
		if (read_sys(path, buf, sizeof buf) > 0) {
			/* One distance per online node, in node order. */
			char *s = buf;
			for (int m = 0; m < MAX_NODES; m++) {
				if (!(topo.online & (1ULL << m)))
					continue;
				char *end;
				long d = strtol(s, &end, 10);
				if (end == s)
					break;
				topo.distance[n][m] = (unsigned char)(d > 255 ? 255 : d);
				s = end;
			}
		}
		shim_format(path, sizeof path, "/sys/devices/system/node/node%d/access0/initiators/read_bandwidth", n);
		if (read_sys(path, buf, sizeof buf) > 0)
			topo.read_bw_mb_s[n] = strtoul(buf, NULL, 10);
	}
	shim_log(LOG_DEBUG, "topology: memory nodes %lx, cpu nodes %lx", (unsigned long)topo.has_memory,
		 (unsigned long)topo.has_cpu);
}

static int distance(int from, int to)
{
	int d = topo.distance[from][to];
	return d ? d : (from == to ? 10 : 20);
}

/* The node in candidates nearest to `from` (ties: lowest id); -1 if none. */
static int nearest(int from, uint64_t candidates)
{
	int best = -1;
	for (int n = 0; n < MAX_NODES; n++)
		if ((candidates & (1ULL << n)) && (best < 0 || distance(from, n) < distance(from, best)))
			best = n;
	return best;
}

static int current_node(void)
{
	unsigned cpu = 0, node = 0;
	if (syscall(SYS_getcpu, &cpu, &node, NULL) != 0)
		return 0;
	if (shim_cfg.fs_root[0]) {
		/* Tests with a captured tree: the allocating CPU is on the first node with CPUs. */
		for (int n = 0; n < MAX_NODES; n++)
			if (topo.has_cpu & (1ULL << n))
				return n;
	}
	return (int)node < MAX_NODES ? (int)node : 0;
}

/* MPOL_WEIGHTED_INTERLEAVE takes its weights from a system-wide table
 * (/sys/kernel/mm/mempolicy/weighted_interleave/nodeN, Linux 6.9). Since 6.16 the kernel fills it
 * from HMAT bandwidth itself, and we leave it alone. On 6.9..6.15, a table still all 1 was never
 * configured: a root process writes weights proportional to the tiers' read bandwidth (so the
 * pool is spread the way the memory can serve it); otherwise the existing table applies. */
static void setup_weights(void)
{
	char path[128], buf[64];
	const char *dir = "/sys/kernel/mm/mempolicy/weighted_interleave";
	/* Linux >= 6.16 has an "auto" switch (bandwidth-derived weights, on by default): the table then
	 * belongs to the kernel and the administrator, never to us. 6.18 builds name the file
	 * "__auto_type" (the kernel's own `#define auto __auto_type` leaked into the attribute name). */
	static const char *const auto_names[] = { "auto", "__auto_type" };
	for (unsigned i = 0; i < 2; i++) {
		shim_format(path, sizeof path, "%s/%s", dir, auto_names[i]);
		if (read_sys(path, buf, sizeof buf) > 0) {
			shim_log(LOG_INFO, "weighted interleave: kernel-managed weights (%s %s)", auto_names[i],
				 buf[0] == 't' ? "true: from bandwidth" : "false: set by the administrator");
			return;
		}
	}
	unsigned long bw[MAX_NODES], maxbw = 0;
	int untouched = 1, any = 0;
	for (int n = 0; n < MAX_NODES; n++) {
		bw[n] = 0;
		if (!(topo.has_memory & (1ULL << n)))
			continue;
		shim_format(path, sizeof path, "%s/node%d", dir, n);
		if (read_sys(path, buf, sizeof buf) <= 0)
			return; /* no weighted interleave in this kernel */
		any = 1;
		if (strtoul(buf, NULL, 10) != 1)
			untouched = 0;
		/* No HMAT: the reference cost table, 400 GB/s local DRAM, 160 GB/s CXL DRAM. */
		bw[n] = topo.read_bw_mb_s[n] ? topo.read_bw_mb_s[n]
					      : (topo.has_cpu & (1ULL << n)) ? 400000 : 160000;
		if (bw[n] > maxbw)
			maxbw = bw[n];
	}
	if (!any || !untouched || geteuid() != 0) {
		shim_log(LOG_INFO, "weighted interleave: using the kernel's weight table as it is");
		return;
	}
	for (int n = 0; n < MAX_NODES; n++) {
		if (!bw[n])
			continue;
		unsigned long w = (10 * bw[n] + maxbw / 2) / maxbw;
		if (w < 1)
			w = 1;
		shim_format(path, sizeof path, "%s%s/node%d", shim_cfg.fs_root, dir, n);
		int fd = open(path, O_WRONLY | O_CLOEXEC);
		if (fd < 0)
			continue;
		int len = shim_format(buf, sizeof buf, "%lu", w);
		if (write(fd, buf, len) != len)
			shim_log(LOG_WARN, "cannot write weighted-interleave weight %lu for node %d", w, n);
		close(fd);
		shim_log(LOG_INFO, "weighted interleave: node %d weight %lu (%lu MB/s)", n, w, bw[n]);
	}
}

static long sys_mbind(void *addr, size_t len, int mode, const uint64_t *mask, unsigned flags)
{
	int move = flags & TRD_REBIND_MOVE;
	unsigned long m = mask ? (unsigned long)*mask : 0;
	/* maxnode counts one past the last bit (the kernel decrements it): 65 covers one 64-bit word. */
	return syscall(SYS_mbind, addr, len, mode, mask ? &m : NULL, mask ? MAX_NODES + 1 : 0,
		       move ? MPOL_MF_MOVE : 0);
}

int shim_place(void *addr, size_t len, int policy, uint64_t nodemask, unsigned flags, int *node_out)
{
	int saved = errno, rc = 0, node = -1, mode = MPOL_DEFAULT;
	uint64_t mask = 0;
	*node_out = -1;
	if (policy == TRD_POL_NONE && !nodemask)
		return 0;
	pthread_once(&topo_once, load_topology);
	int here = current_node();

	switch (policy) {
	case TRD_POL_NONE:
		mode = MPOL_DEFAULT;
		break;
	case TRD_POL_FAST:
		node = (topo.has_memory & topo.has_cpu & (1ULL << here)) ? here
			: nearest(here, nodemask ? nodemask : topo.has_memory & topo.has_cpu);
		mode = MPOL_PREFERRED;
		break;
	case TRD_POL_SLOW_FIRST:
		node = nearest(here, nodemask ? nodemask : topo.has_memory & ~topo.has_cpu);
		if (node < 0) {
			static int said;
			if (!said++)
				shim_log(LOG_INFO, "slow-first: no CPU-less memory node; placement left to the kernel");
			errno = saved;
			return 0;
		}
		mode = MPOL_PREFERRED;
		break;
	case TRD_POL_PREFERRED:
		node = nearest(here, nodemask);
		mode = MPOL_PREFERRED;
		break;
	case TRD_POL_BIND:
		mask = nodemask;
		mode = MPOL_BIND | ((flags & TRD_REBIND_NUMA_BALANCING) ? MPOL_F_NUMA_BALANCING : 0);
		break;
	case TRD_POL_INTERLEAVE:
	case TRD_POL_WEIGHTED:
		mask = nodemask ? nodemask : topo.has_memory;
		mode = MPOL_INTERLEAVE;
		if (policy == TRD_POL_WEIGHTED && !topo.weighted_unsupported) {
			pthread_once(&weights_once, setup_weights);
			mode = MPOL_WEIGHTED_INTERLEAVE;
		}
		break;
	default:
		errno = saved;
		return -EINVAL;
	}
	if (node >= 0)
		mask = 1ULL << node;
	if (mode != MPOL_DEFAULT && !mask) {
		errno = saved;
		return -EINVAL;
	}
	if (sys_mbind(addr, len, mode, mode == MPOL_DEFAULT ? NULL : &mask, flags) != 0) {
		rc = -errno;
		if (mode == MPOL_WEIGHTED_INTERLEAVE && rc == -EINVAL) {
			/* Kernel < 6.9: plain interleave keeps the pool spread over the tiers. */
			topo.weighted_unsupported = 1;
			shim_log(LOG_INFO, "MPOL_WEIGHTED_INTERLEAVE not supported (kernel < 6.9): interleaving evenly");
			rc = sys_mbind(addr, len, MPOL_INTERLEAVE, &mask, flags) ? -errno : 0;
		}
	}
	if (rc) {
		static int warned;
		if (!warned++)
			shim_log(LOG_WARN, "mbind(%s, nodes %lx) failed: errno %d; placement left to the kernel",
				 shim_policy_name(policy), (unsigned long)mask, -rc);
	} else {
		shim_log(LOG_DEBUG, "placed %p+%zu: %s, nodes %lx (allocating CPU on node %d)", addr, len,
			 shim_policy_name(policy), (unsigned long)mask, here);
	}
	*node_out = node;
	errno = saved;
	return rc;
}
