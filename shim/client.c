// SPDX-License-Identifier: Apache-2.0
// The registry client and the control channel.
//
// The application never waits on the daemon: allocation paths append to a queue under shim_lock
// and poke an eventfd; one background thread (started with the first managed region) owns the
// connection, sends, and answers control requests. When the daemon is absent the thread waits on
// inotify for the socket to appear (and retries every few seconds as a safety net); on every
// (re)connection it sends HELLO, RESET and the whole region table, so regions made while the daemon
// was away are learned as soon as it appears.
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/inotify.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "shim.h"

#define RING 1024
#define RETRY_MS 1000          /* reconnect attempts when inotify cannot watch the run directory */
#define RETRY_WATCHED_MS 5000  /* ... and when it can (a safety net for missed events) */
#define MAILBOX 8              /* replies waiting for this thread (one remap runs at a time) */

struct item {
	int type;
	struct region r;
};

static struct {
	/* guarded by shim_lock */
	struct item ring[RING];
	unsigned head, tail;
	int overflow;          /* items were dropped: a full resync is due */
	int connected;
	/* thread state */
	int started;           /* thread created (atomic) */
	int efd;               /* eventfd: work queued */
	int fd;                /* connection, -1 when none */
	int ifd, wd;           /* inotify on the run directory */
	uid_t peer_uid;
	pid_t peer_pid;
	uint32_t seq;
	int need_resync;
	unsigned gen;          /* connection counter: replies made off this thread name the one they answer */
	pthread_t tid;
	/* guarded by shim_lock: replies other threads made (remap.c), sent by this thread */
	struct reply {
		unsigned gen;
		uint32_t ref_seq;
		int code;
		char msg[104];
	} mailbox[MAILBOX];
	unsigned mb_head, mb_tail;
} cl = { .efd = -1, .fd = -1, .ifd = -1, .wd = -1 };

/* ---- queue (shim_lock held) --------------------------------------------------------------------- */

void client_enqueue(int type, const struct region *r)
{
	if (!cl.connected)
		return; /* nothing to tell yet: the next connection sends the whole table */
	if (cl.tail - cl.head >= RING) {
		cl.overflow = 1;
		return;
	}
	struct item *it = &cl.ring[cl.tail++ % RING];
	it->type = type;
	it->r = *r;
}

/* ---- wire helpers ---------------------------------------------------------------------------- */

static void fill_hdr(struct trd_hdr *h, int type, size_t size)
{
	h->magic = TRD_MAGIC;
	h->version = TRD_VERSION;
	h->type = (uint16_t)type;
	h->size = (uint32_t)size;
	h->seq = __atomic_add_fetch(&cl.seq, 1, __ATOMIC_RELAXED);
}

static void disconnect(const char *why)
{
	if (cl.fd < 0)
		return;
	shim_log(LOG_INFO, "disconnected from the daemon: %s", why);
	close(cl.fd);
	cl.fd = -1;
	pthread_mutex_lock(&shim_lock);
	cl.connected = 0;
	cl.head = cl.tail = 0;
	cl.overflow = 0;
	pthread_mutex_unlock(&shim_lock);
	remap_daemon_lost(); /* nothing may depend on the pool's shared copies any more */
}

static void handle_incoming(void);

/* Sends one record; waits (in this thread only) while the socket is full. */
static int send_rec(const void *buf, size_t len)
{
	while (cl.fd >= 0) {
		ssize_t n = send(cl.fd, buf, len, MSG_NOSIGNAL | MSG_DONTWAIT);
		if (n == (ssize_t)len)
			return 0;
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && errno == EAGAIN) {
			struct pollfd p = { .fd = cl.fd, .events = POLLOUT | POLLIN };
			if (poll(&p, 1, 1000) > 0 && (p.revents & POLLIN))
				handle_incoming();
			continue;
		}
		disconnect(n < 0 ? strerror(errno) : "short send");
		return -1;
	}
	return -1;
}

