// SPDX-License-Identifier: Apache-2.0
// DAX remapping: a range of a memfd-backed region moves onto a file on persistent memory (a file on
// an fsdax mount, or a devdax device) and back, inside the process, while its threads keep running.
// The daemon only chooses the range and the file offset (its append-only log, tieringd/shim/pmemlog.py);
// the copy happens here, so a daemon that dies mid-remap (kill -9) changes nothing: the job runs to
// its end or rolls back on its own. docs/dax.md has the reasoning; in short:
//
// Demote (memory -> file), pre-copy under userfaultfd write-protect (shmem: Linux 6.1):
//   write-protect the memfd range -> pwrite(2) it into the file -> mmap(MAP_FIXED) the file over the
//   range -> wake the writers -> punch the memfd pages (the DRAM comes back). A write during the copy,
//   from user mode or from the kernel (read(2) into the buffer), waits in the kernel until the file
//   mapping is in place, then lands there: never lost, never EFAULT.
// Promote (file -> memory), post-copy under userfaultfd missing faults (shmem: 4.11):
//   a new mapping of the (punched) memfd range, registered for missing faults, replaces the file
//   mapping with one mremap(2) (UFFD_FEATURE_EVENT_REMAP keeps the registration on the moved VMA);
//   an access to a page not copied yet waits until the fault thread has filled it from the file; this
//   thread copies the rest in bulk (UFFDIO_COPY places each page exactly once). The file is only
//   read: nothing written there after the switch can exist.
//
// Share (a copy of the range's bytes published in a shared pool), userfaultfd missing faults again:
//   the range stays the memfd, its pages are punched, and a persistent fill server places each page
//   from the pool's copy when it is first touched; every write goes to that private page.
//
// All need a userfaultfd that also handles faults taken in kernel mode: userfaultfd(2) from a
// privileged process, or USERFAULTFD_IOC_NEW on the /dev/userfaultfd descriptor (Linux 6.1) the daemon
// sends along. A user-mode-only one would let read(2) into the range fail with EFAULT: never used.
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysinfo.h>
#include <time.h>
#include <unistd.h>

#include "shim.h"

#ifndef UFFD_FEATURE_WP_HUGETLBFS_SHMEM
#define UFFD_FEATURE_WP_HUGETLBFS_SHMEM (1 << 12) /* Linux 6.1 */
#endif
#ifndef UFFD_FEATURE_WP_UNPOPULATED
#define UFFD_FEATURE_WP_UNPOPULATED (1 << 13)     /* Linux 6.4: protect pages never touched too */
#endif
#ifndef USERFAULTFD_IOC_NEW
#define USERFAULTFD_IOC_NEW _IO(0xAA, 0x00)       /* /dev/userfaultfd, Linux 6.1 */
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23                    /* Linux 5.14 */
#endif

#define CHUNK (2UL << 20) /* copy unit: one PMD */

struct job {
	uint32_t ref_seq;
	unsigned gen;              /* the connection the request came on; the reply goes there only */
	int direction;
	uintptr_t start;
	size_t len;
	uint64_t file_off;
	int node;
	int filefd, devfd;         /* received with the request; closed when the job ends */
	int memfd;                 /* the region's (not ours to close) */
	uint64_t memfd_ino, memfd_off; /* of start */
	void *window;              /* devdax: a mapping of the extent to copy through */
};

static struct {
	pthread_mutex_t lock;      /* guards queued/has_job/started */
	pthread_cond_t cond;
	pthread_mutex_t running;   /* held for a whole job: fork() waits for it */
	int started, has_job;
	int unshare_all;           /* the daemon is gone: unshare every shared range (after the job) */
	struct job job;
} rm = { PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, 0, 0, 0, { 0 } };

/* ---- /proc/self/maps ------------------------------------------------------------------------------ */

struct vma_row {
	uintptr_t start, end;
	char perms[5];
	uint64_t offset;
	unsigned long inode;
};

static int parse_row(const char *s, struct vma_row *v)
{
	char *e;
	v->start = strtoul(s, &e, 16);
	if (*e != '-')
		return -1;
	v->end = strtoul(e + 1, &e, 16);
	if (*e != ' ')
		return -1;
	memcpy(v->perms, e + 1, 4);
	v->perms[4] = '\0';
	v->offset = strtoull(e + 6, &e, 16);
	strtoul(e + 1, &e, 16);               /* dev major */
	strtoul(e + 1, &e, 16);               /* dev minor */
	v->inode = strtoul(e + 1, &e, 10);
	return 0;
}

/* Is [start, start+len) mapped without a hole by shared read-write VMAs of inode `ino`, at file
 * offsets following on from `off` at `start`? That is the state a demote starts from (the memfd) and
 * a promote starts from (the file); anything else means the daemon's request is out of date. The
 * file is read in pieces into a stack buffer: no allocation. */
static int range_maps_file(uintptr_t start, size_t len, unsigned long ino, uint64_t off)
{
	int fd = open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -errno;
	char buf[4096];
	size_t have = 0;
	uintptr_t pos = start, end = start + len;
	int ok = 0;
	for (;;) {
		ssize_t n = read(fd, buf + have, sizeof buf - 1 - have);
		if (n <= 0)
			break;
		have += (size_t)n;
		buf[have] = '\0';
		char *line = buf, *nl;
		while ((nl = strchr(line, '\n'))) {
			*nl = '\0';
			struct vma_row v;
			if (parse_row(line, &v) == 0 && v.end > pos && v.start <= pos) {
				if (strcmp(v.perms, "rw-s") != 0 || v.inode != ino ||
				    v.offset + (pos - v.start) != off + (pos - start))
					goto out;
				pos = v.end;
				if (pos >= end) {
					ok = 1;
					goto out;
				}
			} else if (v.start > pos) {
				goto out; /* a hole */
			}
			line = nl + 1;
		}
		have = strlen(line);
		memmove(buf, line, have);
	}
out:
	close(fd);
	return ok ? 0 : -EINVAL;
}

/* ---- userfaultfd --------------------------------------------------------------------------------- */

static int uffd_raw(int devfd)
{
	int fd = (int)syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK);
	if (fd < 0 && errno == EPERM && devfd >= 0)
		fd = ioctl(devfd, USERFAULTFD_IOC_NEW, O_CLOEXEC | O_NONBLOCK);
	return fd;
}

/* A userfaultfd with `need` features (and those of `want` the kernel has); -errno on failure, with
 * the reason in msg. The features are probed on a first descriptor: UFFDIO_API takes one call. */
