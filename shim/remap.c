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
// Both need a userfaultfd that also handles faults taken in kernel mode: userfaultfd(2) from a
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
	struct job job;
} rm = { PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, 0, 0, { 0 } };

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
	if (rc == 0)
		shim_log(LOG_INFO, "remap: %s %p+%zu at file offset %lx in %lu us",
			 j->direction == TRD_REMAP_DEMOTE ? "demoted" : "promoted", (void *)j->start, j->len,
			 (unsigned long)j->file_off, (unsigned long)(elapsed_ns / 1000));
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

static void *remap_main(void *arg)
{
	(void)arg;
	prctl(PR_SET_NAME, "tieringd-remap", 0, 0, 0);
	shim_nest++; /* nothing this thread allocates is ever managed */
	for (;;) {
		pthread_mutex_lock(&rm.lock);
		while (!rm.has_job)
			pthread_cond_wait(&rm.cond, &rm.lock);
		struct job j = rm.job;
		rm.has_job = 0;
		pthread_mutex_unlock(&rm.lock);
		/* Lock order: rm.running, then shim_lock (fork_prepare takes them so too). */
		pthread_mutex_lock(&rm.running);

		char msg[104] = "";
		uint64_t t0 = now_ns();
		int rc = lock_extent(&j, F_WRLCK);
		if (rc == -EAGAIN || rc == -EACCES)
			rc = -EBUSY;
		if (rc)
			shim_format(msg, sizeof msg, "REMAP: file range %lx+%zu is locked by another process",
				    (unsigned long)j.file_off, j.len);
		else if ((rc = window_open(&j)) != 0)
			shim_format(msg, sizeof msg, "REMAP: cannot map the device extent: %s", strerror(-rc));
		else
			rc = j.direction == TRD_REMAP_DEMOTE ? demote(&j, msg, sizeof msg) : promote(&j, msg, sizeof msg);
		finish(&j, rc, msg, now_ns() - t0);
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
	if ((m->direction != TRD_REMAP_DEMOTE && m->direction != TRD_REMAP_PROMOTE) || m->flags ||
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

/* fork() waits for a running remap, so the child copies a settled address space. */
void remap_fork_prepare(void)
{
	pthread_mutex_lock(&rm.running);
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
}