static int send_region(int type, const struct region *r)
{
	if (type == TRD_REGISTER) {
		struct trd_register m = { 0 };
		fill_hdr(&m.h, TRD_REGISTER, sizeof m);
		m.region_id = r->id;
		m.start = r->start;
		m.length = r->len;
		m.flags = r->flags & TRD_F_WIRE_MASK;
		m.policy = r->policy;
		m.source = r->source;
		m.node = r->node;
		memcpy(m.tag, shim_cfg.tag, sizeof m.tag);
		return send_rec(&m, sizeof m);
	}
	struct trd_unregister m = { 0 };
	fill_hdr(&m.h, TRD_UNREGISTER, sizeof m);
	m.region_id = r->id;
	m.start = r->start;
	m.length = r->len;
	return send_rec(&m, sizeof m);
}

static void send_error(uint32_t ref_seq, int code, const char *msg)
{
	struct trd_error m = { 0 };
	fill_hdr(&m.h, TRD_ERROR, sizeof m);
	m.ref_seq = ref_seq;
	m.code = code;
	strncpy(m.message, msg, sizeof m.message - 1);
	/* Replies never wait: a daemon that does not read its replies loses them. */
	if (cl.fd >= 0)
		send(cl.fd, &m, sizeof m, MSG_NOSIGNAL | MSG_DONTWAIT);
}

static void send_ack(uint32_t ref_seq)
{
	struct trd_ack m = { 0 };
	fill_hdr(&m.h, TRD_ACK, sizeof m);
	m.ref_seq = ref_seq;
	if (cl.fd >= 0)
		send(cl.fd, &m, sizeof m, MSG_NOSIGNAL | MSG_DONTWAIT);
}

/* ---- connection ---------------------------------------------------------------------------------- */

static int try_connect(void)
{
	struct sockaddr_un addr = { .sun_family = AF_UNIX };
	shim_format(addr.sun_path, sizeof addr.sun_path, "%s/%s", shim_cfg.run_dir, TRD_SOCKET_NAME);
	int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	if (fd < 0)
		return -1;
	if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
		close(fd);
		return -1;
	}
	struct ucred cred;
	socklen_t clen = sizeof cred;
	if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &clen) != 0) {
		close(fd);
		return -1;
	}
	cl.fd = fd;
	cl.peer_uid = cred.uid;
	cl.peer_pid = cred.pid;
	cl.gen++;
	shim_log(LOG_INFO, "connected to the daemon at %s (pid %d, uid %u)", addr.sun_path, (int)cred.pid,
		 (unsigned)cred.uid);

	struct trd_hello h = { 0 };
	fill_hdr(&h.h, TRD_HELLO, sizeof h);
	h.pid = getpid();
	h.min_bytes = shim_cfg.min_bytes;
	h.policy = (uint8_t)shim_cfg.policy;
	h.backing = (uint8_t)shim_cfg.backing;
	strncpy(h.agent, SHIM_AGENT, sizeof h.agent - 1);
	if (send_rec(&h, sizeof h) != 0)
		return -1;
	pthread_mutex_lock(&shim_lock);
	cl.connected = 1;
	cl.head = cl.tail = 0;
	pthread_mutex_unlock(&shim_lock);
	cl.need_resync = 1;
	return 0;
}

/* RESET, then every region in address order. The table may change between batches; walking by
 * address (not index) never skips a region, and changes made meanwhile are in the queue. */
static void resync(void)
{
	struct trd_hdr reset;
	pthread_mutex_lock(&shim_lock);
	cl.head = cl.tail = 0;
	cl.overflow = 0;
	pthread_mutex_unlock(&shim_lock);
	cl.need_resync = 0;
	fill_hdr(&reset, TRD_RESET, sizeof reset);
	if (send_rec(&reset, sizeof reset) != 0)
		return;
	uintptr_t last = 0;
	int first = 1;
	for (;;) {
		struct region batch[32];
		int n = 0;
		pthread_mutex_lock(&shim_lock);
		long i = first ? (shim_nregions ? 0 : -1) : region_next_after(last);
		for (; i >= 0 && i < (long)shim_nregions && n < 32; i++)
			batch[n++] = *region_at(i);
		pthread_mutex_unlock(&shim_lock);
		if (!n)
			return;
		first = 0;
		for (int k = 0; k < n; k++)
			if (send_region(TRD_REGISTER, &batch[k]) != 0)
				return;
		last = batch[n - 1].start;
	}
}