static int uffd_open(uint64_t need, uint64_t want, int devfd, uint64_t *got, char *msg, size_t size)
{
	int fd = uffd_raw(devfd);
	if (fd < 0) {
		int e = errno;
		shim_format(msg, size, "no userfaultfd for kernel-mode faults (%s): the daemon sends "
			    "/dev/userfaultfd (6.1+)", strerror(e));
		return -(e == EPERM || e == EACCES ? EPERM : e);
	}
	struct uffdio_api api = { .api = UFFD_API, .features = 0 };
	int rc = ioctl(fd, UFFDIO_API, &api);
	close(fd);
	if (rc != 0 || (api.features & need) != need) {
		shim_format(msg, size, "userfaultfd lacks features %lx (kernel has %lx)",
			    (unsigned long)need, (unsigned long)(rc ? 0 : api.features));
		return -EOPNOTSUPP;
	}
	*got = api.features & (need | want);
	fd = uffd_raw(devfd);
	struct uffdio_api real = { .api = UFFD_API, .features = *got };
	if (fd < 0 || ioctl(fd, UFFDIO_API, &real) != 0) {
		int e = errno;
		if (fd >= 0)
			close(fd);
		shim_format(msg, size, "UFFDIO_API: %s", strerror(e));
		return -e;
	}
	return fd;
}

static int uffd_range(int uffd, unsigned long cmd, uintptr_t start, size_t len)
{
	struct uffdio_range r = { start, len };
	return ioctl(uffd, cmd, &r);
}

static int uffd_register(int uffd, uintptr_t start, size_t len, uint64_t mode)
{
	struct uffdio_register reg = { .range = { start, len }, .mode = mode };
	return ioctl(uffd, UFFDIO_REGISTER, &reg);
}

static int uffd_protect(int uffd, uintptr_t start, size_t len, int on)
{
	struct uffdio_writeprotect wp = { .range = { start, len }, .mode = on ? UFFDIO_WRITEPROTECT_MODE_WP : 0 };
	return ioctl(uffd, UFFDIO_WRITEPROTECT, &wp);
}

/* ---- copying -------------------------------------------------------------------------------------- */

static void *sys_map(void *addr, size_t len, int flags, int fd, uint64_t off)
{
	return (void *)syscall(SYS_mmap, addr, len, PROT_READ | PROT_WRITE, flags, fd, (off_t)off);
}

/* A devdax device is a character device with mmap and nothing else: the job copies through a
 * mapping of its extent (the window). A file (fsdax, or any file in tests) is copied with pwrite/
 * pread, so that a media error is an errno rather than a SIGBUS in the application. */
static int window_open(struct job *j)
{
	struct stat st;
	if (fstat(j->filefd, &st) != 0)
		return -errno;
	if (!S_ISCHR(st.st_mode))
		return 0;
	void *w = sys_map(NULL, j->len, MAP_SHARED, j->filefd, j->file_off);
	if (w == MAP_FAILED)
		return -errno;
	j->window = w;
	return 0;
}

static void window_close(struct job *j)
{
	if (j->window)
		syscall(SYS_munmap, j->window, j->len);
	j->window = NULL;
}

/* Copies n bytes at `at` (an offset in the job's range) between memory and the file. */
static int file_io(const struct job *j, int to_file, void *mem, size_t n, size_t at)
{
	if (j->window) {
		if (to_file)
			memcpy((char *)j->window + at, mem, n);
		else
			memcpy(mem, (char *)j->window + at, n);
		return 0;
	}
	size_t done = 0;
	while (done < n) {
		off_t off = (off_t)(j->file_off + at + done);
		ssize_t r = to_file ? pwrite(j->filefd, (char *)mem + done, n - done, off)
				    : pread(j->filefd, (char *)mem + done, n - done, off);
		if (r > 0)
			done += (size_t)r;
		else if (r < 0 && errno == EINTR)
			continue;
		else
			return r < 0 ? -errno : -EIO;
	}
	return 0;
}

/* UFFDIO_COPY allocates the page: under memory pressure it says ENOMEM. The range is already the
 * memfd's, so there is no going back without losing what was written since; wait for memory. */
static void wait_for_memory(long *tries)
{
	if (++*tries % 100 == 1)
		shim_log(LOG_WARN, "remap: no memory to place a promoted page (ENOMEM); waiting");
	struct timespec ts = { 0, 10 * 1000 * 1000 };
	nanosleep(&ts, NULL);
}

/* A POSIX write lock on the extent for the job's duration: a daemon restarted meanwhile sees the
 * extent in use (F_GETLK names this process) even before the range maps it. */
static int lock_extent(struct job *j, int type)
{
	struct flock fl = { .l_type = (short)type, .l_whence = SEEK_SET, .l_start = (off_t)j->file_off,
			    .l_len = (off_t)j->len };
	return fcntl(j->filefd, F_SETLK, &fl) == 0 ? 0 : -errno;
}

static void punch_memfd(struct job *j)
{
	if (fallocate(j->memfd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)j->memfd_off, (off_t)j->len) != 0)
		shim_log(LOG_WARN, "remap: punching the memfd at %lx+%zu failed (errno %d): its DRAM stays in use",
			 (unsigned long)j->memfd_off, j->len, errno);
}

/* ---- demote -------------------------------------------------------------------------------------- */

static int demote(struct job *j, char *msg, size_t size)
{
	int rc = range_maps_file(j->start, j->len, j->memfd_ino, j->memfd_off);
	if (rc) {
		shim_format(msg, size, "REMAP: %p+%zu is not this region's memory now (already on a file?)",
			    (void *)j->start, j->len);
		return rc;
	}
	uint64_t feat = 0;
	int uffd = uffd_open(UFFD_FEATURE_WP_HUGETLBFS_SHMEM, UFFD_FEATURE_WP_UNPOPULATED, j->devfd, &feat, msg, size);
	if (uffd < 0)
		return uffd;
	/* Before 6.4 only present pages can be write-protected: fault the rest in first. */
	if (!(feat & UFFD_FEATURE_WP_UNPOPULATED))
		madvise((void *)j->start, j->len, MADV_POPULATE_WRITE);
	if (uffd_register(uffd, j->start, j->len, UFFDIO_REGISTER_MODE_WP) != 0 ||
	    uffd_protect(uffd, j->start, j->len, 1) != 0) {
		rc = -errno;
		shim_format(msg, size, "REMAP: write-protect of %p+%zu failed: %s", (void *)j->start, j->len,
			    strerror(-rc));
		close(uffd);
		return rc;
	}
	/* From here every write into the range waits. Copy, then switch. */
	for (size_t at = 0; at < j->len && !rc; at += CHUNK) {
		size_t n = j->len - at < CHUNK ? j->len - at : CHUNK;
		rc = file_io(j, 1, (char *)j->start + at, n, at);
	}
	if (rc) {
		shim_format(msg, size, "REMAP: writing the file at %lx failed: %s; nothing changed",
			    (unsigned long)j->file_off, strerror(-rc));
		uffd_protect(uffd, j->start, j->len, 0); /* wakes the writers; they write to the memfd */
		close(uffd);
		return rc;
	}
	if (sys_map((void *)j->start, j->len, MAP_SHARED | MAP_FIXED, j->filefd, j->file_off) != (void *)j->start) {
		rc = -errno;
		/* The memfd still holds every byte (nothing was punched): map it back, whatever mmap left. */
		sys_map((void *)j->start, j->len, MAP_SHARED | MAP_FIXED, j->memfd, j->memfd_off);
		shim_format(msg, size, "REMAP: mapping the file over %p+%zu failed: %s; the memory stays",
			    (void *)j->start, j->len, strerror(-rc));
		close(uffd);
		return rc;
	}
	uffd_range(uffd, UFFDIO_WAKE, j->start, j->len); /* the writers retry, on the file mapping */
	close(uffd);
	punch_memfd(j);
	return 0;
}