static void drain_queue(void)
{
	for (;;) {
		struct item batch[64];
		int n = 0, overflow;
		pthread_mutex_lock(&shim_lock);
		while (cl.head != cl.tail && n < 64)
			batch[n++] = cl.ring[cl.head++ % RING];
		overflow = cl.overflow;
		pthread_mutex_unlock(&shim_lock);
		if (overflow) {
			resync();
			return;
		}
		if (!n)
			return;
		/* A region registered and gone within one batch need not be mentioned at all. */
		for (int a = 0; a < n; a++) {
			if (batch[a].type != TRD_REGISTER)
				continue;
			for (int b = a + 1; b < n; b++)
				if (batch[b].type == TRD_UNREGISTER && batch[b].r.id == batch[a].r.id) {
					batch[a].type = batch[b].type = 0;
					break;
				}
		}
		for (int k = 0; k < n; k++)
			if (batch[k].type && send_region(batch[k].type, &batch[k].r) != 0)
				return;
	}
}

/* ---- control channel ----------------------------------------------------------------------------- */

static void control_rebind(const struct trd_rebind *m)
{
	char msg[104];
	uintptr_t start = m->start, end = m->start + m->length;
	if (m->length == 0 || end < start || page_down(start) != start || page_up(m->length) != m->length) {
		send_error(m->h.seq, EINVAL, "REBIND: start and length must be page-aligned and non-zero");
		return;
	}
	if (m->policy > TRD_POL_PREFERRED || ((m->policy == TRD_POL_BIND || m->policy == TRD_POL_PREFERRED) && !m->nodemask)) {
		send_error(m->h.seq, EINVAL, "REBIND: unknown policy, or bind/preferred without a nodemask");
		return;
	}
	if ((m->flags & ~TRD_REBIND_FLAGS) ||
	    ((m->flags & TRD_REBIND_NUMA_BALANCING) && m->policy != TRD_POL_BIND)) {
		send_error(m->h.seq, EINVAL, "REBIND: unknown flag, or numa-balancing without policy bind");
		return;
	}
	struct region r;
	int found = 0;
	pthread_mutex_lock(&shim_lock);
	long i = region_find_containing(start);
	if (i >= 0 && region_at(i)->start + region_at(i)->len >= end) {
		r = *region_at(i);
		found = 1;
	}
	pthread_mutex_unlock(&shim_lock);
	if (!found) {
		shim_format(msg, sizeof msg, "REBIND: %p+%lu is not inside a region of this process",
			    (void *)start, (unsigned long)m->length);
		send_error(m->h.seq, ENOENT, msg);
		return;
	}
	if ((r.flags & TRD_F_PINNED) && (m->flags & TRD_REBIND_MOVE)) {
		send_error(m->h.seq, EBUSY, "REBIND: region is pinned; its pages cannot move");
		return;
	}
	int node;
	shim_nest++;
	int rc = shim_place((void *)start, m->length, m->policy, m->nodemask, m->flags, &node);
	shim_nest--;
	if (rc) {
		shim_format(msg, sizeof msg, "REBIND: mbind failed: %s", strerror(-rc));
		send_error(m->h.seq, -rc, msg);
		return;
	}
	if (start == r.start && end == r.start + r.len) {
		/* The whole region: its registration now names the new policy. */
		pthread_mutex_lock(&shim_lock);
		long j = region_find_containing(start);
		if (j >= 0 && region_at(j)->id == r.id) {
			region_at(j)->policy = m->policy;
			region_at(j)->node = (int16_t)node;
			client_enqueue(TRD_REGISTER, region_at(j));
		}
		pthread_mutex_unlock(&shim_lock);
	}
	send_ack(m->h.seq);
}

static void control_config(const struct trd_config *m)
{
	unsigned f = m->fields & ~shim_cfg.env_set; /* the environment wins over the daemon's file */
	if ((f & (TRD_CFG_POLICY | TRD_CFG_PINNED_POLICY)) &&
	    (m->policy > TRD_POL_WEIGHTED || m->pinned_policy > TRD_POL_WEIGHTED)) {
		send_error(m->h.seq, EINVAL, "CONFIG: unknown policy");
		return;
	}
	if ((f & TRD_CFG_MIN_BYTES) && m->min_bytes < REGION_ALIGN) {
		send_error(m->h.seq, EINVAL, "CONFIG: min_bytes below 2 MiB");
		return;
	}
	if (f & TRD_CFG_MAX_BYTES)
		shim_cfg.max_bytes = m->max_bytes;
	if (f & TRD_CFG_POLICY)
		shim_cfg.policy = m->policy;
	if (f & TRD_CFG_PINNED_POLICY)
		shim_cfg.pinned_policy = m->pinned_policy;
	if (f & TRD_CFG_THP)
		shim_cfg.thp = !!m->thp;
	if (f & TRD_CFG_KSM)
		shim_cfg.ksm = !!m->ksm;
	if (f & TRD_CFG_MIN_BYTES)
		shim_apply_min_bytes(m->min_bytes);
	send_ack(m->h.seq);
}

static void control_remap(const struct trd_remap *m, int *fds, int nfds)
{
	char msg[104] = "";
	int rc = remap_submit(m, fds, nfds, msg, sizeof msg);
	if (rc)
		send_error(m->h.seq, -rc, msg);
	/* else the remap thread replies when the job is done (client_post_reply) */
}

static size_t expected_size(int type)
{
	switch (type) {
	case TRD_ACK: return sizeof(struct trd_ack);
	case TRD_ERROR: return sizeof(struct trd_error);
	case TRD_PING: return sizeof(struct trd_hdr);
	case TRD_RESYNC: return sizeof(struct trd_hdr);
	case TRD_REBIND: return sizeof(struct trd_rebind);
	case TRD_CONFIG: return sizeof(struct trd_config);
	case TRD_REMAP: return sizeof(struct trd_remap);
	default: return 0;
	}
}

static void close_all(int *fds, int nfds)
{
	for (int i = 0; i < nfds; i++)
		close(fds[i]);
}

/* fds came with the record (SCM_RIGHTS): a well-formed REMAP from a root peer takes them; on every
 * other path handle_message closes them. Returns 1 when they were taken. */
static int handle_record(const unsigned char *buf, size_t n, int truncated, int *fds, int nfds)
{
	char msg[104];
	struct trd_hdr h;
	if (n < sizeof h) {
		send_error(0, EBADMSG, "record shorter than the 16-byte header");
		return 0;
	}
	memcpy(&h, buf, sizeof h);
	if (h.magic != TRD_MAGIC) {
		send_error(h.seq, EBADMSG, "bad magic (expected \"TRDK\")");
		return 0;
	}
	if (h.version != TRD_VERSION) {
		shim_format(msg, sizeof msg, "protocol version %u not supported; this shim speaks %u",
			    (unsigned)h.version, (unsigned)TRD_VERSION);
		send_error(h.seq, EPROTO, msg);
		return 0;
	}
	size_t want = expected_size(h.type);
	if (!want) {
		shim_format(msg, sizeof msg, "unknown message type %u", (unsigned)h.type);
		send_error(h.seq, EOPNOTSUPP, msg);
		return 0;
	}
	if (truncated || n != want || h.size != want) {
		shim_format(msg, sizeof msg, "type %u: record is %zu bytes, expected %zu", (unsigned)h.type, n, want);
		send_error(h.seq, EBADMSG, msg);
		return 0;
	}
	if (h.type == TRD_ACK)
		return 0;
	if (h.type == TRD_ERROR) {
		struct trd_error e;
		memcpy(&e, buf, sizeof e);
		e.message[sizeof e.message - 1] = '\0';
		shim_log(LOG_INFO, "daemon refused message %u: %s (errno %d)", e.ref_seq, e.message, e.code);
		return 0;
	}
	/* Everything else is a control request: only a root daemon may steer this process (and only a
	 * root daemon's descriptors are ever used). */
	if (cl.peer_uid != 0) {
		shim_format(msg, sizeof msg, "control requests need a root peer; this peer is uid %u",
			    (unsigned)cl.peer_uid);
		shim_log(LOG_WARN, "refused control message type %u from pid %d: %s", (unsigned)h.type,
			 (int)cl.peer_pid, msg);
		send_error(h.seq, EPERM, msg);
		return 0;
	}
	switch (h.type) {
	case TRD_PING: {
		struct trd_pong p = { 0 };
		fill_hdr(&p.h, TRD_PONG, sizeof p);
		p.ref_seq = h.seq;
		p.pid = getpid();
		pthread_mutex_lock(&shim_lock);
		p.nregions = (uint32_t)shim_nregions;
		p.managed_bytes = regions_total_bytes();
		pthread_mutex_unlock(&shim_lock);
		send(cl.fd, &p, sizeof p, MSG_NOSIGNAL | MSG_DONTWAIT);
		break;
	}
	case TRD_RESYNC:
		send_ack(h.seq);
		cl.need_resync = 1;
		break;
	case TRD_REBIND: {
		struct trd_rebind m;
		memcpy(&m, buf, sizeof m);
		control_rebind(&m);
		break;
	}
	case TRD_CONFIG: {
		struct trd_config m;
		memcpy(&m, buf, sizeof m);
		control_config(&m);
		break;
	}
	case TRD_REMAP: {
		struct trd_remap m;
		memcpy(&m, buf, sizeof m);
		control_remap(&m, fds, nfds);
		return 1;
	}
	}
	return 0;
}