/* ---- promote ------------------------------------------------------------------------------------- */

struct fault_server {
	int uffd, stopfd;
	struct job *j;
	uintptr_t pending[256];
	int npending;
	long served, lost;  /* lost: atomic, both threads add */
};

/* One page of the file into place; 1 done (or someone else did it), 0 retry later (the mremap has
 * not been acknowledged yet), -errno on failure. */
static int fill_page(struct fault_server *s, uintptr_t page, char *buf)
{
	size_t at = page - s->j->start;
	if (file_io(s->j, 0, buf, SHIM_PAGE, at) != 0) {
		/* Unreadable on the file (a media error): the page is lost either way; zero-fill it so the
		 * thread waiting on it goes on, and say so in the reply. */
		memset(buf, 0, SHIM_PAGE);
		__atomic_fetch_add(&s->lost, 1, __ATOMIC_RELAXED);
	}
	long tries = 0;
	for (;;) {
		struct uffdio_copy c = { .dst = page, .src = (uintptr_t)buf, .len = SHIM_PAGE, .mode = 0 };
		if (ioctl(s->uffd, UFFDIO_COPY, &c) == 0)
			return 1;
		if (errno == EEXIST) {
			uffd_range(s->uffd, UFFDIO_WAKE, page, SHIM_PAGE);
			return 1;
		}
		if (errno == EAGAIN)
			return 0;
		if (errno == ENOENT)
			return 1;
		if (errno != ENOMEM)
			return -errno;
		wait_for_memory(&tries);
	}
}