static void handle_message(const unsigned char *buf, size_t n, int truncated, int *fds, int nfds)
{
	if (!handle_record(buf, n, truncated, fds, nfds))
		close_all(fds, nfds);
}



#define MAX_FDS_IN 4

/* The descriptors of an SCM_RIGHTS message (at most MAX_FDS_IN are kept; any more are closed). */
static int take_fds(struct msghdr *mh, int *fds)
{
	int n = 0;
	for (struct cmsghdr *c = CMSG_FIRSTHDR(mh); c; c = CMSG_NXTHDR(mh, c)) {
		if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
			continue;
		int count = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
		for (int i = 0; i < count; i++) {
			int fd;
			memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
			if (n < MAX_FDS_IN)
				fds[n++] = fd;
			else
				close(fd);
		}
	}
	return n;
}

static void handle_incoming(void)
{
	for (;;) {
		union { unsigned char b[512]; uint64_t align; } buf;
		union { char b[CMSG_SPACE(MAX_FDS_IN * sizeof(int))]; struct cmsghdr align; } ctl;
		struct iovec iov = { buf.b, sizeof buf.b };
		struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.b,
				     .msg_controllen = sizeof ctl.b };
		ssize_t n = recvmsg(cl.fd, &mh, MSG_DONTWAIT | MSG_TRUNC | MSG_CMSG_CLOEXEC);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && errno == EAGAIN)
			return;
		int fds[MAX_FDS_IN];
		int nfds = n >= 0 ? take_fds(&mh, fds) : 0;
		if (n <= 0) {
			close_all(fds, nfds);
			disconnect(n == 0 ? "daemon closed the connection" : strerror(errno));
			return;
		}
		handle_message(buf.b, (size_t)n > sizeof buf.b ? sizeof buf.b : (size_t)n, (size_t)n > sizeof buf.b,
			       fds, nfds);
	}
}

/* ---- replies made by other threads ------------------------------------------------------------- */

unsigned client_generation(void)
{
	return cl.gen;
}

void client_post_reply(unsigned gen, uint32_t ref_seq, int code, const char *msg)
{
	pthread_mutex_lock(&shim_lock);
	if (cl.mb_tail - cl.mb_head >= MAILBOX)
		cl.mb_head++; /* the oldest is dropped: the daemon times out on it and reads /proc/PID/maps */
	struct reply *r = &cl.mailbox[cl.mb_tail++ % MAILBOX];
	r->gen = gen;
	r->ref_seq = ref_seq;
	r->code = code;
	strncpy(r->msg, msg ? msg : "", sizeof r->msg - 1);
	r->msg[sizeof r->msg - 1] = '\0';
	pthread_mutex_unlock(&shim_lock);
	client_kick();
}

/* Sends the posted replies that answer this connection (a restarted daemon learns the outcome from
 * /proc/PID/maps instead). */
static void send_mailbox(void)
{
	for (;;) {
		struct reply r;
		pthread_mutex_lock(&shim_lock);
		int any = cl.mb_head != cl.mb_tail;
		if (any)
			r = cl.mailbox[cl.mb_head++ % MAILBOX];
		pthread_mutex_unlock(&shim_lock);
		if (!any)
			return;
		if (cl.fd < 0 || r.gen != cl.gen)
			continue;
		if (r.code)
			send_error(r.ref_seq, r.code, r.msg);
		else
			send_ack(r.ref_seq);
	}
}


/* ---- the thread ---------------------------------------------------------------------------------- */

static void watch_run_dir(void)
{
	if (cl.ifd < 0)
		cl.ifd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
	if (cl.ifd >= 0 && cl.wd < 0)
		cl.wd = inotify_add_watch(cl.ifd, shim_cfg.run_dir, IN_CREATE | IN_MOVED_TO | IN_ATTRIB);
}

static void drain_fd(int fd)
{
	char buf[4096];
	while (fd >= 0 && read(fd, buf, sizeof buf) > 0)
		;
}

static void *client_main(void *arg)
{
	(void)arg;
	prctl(PR_SET_NAME, "tieringd-shim", 0, 0, 0);
	shim_nest++; /* nothing this thread allocates is ever managed */
	for (;;) {
		if (cl.fd < 0) {
			if (try_connect() != 0) {
				watch_run_dir();
				struct pollfd p[2] = { { .fd = cl.efd, .events = POLLIN }, { .fd = cl.ifd, .events = POLLIN } };
				poll(p, cl.ifd >= 0 ? 2 : 1, cl.wd >= 0 ? RETRY_WATCHED_MS : RETRY_MS);
				drain_fd(cl.efd);
				if (p[1].revents & POLLIN)
					drain_fd(cl.ifd);
				continue; /* without a watch (no directory yet), watch_run_dir() tries again */
			}
		}
		if (cl.need_resync)
			resync();
		drain_queue();
		if (cl.fd < 0)
			continue;
		struct pollfd p[2] = { { .fd = cl.fd, .events = POLLIN }, { .fd = cl.efd, .events = POLLIN } };
		if (poll(p, 2, -1) < 0)
			continue;
		if (p[1].revents & POLLIN)
			drain_fd(cl.efd);
		/* What was queued before a request arrived goes out before its reply: a PONG then
		 * vouches for every region the app made before the PING. */
		drain_queue();
		send_mailbox();
		if (cl.fd >= 0 && (p[0].revents & (POLLIN | POLLHUP | POLLERR)))
			handle_incoming();
	}
	return NULL;
}

static void start_thread(void)
{
	if (!shim_cfg.do_register || __atomic_exchange_n(&cl.started, 1, __ATOMIC_ACQ_REL))
		return;
	cl.efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	int rc = shim_start_thread(&cl.tid, client_main);
	if (rc != 0) {
		shim_log(LOG_WARN, "cannot start the registry thread (error %d): regions stay unregistered", rc);
		if (cl.efd >= 0)
			close(cl.efd);
		cl.efd = -1;
	}
}

void client_kick(void)
{
	if (!__atomic_load_n(&cl.started, __ATOMIC_ACQUIRE)) {
		start_thread();
		return;
	}
	if (cl.efd >= 0) {
		int saved = errno;
		uint64_t one = 1;
		ssize_t w = write(cl.efd, &one, sizeof one);
		(void)w;
		errno = saved;
	}
}

/* ---- fork ---------------------------------------------------------------------------------------- */

/* The child has no registry thread, and the connection it inherited is the parent's: close it
 * (without a word on it), and start over under the child's own pid. */
void client_fork_child(void)
{
	int fds[] = { cl.fd, cl.efd, cl.ifd };
	for (unsigned i = 0; i < sizeof fds / sizeof *fds; i++)
		if (fds[i] >= 0)
			close(fds[i]);
	cl.fd = cl.efd = cl.ifd = cl.wd = -1;
	cl.connected = 0;
	cl.head = cl.tail = 0;
	cl.overflow = 0;
	cl.need_resync = 0;
	cl.seq = 0;
	cl.mb_head = cl.mb_tail = 0; /* replies were the parent's */
	__atomic_store_n(&cl.started, 0, __ATOMIC_RELEASE);
	if (shim_nregions)
		start_thread(); /* inherited regions are registered under the child's pid */
}