static void *fault_main(void *arg)
{
	struct fault_server *s = arg;
	prctl(PR_SET_NAME, "tieringd-fault", 0, 0, 0);
	shim_nest++;
	char *buf = sys_map(NULL, SHIM_PAGE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (buf == MAP_FAILED)
		return NULL;
	for (;;) {
		struct pollfd p[2] = { { .fd = s->uffd, .events = POLLIN }, { .fd = s->stopfd, .events = POLLIN } };
		if (poll(p, 2, s->npending ? 1 : -1) < 0 && errno != EINTR)
			break;
		if (p[1].revents & POLLIN)
			break;
		struct uffd_msg m;
		while (s->npending < 256 && read(s->uffd, &m, sizeof m) == (ssize_t)sizeof m)
			if (m.event == UFFD_EVENT_PAGEFAULT)
				s->pending[s->npending++] = page_down((uintptr_t)m.arg.pagefault.address);
			/* UFFD_EVENT_REMAP: reading it is the acknowledgement the mremap() waits for. */
		int keep = 0;
		for (int i = 0; i < s->npending; i++) {
			int r = fill_page(s, s->pending[i], buf);
			if (r == 0)
				s->pending[keep++] = s->pending[i];
			else
				s->served++;
		}
		s->npending = keep;
	}
	syscall(SYS_munmap, buf, SHIM_PAGE);
	return NULL;
}

/* UFFDIO_COPY of [at, at+n) of the range from buf; pages already placed (by the fault thread) are
 * skipped one by one. */
static int place_chunk(int uffd, struct job *j, size_t at, size_t n, const char *buf)
{
	size_t done = 0;
	long tries = 0;
	while (done < n) {
		struct uffdio_copy c = { .dst = j->start + at + done, .src = (uintptr_t)buf + done,
					 .len = n - done, .mode = 0 };
		if (ioctl(uffd, UFFDIO_COPY, &c) == 0)
			return 0;
		if (c.copy > 0) {
			done += (size_t)c.copy;
			continue;
		}
		if (errno == EEXIST)
			done += SHIM_PAGE;
		else if (errno == ENOMEM)
			wait_for_memory(&tries);
		else if (errno != EAGAIN)
			return -errno;
	}
	return 0;
}

static int promote(struct job *j, char *msg, size_t size)
{
	struct stat st;
	if (fstat(j->filefd, &st) != 0 || range_maps_file(j->start, j->len, st.st_ino, j->file_off) != 0) {
		shim_format(msg, size, "REMAP: %p+%zu is not mapped from this file at %lx now",
			    (void *)j->start, j->len, (unsigned long)j->file_off);
		return -EINVAL;
	}
	uint64_t feat = 0;
	int uffd = uffd_open(UFFD_FEATURE_MISSING_SHMEM | UFFD_FEATURE_EVENT_REMAP, 0, j->devfd, &feat, msg, size);
	if (uffd < 0)
		return uffd;
	int rc = 0;
	char *buf = MAP_FAILED;
	struct fault_server srv = { .uffd = uffd, .stopfd = -1, .j = j };
	pthread_t tid;
	int thread = 0;

	punch_memfd(j); /* holes, so that each page is placed from the file exactly once */
	char *fresh = sys_map(NULL, j->len, MAP_SHARED, j->memfd, j->memfd_off);
	if (fresh == MAP_FAILED) {
		rc = -errno;
		goto fail;
	}
	if (j->node >= 0 && j->node < MAX_NODES) {
		int node;
		/* The memfd's shared policy for this range: the pages land on the node asked for. */
		shim_place(fresh, j->len, TRD_POL_PREFERRED, 1ULL << j->node, 0, &node);
	}
	if (uffd_register(uffd, (uintptr_t)fresh, j->len, UFFDIO_REGISTER_MODE_MISSING) != 0) {
		rc = -errno;
		goto fail;
	}
	srv.stopfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	buf = sys_map(NULL, CHUNK, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (srv.stopfd < 0 || buf == MAP_FAILED || pthread_create(&tid, NULL, fault_main, &srv) != 0) {
		rc = -ENOMEM;
		goto fail;
	}
	thread = 1;
	/* The switch: one mremap replaces the file mapping with the registered memfd mapping. */
	if ((void *)syscall(SYS_mremap, fresh, j->len, j->len, MREMAP_MAYMOVE | MREMAP_FIXED, j->start) !=
	    (void *)j->start) {
		rc = -errno;
		if (range_maps_file(j->start, j->len, st.st_ino, j->file_off) != 0)
			sys_map((void *)j->start, j->len, MAP_SHARED | MAP_FIXED, j->filefd, j->file_off);
		goto fail;
	}
	fresh = MAP_FAILED;
	for (size_t at = 0; at < j->len && !rc; at += CHUNK) {
		size_t n = j->len - at < CHUNK ? j->len - at : CHUNK;
		if (file_io(j, 0, buf, n, at) != 0) {
			/* Page by page, so that one unreadable page costs only itself. */
			for (size_t p = 0; p < n && !rc; p += SHIM_PAGE) {
				int r;
				while ((r = fill_page(&srv, j->start + at + p, buf)) == 0)
					;
				rc = r < 0 ? r : 0;
			}
			continue;
		}
		rc = place_chunk(uffd, j, at, n, buf);
	}
	uint64_t one = 1;
	if (write(srv.stopfd, &one, sizeof one) < 0) { /* cannot happen on an eventfd */ }
	pthread_join(tid, NULL);
	thread = 0;
	uffd_range(uffd, UFFDIO_UNREGISTER, j->start, j->len); /* also wakes anything still waiting */
	if (rc) {
		shim_format(msg, size, "REMAP: placing pages failed after the switch: %s", strerror(-rc));
		goto out;
	}
	if (srv.lost) {
		shim_format(msg, size, "REMAP: %ld pages unreadable on the file were zero-filled", srv.lost);
		rc = -EIO;
	}
	goto out;
fail:
	if (!msg[0])
		shim_format(msg, size, "REMAP: promote of %p+%zu failed before the switch: %s; nothing changed",
			    (void *)j->start, j->len, strerror(-rc));
out:
	if (thread) {
		uint64_t one = 1;
		if (write(srv.stopfd, &one, sizeof one) < 0) { /* see above */ }
		pthread_join(tid, NULL);
	}
	if (fresh != MAP_FAILED)
		syscall(SYS_munmap, fresh, j->len);
	if (buf != MAP_FAILED)
		syscall(SYS_munmap, buf, CHUNK);
	if (srv.stopfd >= 0)
		close(srv.stopfd);
	close(uffd);
	return rc;
}

/* ---- share --------------------------------------------------------------------------------------- */

/* A block whose bytes equal a copy published in a shared pool is kept there once (docs/pool.md,
 * "Identical KV stored once"). Mapping the pool's copy is no answer: devdax refuses MAP_PRIVATE,
 * and a MAP_SHARED write would reach every host. So the range stays this process's memfd with its
 * pages punched, registered MODE_MISSING on one userfaultfd that a fill server thread reads for the
 * process's whole life: a page touched is placed from the pool's copy (UFFDIO_COPY into the memfd)
 * and every later write goes to that private page. The pool's copy is only ever read. */

/* Shared ranges per process: one per cold block kept once (2 MiB each: 8 GiB of them). The table is
 * in .bss, so a process that never shares touches none of it. */
#define MAX_SHARES 4096

struct share {
	uintptr_t start;
	size_t len;
	uint64_t file_off;
	int filefd;                /* a duplicate, ours, shared by every entry of the same file */
	void *window;              /* devdax: a read-only mapping of the extent */
	int checking;              /* SHARE is comparing: a missing page is a hole, placed zero-filled */
	int memfd;                 /* the region's (not ours to close: the entry goes with the region) */
	uint64_t memfd_off;        /* of start */
};

static struct {
	pthread_mutex_t lock;      /* guards the table; taken after shim_lock and rm.running, never before */
	int uffd;                  /* every shared range is registered on it; -1 until the first SHARE */
	uint64_t features;
	int n;                     /* atomic reads without the lock: "nothing shared" is a quick answer */
	struct share s[MAX_SHARES];
} sh = { PTHREAD_MUTEX_INITIALIZER, -1, 0, 0, { { 0 } } };

static struct job share_view(const struct share *s)
{
	struct job j = { .start = s->start, .len = s->len, .file_off = s->file_off, .filefd = s->filefd,
			 .devfd = -1, .window = s->window };
	return j;
}

static long share_find(uintptr_t addr)
{
	for (long i = 0; i < sh.n; i++)
		if (addr - sh.s[i].start < sh.s[i].len)
			return i;
	return -1;
}

/* Forgets entry i (lock held): its descriptor and window go. Closing the descriptor also drops any
 * POSIX lock this process holds on that file (a remap job of another region on the same file would
 * lose its extent lock early: only the daemon's view of a job in flight suffers, not the data). */
static int share_fd_users(int fd)
{
	int n = 0;
	for (long i = 0; i < sh.n; i++)
		n += sh.s[i].filefd == fd;
	return n;
}

static void share_drop(long i)
{
	struct share *s = &sh.s[i];
	if (s->window)
		syscall(SYS_munmap, s->window, s->len);
	if (s->filefd >= 0 && share_fd_users(s->filefd) == 1) /* the file's last range */
		close(s->filefd);
	sh.s[i] = sh.s[sh.n - 1];
	__atomic_store_n(&sh.n, sh.n - 1, __ATOMIC_RELEASE);
}

/* The page a fault asked for, into place (lock taken here): 1 done (or nothing left to do), 0 retry
 * later, -errno. While SHARE compares, a missing page is a hole of the memfd: zero, placed
 * write-protected like the rest of the range. */
static int share_fill_page(uintptr_t page, int write, char *buf)
{
	long tries = 0;
	for (;;) {
		pthread_mutex_lock(&sh.lock);
		long i = share_find(page);
		if (i < 0) {
			/* Unshared (UFFDIO_UNREGISTER woke the thread) or unmapped meanwhile. */
			pthread_mutex_unlock(&sh.lock);
			uffd_range(sh.uffd, UFFDIO_WAKE, page, SHIM_PAGE);
			return 1;
		}
		struct share *s = &sh.s[i];
		struct job j = share_view(s);
		/* A read places the page write-protected: clean, a copy of the pool's that share_trim may
		 * drop again; the first write un-protects it (share_main), and then it is the process's. */
		uint64_t mode = s->checking || !write ? UFFDIO_COPY_MODE_WP : 0;
		if (s->checking) {
			memset(buf, 0, SHIM_PAGE);
		} else if (file_io(&j, 0, buf, SHIM_PAGE, page - s->start) != 0) {
			/* Unreadable in the pool (a media error): lost either way; zero, so the thread goes on. */
			memset(buf, 0, SHIM_PAGE);
			shim_log(LOG_WARN, "share: page %p unreadable in the shared copy: zero-filled", (void *)page);
		}
		struct uffdio_copy c = { .dst = page, .src = (uintptr_t)buf, .len = SHIM_PAGE, .mode = mode };
		int e = ioctl(sh.uffd, UFFDIO_COPY, &c) == 0 ? 0 : errno;
		pthread_mutex_unlock(&sh.lock);
		if (e == EEXIST)
			uffd_range(sh.uffd, UFFDIO_WAKE, page, SHIM_PAGE);
		if (e == 0 || e == EEXIST || e == ENOENT)
			return 1;
		if (e == EAGAIN)
			return 0;
		if (e != ENOMEM)
			return -e;
		wait_for_memory(&tries);
	}
}

static char *share_buf; /* the fill server's page */

/* A write into a clean filled page: the page becomes the process's (un-protected, which wakes the
 * writer). While SHARE compares, the compare's own un-protect wakes it instead. */
static void share_write_fault(uintptr_t page)
{
	pthread_mutex_lock(&sh.lock);
	long i = share_find(page);
	if (i >= 0 && !sh.s[i].checking)
		uffd_protect(sh.uffd, page, SHIM_PAGE, 0);
	pthread_mutex_unlock(&sh.lock);
}

#define PM_PRESENT (1ULL << 63)
#define PM_UFFD_WP (1ULL << 57) /* pagemap: the pte is uffd-wp write-protected (Linux 5.13) */

/* Punches the clean filled pages of entry i (present and still write-protected: read, never
 * written): they read the pool's copy again when touched. In the fill server thread only, so a
 * write fault on one of them waits in the kernel until the punch is done, then finds it missing and
 * is filled afresh with the write allowed: no write is lost. Returns the pages given back. */
static long share_trim_one(int pagemap, const struct share *s)
{
	uint64_t pm[512];
	long freed = 0;
	for (size_t at = 0; at < s->len; at += sizeof pm / sizeof pm[0] * SHIM_PAGE) {
		size_t n = (s->len - at) / SHIM_PAGE < 512 ? (s->len - at) / SHIM_PAGE : 512;
		off_t where = (off_t)((s->start + at) / SHIM_PAGE * sizeof(uint64_t));
		if (pread(pagemap, pm, n * sizeof(uint64_t), where) != (ssize_t)(n * sizeof(uint64_t)))
			return freed;
		for (size_t k = 0; k < n; k++) {
			if ((pm[k] & (PM_PRESENT | PM_UFFD_WP)) != (PM_PRESENT | PM_UFFD_WP))
				continue;
			off_t off = (off_t)(s->memfd_off + at + k * SHIM_PAGE);
			if (fallocate(s->memfd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, off, SHIM_PAGE) == 0)
				freed++;
		}
	}
	return freed;
}

/* Reading a shared block back costs a page of memory per page read, where the DAX tier's log is
 * read in place: a process reading through much of its cold KV (a verify, a scan) would fill the
 * machine, and memfd pages have no swap to go to. So while free memory is short, clean filled pages
 * go back: the pool's copy is their backing store, as a file's is for the page cache. */
#define SHARE_TRIM_EVERY_NS (100 * 1000 * 1000ULL)
static void share_trim_if_short(void)
{
	static uint64_t last_ns;
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	uint64_t now = (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
	if (now - last_ns < SHARE_TRIM_EVERY_NS || !__atomic_load_n(&sh.n, __ATOMIC_ACQUIRE))
		return;
	last_ns = now;
	struct sysinfo si;
	if (sysinfo(&si) != 0)
		return;
	uint64_t unit = si.mem_unit ? si.mem_unit : 1;
	uint64_t low = (uint64_t)si.totalram * unit / 32;  /* short: under 1/32 of memory free, or 64 MiB */
	if (low < (64ULL << 20))
		low = 64ULL << 20;
	if ((uint64_t)si.freeram * unit >= low)
		return;
	int pagemap = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
	if (pagemap < 0)
		return;
	long freed = 0;
	pthread_mutex_lock(&sh.lock);
	for (long i = 0; i < sh.n; i++)
		if (!sh.s[i].checking)
			freed += share_trim_one(pagemap, &sh.s[i]);
	pthread_mutex_unlock(&sh.lock);
	close(pagemap);
	if (freed)
		shim_log(LOG_INFO, "share: memory short: %ld clean pages of shared blocks given back", freed);
}

static void *share_main(void *arg)
{
	(void)arg;
	prctl(PR_SET_NAME, "tieringd-share", 0, 0, 0);
	shim_nest++;
	uintptr_t pending[256];
	int npending = 0;
	for (;;) {
		struct pollfd p = { .fd = sh.uffd, .events = POLLIN };
		poll(&p, 1, npending ? 1 : -1);
		share_trim_if_short();
		struct uffd_msg m;
		while (npending < 256 && read(sh.uffd, &m, sizeof m) == (ssize_t)sizeof m) {
			if (m.event != UFFD_EVENT_PAGEFAULT)
				continue;
			uintptr_t page = page_down((uintptr_t)m.arg.pagefault.address);
			if (m.arg.pagefault.flags & UFFD_PAGEFAULT_FLAG_WP)
				share_write_fault(page);
			else
				pending[npending++] = page | !!(m.arg.pagefault.flags & UFFD_PAGEFAULT_FLAG_WRITE);
		}
		int keep = 0;
		for (int i = 0; i < npending; i++) {
			int r = share_fill_page(page_down(pending[i]), (int)(pending[i] & 1), share_buf);
			if (r == 0)
				pending[keep++] = pending[i];
			else if (r < 0)
				shim_log(LOG_WARN, "share: placing page %p failed (errno %d)", (void *)pending[i], -r);
		}
		npending = keep;
	}
	return NULL;
}

/* The userfaultfd and the fill server, at the first SHARE (lock held). It stays registered after
 * the job, so it needs kernel-mode faults like the jobs' own (read(2) into a shared page). */
static int share_server_start(int devfd, char *msg, size_t size)
{
	if (sh.uffd >= 0)
		return 0;
	uint64_t feat = 0;
	int uffd = uffd_open(UFFD_FEATURE_MISSING_SHMEM | UFFD_FEATURE_WP_HUGETLBFS_SHMEM,
			     UFFD_FEATURE_WP_UNPOPULATED, devfd, &feat, msg, size);
	if (uffd < 0)
		return uffd;
	pthread_t tid;
	share_buf = sys_map(NULL, SHIM_PAGE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	sh.uffd = uffd;
	if (share_buf == MAP_FAILED || shim_start_thread(&tid, share_main) != 0) {
		if (share_buf != MAP_FAILED)
			syscall(SYS_munmap, share_buf, SHIM_PAGE);
		close(uffd);
		sh.uffd = -1;
		shim_format(msg, size, "SHARE: cannot start the fill server");
		return -ENOMEM;
	}
	sh.features = feat;
	return 0;
}

/* Every page of entry i not placed yet, from the file (the pages the process has keep what it
 * wrote: UFFDIO_COPY places only where nothing is); then the range is unregistered, plain memfd
 * memory, and the entry goes. Lock held. 0, -EIO when pages unreadable in the pool were
 * zero-filled, or -errno. */
static int share_end(long i)
{
	struct share s = sh.s[i];
	struct job j = share_view(&s);
	long lost = 0;
	int rc = 0;
	char *buf = sys_map(NULL, CHUNK, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (buf == MAP_FAILED)
		return -ENOMEM; /* still shared: nothing is lost */
	for (size_t at = 0; at < s.len && !rc; at += CHUNK) {
		size_t n = s.len - at < CHUNK ? s.len - at : CHUNK;
		if (file_io(&j, 0, buf, n, at) != 0)
			for (size_t p = 0; p < n; p += SHIM_PAGE)
				if (file_io(&j, 0, buf + p, SHIM_PAGE, at + p) != 0) {
					memset(buf + p, 0, SHIM_PAGE);
					lost++;
				}
		rc = place_chunk(sh.uffd, &j, at, n, buf);
	}
	syscall(SYS_munmap, buf, CHUNK);
	/* ENOENT: the range is not mapped any more, nothing to keep. Anything else would leave holes
	 * that read zero once unregistered: the range stays shared. */
	if (rc && rc != -ENOENT)
		return rc;
	uffd_range(sh.uffd, UFFDIO_UNREGISTER, s.start, s.len); /* also wakes anything still waiting */
	share_drop(i);
	return lost ? -EIO : 0;
}

/* Unshares every range (a fork, the daemon lost); returns how many. */
static int share_end_all(const char *why)
{
	int n = 0;
	if (!__atomic_load_n(&sh.n, __ATOMIC_ACQUIRE))
		return 0;
	pthread_mutex_lock(&sh.lock);
	for (long i = sh.n - 1; i >= 0; i--) {
		if (sh.s[i].checking)
			continue;
		int rc = share_end(i);
		if (rc == 0 || rc == -EIO)
			n++;
		else
			shim_log(LOG_WARN, "share: unsharing %p failed (errno %d): it stays shared",
				 (void *)sh.s[i].start, -rc);
	}
	pthread_mutex_unlock(&sh.lock);
	if (n)
		shim_log(LOG_INFO, "share: %s: %d shared ranges filled from the file and unregistered", why, n);
	return n;
}

/* The descriptor the table keeps for the request's file: an entry's of the same file, else a
 * duplicate (one per file, not per range: hundreds of shared blocks must not cost hundreds of
 * descriptors). Lock held. */
static int share_fd_of(int filefd)
{
	struct stat want, st;
	if (fstat(filefd, &want) != 0)
		return -1;
	for (long i = 0; i < sh.n; i++)
		if (fstat(sh.s[i].filefd, &st) == 0 && st.st_dev == want.st_dev && st.st_ino == want.st_ino &&
		    st.st_rdev == want.st_rdev)
			return sh.s[i].filefd;
	return fcntl(filefd, F_DUPFD_CLOEXEC, 0);
}

/* A new entry for the job's range, checking (lock taken here); fills *out. */
static int share_add(struct job *j, struct share *out, char *msg, size_t size)
{
	int rc = 0;
	pthread_mutex_lock(&sh.lock);
	for (long i = 0; i < sh.n && !rc; i++)
		if (sh.s[i].start < j->start + j->len && j->start < sh.s[i].start + sh.s[i].len)
			rc = -EBUSY;
	if (!rc && sh.n == MAX_SHARES)
		rc = -ENOSPC;
	if (rc)
		shim_format(msg, size, rc == -EBUSY ? "SHARE: %p+%zu overlaps a shared range" :
			    "SHARE: %p+%zu: the table of shared ranges is full", (void *)j->start, j->len);
	else
		rc = share_server_start(j->devfd, msg, size);
	int fd = rc ? -1 : share_fd_of(j->filefd);
	if (!rc && fd < 0) {
		rc = -errno;
		shim_format(msg, size, "SHARE: cannot keep the file open: %s", strerror(-rc));
	}
	if (!rc) {
		struct share s = { j->start, j->len, j->file_off, fd, j->window, 1, j->memfd, j->memfd_off };
		j->window = NULL; /* the entry's now */
		sh.s[sh.n] = *out = s;
		__atomic_store_n(&sh.n, sh.n + 1, __ATOMIC_RELEASE);
	}
	pthread_mutex_unlock(&sh.lock);
	return rc;
}

/* Drops the entry at start (lock taken here); commit: it stops checking and stays instead. */
static void share_settle(uintptr_t start, int commit)
{
	pthread_mutex_lock(&sh.lock);
	long i = share_find(start);
	if (i >= 0 && commit)
		sh.s[i].checking = 0;
	else if (i >= 0)
		share_drop(i);
	pthread_mutex_unlock(&sh.lock);
}

/* 0 when the range holds the file's bytes, 1 when not, -errno. The memfd is read with pread(2),
 * not through the range: a hole reads zero and nothing faults. */
static int share_compare(const struct job *j, const struct share *s)
{
	struct job mem = { .filefd = j->memfd, .file_off = j->memfd_off };
	struct job file = share_view(s);
	char *a = sys_map(NULL, 2 * CHUNK, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (a == MAP_FAILED)
		return -ENOMEM;
	int rc = 0;
	for (size_t at = 0; at < j->len && !rc; at += CHUNK) {
		size_t n = j->len - at < CHUNK ? j->len - at : CHUNK;
		rc = file_io(&mem, 0, a, n, at);
		if (!rc)
			rc = file_io(&file, 0, a + CHUNK, n, at);
		if (!rc && memcmp(a, a + CHUNK, n) != 0)
			rc = 1;
	}
	syscall(SYS_munmap, a, 2 * CHUNK);
	return rc;
}

/* devdax: the shared copy is read through a read-only mapping (a writable one would let a stray
 * store reach every host; and the daemon takes only writable mappings of its file for log extents). */
static int share_window(struct job *j)
{
	struct stat st;
	if (fstat(j->filefd, &st) != 0)
		return -errno;
	if (!S_ISCHR(st.st_mode))
		return 0;
	void *w = (void *)syscall(SYS_mmap, NULL, j->len, PROT_READ, MAP_SHARED, j->filefd, (off_t)j->file_off);
	if (w == MAP_FAILED)
		return -errno;
	j->window = w;
	return 0;
}

/* Un-protects (waking the writers) and unregisters a range whose SHARE failed: nothing changed. */
static void share_abandon(struct job *j)
{
	uffd_protect(sh.uffd, j->start, j->len, 0);
	uffd_range(sh.uffd, UFFDIO_UNREGISTER, j->start, j->len);
	share_settle(j->start, 0);
}

static int share_range(struct job *j, char *msg, size_t size)
{
	int rc = range_maps_file(j->start, j->len, j->memfd_ino, j->memfd_off);
	if (rc) {
		shim_format(msg, size, "SHARE: %p+%zu is not this region's memory now", (void *)j->start, j->len);
		return rc;
	}
	if ((rc = share_window(j)) != 0) {
		shim_format(msg, size, "SHARE: cannot map the device extent: %s", strerror(-rc));
		return rc;
	}
	struct share s;
	if ((rc = share_add(j, &s, msg, size)) != 0)
		return rc;
	/* Before 6.4 only present pages can be write-protected: fault the rest in first. Missing and
	 * write-protect together on shmem (and UFFDIO_COPY_MODE_WP there): Linux 6.1. The registration
	 * stays for as long as the range is shared; write-protect is used only while comparing. */
	if (!(sh.features & UFFD_FEATURE_WP_UNPOPULATED))
		madvise((void *)j->start, j->len, MADV_POPULATE_WRITE);
	if (uffd_register(sh.uffd, j->start, j->len, UFFDIO_REGISTER_MODE_MISSING | UFFDIO_REGISTER_MODE_WP) != 0 ||
	    uffd_protect(sh.uffd, j->start, j->len, 1) != 0) {
		rc = -errno;
		shim_format(msg, size, "SHARE: registering %p+%zu failed: %s", (void *)j->start, j->len, strerror(-rc));
		share_abandon(j);
		return rc;
	}
	/* From here every write into the range waits: compare, then punch. */
	rc = share_compare(j, &s);
	if (rc) {
		share_abandon(j);
		if (rc > 0)
			shim_format(msg, size, "SHARE: %p+%zu: bytes differ from the shared copy at %lx",
				    (void *)j->start, j->len, (unsigned long)j->file_off);
		else
			shim_format(msg, size, "SHARE: reading to compare failed: %s", strerror(-rc));
		return rc > 0 ? -ESTALE : rc;
	}
	share_settle(j->start, 1); /* from now on a missing page is filled from the file */
	punch_memfd(j);
	uffd_protect(sh.uffd, j->start, j->len, 0); /* wakes the writers: their pages come from the file */
	return 0;
}

static int unshare_range(struct job *j, char *msg, size_t size)
{
	struct stat st, fst;
	int rc = fstat(j->filefd, &st) != 0 ? -errno : 0;
	pthread_mutex_lock(&sh.lock);
	long i = rc ? -1 : share_find(j->start);
	struct share *s = i >= 0 ? &sh.s[i] : NULL;
	if (!s || s->start != j->start || s->len != j->len || s->file_off != j->file_off || s->checking ||
	    fstat(s->filefd, &fst) != 0 || fst.st_ino != st.st_ino || fst.st_dev != st.st_dev) {
		pthread_mutex_unlock(&sh.lock);
		shim_format(msg, size, "UNSHARE: %p+%zu is not shared from this file at %lx (any more)",
			    (void *)j->start, j->len, (unsigned long)j->file_off);
		return -ENOENT;
	}
	if (j->node >= 0 && j->node < MAX_NODES) {
		int node;
		/* The memfd's shared policy for this range: the pages placed now land there. */
		shim_place((void *)j->start, j->len, TRD_POL_PREFERRED, 1ULL << j->node, 0, &node);
	}
	rc = share_end(i);
	pthread_mutex_unlock(&sh.lock);
	if (rc == -EIO)
		shim_format(msg, size, "UNSHARE: pages unreadable in the shared copy were zero-filled");
	else if (rc)
		shim_format(msg, size, "UNSHARE: placing pages failed: %s; the range stays shared", strerror(-rc));
	return rc;
}

void remap_share_forget(uintptr_t lo, uintptr_t hi, int fill)
{
	if (!__atomic_load_n(&sh.n, __ATOMIC_ACQUIRE))
		return;
	pthread_mutex_lock(&sh.lock);
	for (long i = 0; i < sh.n;) {
		struct share *s = &sh.s[i];
		if (s->checking || s->start >= hi || s->start + s->len <= lo) {
			i++;
			continue;
		}
		/* A range that stays mapped, in part or moved whole, must hold its bytes: filled. One
		 * unmapped whole needs nothing; its registration goes with the mapping. */
		int rc = fill || s->start < lo || s->start + s->len > hi ? share_end(i) : (share_drop(i), 0);
		if (rc && rc != -EIO) {
			shim_log(LOG_WARN, "share: filling %p before an unmap failed (errno %d)", (void *)s->start, -rc);
			share_drop(i);
		}
	}
	pthread_mutex_unlock(&sh.lock);
}

/* When the connection to the daemon drops, every shared range is filled from the file and
 * unregistered at once: the daemon's references in the pool expire with its lease, and then nothing
 * keeps the shared copy from being reused for another block. A later daemon shares again if it
 * wants. Done by the remap thread (it may take a while), after a job it runs or has queued. */
void remap_daemon_lost(void)
{
	if (!__atomic_load_n(&sh.n, __ATOMIC_ACQUIRE))
		return;
	pthread_mutex_lock(&rm.lock);
	rm.unshare_all = 1;
	pthread_cond_signal(&rm.cond);
	pthread_mutex_unlock(&rm.lock);
}

/* ---- the remap thread ---------------------------------------------------------------------------- */

static void finish(struct job *j, int rc, const char *msg, uint64_t elapsed_ns)
{
	window_close(j);
	if (j->filefd >= 0)
		close(j->filefd); /* also drops the extent lock */
	if (j->devfd >= 0)
		close(j->devfd);
	pthread_mutex_lock(&shim_lock);
	long i = region_find_containing(j->start);
	if (i >= 0)
		region_at(i)->flags &= ~RF_REMAPPING;
	regions_remap_done();
	pthread_mutex_unlock(&shim_lock);
	static const char *const done[] = { "?", "demoted", "promoted", "shared", "unshared" };
	if (rc == 0)
		shim_log(LOG_INFO, "remap: %s %p+%zu at file offset %lx in %lu us", done[j->direction],
			 (void *)j->start, j->len, (unsigned long)j->file_off, (unsigned long)(elapsed_ns / 1000));
	else
		shim_log(LOG_INFO, "remap: %s", msg);
	client_post_reply(j->gen, j->ref_seq, -rc, msg);
}

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static int run_job(struct job *j, char *msg, size_t size)
{
	/* The shared copy is only read (by any number of processes): a read lock. */
	int sharing = j->direction >= TRD_REMAP_SHARE;
	int rc = lock_extent(j, sharing ? F_RDLCK : F_WRLCK);
	if (rc == -EAGAIN || rc == -EACCES)
		rc = -EBUSY;
	if (rc) {
		shim_format(msg, size, "REMAP: file range %lx+%zu is locked by another process",
			    (unsigned long)j->file_off, j->len);
		return rc;
	}
	if (!sharing && (rc = window_open(j)) != 0) {
		shim_format(msg, size, "REMAP: cannot map the device extent: %s", strerror(-rc));
		return rc;
	}
	switch (j->direction) {
	case TRD_REMAP_DEMOTE: return demote(j, msg, size);
	case TRD_REMAP_PROMOTE: return promote(j, msg, size);
	case TRD_REMAP_SHARE: return share_range(j, msg, size);
	default: return unshare_range(j, msg, size);
	}
}

static void *remap_main(void *arg)
{
	(void)arg;
	prctl(PR_SET_NAME, "tieringd-remap", 0, 0, 0);
	shim_nest++; /* nothing this thread allocates is ever managed */
	for (;;) {
		pthread_mutex_lock(&rm.lock);
		while (!rm.has_job && !rm.unshare_all)
			pthread_cond_wait(&rm.cond, &rm.lock);
		/* A job queued before the daemon was lost runs first: a SHARE among them is undone too. */
		int job = rm.has_job, unshare_all = !job && rm.unshare_all;
		struct job j = rm.job;
		rm.has_job = 0;
		if (unshare_all)
			rm.unshare_all = 0;
		pthread_mutex_unlock(&rm.lock);
		/* Lock order: rm.running, then shim_lock (fork_prepare takes them so too). */
		pthread_mutex_lock(&rm.running);
		if (job) {
			char msg[104] = "";
			uint64_t t0 = now_ns();
			int rc = run_job(&j, msg, sizeof msg);
			finish(&j, rc, msg, now_ns() - t0);
		} else {
			share_end_all("the daemon's connection is lost");
		}
		pthread_mutex_unlock(&rm.running);
	}
	return NULL;
}

static int start_thread(void)
{
	if (rm.started)
		return 0;
	pthread_t tid;
	int rc = shim_start_thread(&tid, remap_main);
	if (rc == 0)
		rm.started = 1;
	return -rc;
}

static void close_fds(int *fds, int nfds)
{
	for (int i = 0; i < nfds; i++)
		if (fds[i] >= 0)
			close(fds[i]);
}

int remap_submit(const struct trd_remap *m, int *fds, int nfds, char *msg, size_t size)
{
	int rc = -EINVAL;
	struct job j = { .ref_seq = m->h.seq, .gen = client_generation(), .direction = m->direction,
			 .start = m->start, .len = m->length, .file_off = m->file_offset, .node = m->node,
			 .filefd = -1, .devfd = -1 };
	if (nfds < 1) {
		shim_format(msg, size, "REMAP: no file descriptor came with the request");
		rc = -EBADF;
		goto refuse;
	}
	if (m->direction < TRD_REMAP_DEMOTE || m->direction > TRD_REMAP_UNSHARE || m->flags ||
	    !m->length || page_down(m->start) != m->start || page_up(m->length) != m->length ||
	    page_down(m->file_offset) != m->file_offset || m->start + m->length < m->start) {
		shim_format(msg, size, "REMAP: bad direction or flags, or start/length/offset not page-aligned");
		goto refuse;
	}
	int acc = fcntl(fds[0], F_GETFL);
	struct stat st;
	if (acc < 0 || (acc & O_ACCMODE) != O_RDWR || fstat(fds[0], &st) != 0 ||
	    !(S_ISREG(st.st_mode) || S_ISCHR(st.st_mode))) {
		shim_format(msg, size, "REMAP: the descriptor is not a file or device open read-write");
		rc = -EBADF;
		goto refuse;
	}
	pthread_mutex_lock(&shim_lock);
	long i = region_find_containing(m->start);
	struct region *r = i >= 0 ? region_at(i) : NULL;
	if (!r || r->start + r->len < m->start + m->length) {
		pthread_mutex_unlock(&shim_lock);
		shim_format(msg, size, "REMAP: %p+%lu is not inside a region of this process", (void *)(uintptr_t)m->start,
			    (unsigned long)m->length);
		rc = -ENOENT;
		goto refuse;
	}
	struct stat mst;
	if (!(r->flags & TRD_F_MEMFD) || (r->flags & (TRD_F_PINNED | TRD_F_INHERITED)) ||
	    fstat(r->memfd, &mst) != 0 || mst.st_ino != r->memfd_ino) {
		pthread_mutex_unlock(&shim_lock);
		shim_format(msg, size, "REMAP: only memfd regions that are not pinned or inherited move onto DAX");
		rc = -EINVAL;
		goto refuse;
	}
	pthread_mutex_lock(&rm.lock);
	if (rm.has_job || (r->flags & RF_REMAPPING)) {
		pthread_mutex_unlock(&rm.lock);
		pthread_mutex_unlock(&shim_lock);
		shim_format(msg, size, "REMAP: another remap is running in this process");
		rc = -EBUSY;
		goto refuse;
	}
	rc = start_thread();
	if (rc) {
		pthread_mutex_unlock(&rm.lock);
		pthread_mutex_unlock(&shim_lock);
		shim_format(msg, size, "REMAP: cannot start the remap thread");
		goto refuse;
	}
	r->flags |= RF_REMAPPING;
	j.memfd = r->memfd;
	j.memfd_ino = r->memfd_ino;
	j.memfd_off = r->memfd_off + (m->start - r->start);
	j.filefd = fds[0];
	j.devfd = nfds > 1 ? fds[1] : -1;
	close_fds(fds + 2, nfds - 2);
	rm.job = j;
	rm.has_job = 1;
	pthread_cond_signal(&rm.cond);
	pthread_mutex_unlock(&rm.lock);
	pthread_mutex_unlock(&shim_lock);
	return 0;
refuse:
	close_fds(fds, nfds);
	return rc;
}

/* fork() waits for a running remap, so the child copies a settled address space. Shared ranges are
 * unshared first (filled from the file in full, unregistered): the child inherits no userfaultfd
 * registration (no UFFD_FEATURE_EVENT_FORK), and a page it touched in a hole would be allocated
 * zero-filled in the memfd both processes map, the parent's view included. Keeping the parent's
 * ranges registered while the child runs cannot be made safe, so the parent gives up the sharing:
 * its next UNSHARE answers ENOENT, and the daemon may share the range again. */
void remap_fork_prepare(void)
{
	pthread_mutex_lock(&rm.running);
	share_end_all("fork");
}

void remap_fork_parent(void)
{
	pthread_mutex_unlock(&rm.running);
}

void remap_fork_child(void)
{
	pthread_mutex_init(&rm.lock, NULL);
	pthread_mutex_init(&rm.running, NULL);
	pthread_cond_init(&rm.cond, NULL);
	if (rm.has_job) { /* queued in the parent: the parent runs it, the child drops its copies */
		close(rm.job.filefd);
		if (rm.job.devfd >= 0)
			close(rm.job.devfd);
	}
	rm.started = 0; /* no remap thread here */
	rm.has_job = 0;
	rm.unshare_all = 0;
	/* No fill server here either; the table is empty (fork_prepare), but for a range it could not
	 * fill: its copies of the descriptors go. */
	pthread_mutex_init(&sh.lock, NULL);
	while (sh.n)
		share_drop(sh.n - 1);
	if (sh.uffd >= 0)
		close(sh.uffd); /* the parent's registrations stay: this only drops the child's reference */
	sh.uffd = -1;
}
