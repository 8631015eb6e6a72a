// SPDX-License-Identifier: Apache-2.0
// Configuration, read once from the environment with secure_getenv (so a setuid program ignores
// it), and logging that never allocates: the shim logs from inside malloc.
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "shim.h"

/* Default TIERINGD_MIN_BYTES: 4 MiB. docs/shim.md gives the reasoning; in short, it is two huge pages
 * (so rounding a region up to 2 MiB wastes at most a third of it), it catches every KV pool of
 * interest (vLLM's per-layer CPU KV tensors are hundreds of MiB, llama.cpp's single KV buffer is tens
 * of MiB even for 1B models, a Llama-3-8B per-layer K or V tensor of one 2K-token sequence is
 * exactly 4 MiB), and it is far above the sizes ordinary programs churn through. */
#define DEFAULT_MIN_BYTES (4UL << 20)

struct shim_config shim_cfg = {
	.enabled = 0,
	.min_bytes = DEFAULT_MIN_BYTES,
	.max_bytes = (size_t)-1,
	.min_align = 0,
	.policy = TRD_POL_FAST,
	.pinned_policy = TRD_POL_WEIGHTED,
	.backing = 0,
	.thp = 1,
	.ksm = 0,
	.manage_mmap = 1,
	.small_cache = 1,
	.do_register = 1,
	.log_level = LOG_WARN,
	.run_dir = "/run/tieringd",
	.fs_root = "",
	.tag = "",
};

static const char *const policy_names[] = {
	[TRD_POL_NONE] = "none", [TRD_POL_FAST] = "fast", [TRD_POL_SLOW_FIRST] = "slow-first",
	[TRD_POL_INTERLEAVE] = "interleave", [TRD_POL_WEIGHTED] = "weighted",
	[TRD_POL_BIND] = "bind", [TRD_POL_PREFERRED] = "preferred",
};

int shim_parse_policy(const char *s)
{
	for (int i = 0; i <= TRD_POL_WEIGHTED; i++)
		if (strcmp(s, policy_names[i]) == 0)
			return i;
	if (strcmp(s, "weighted-interleave") == 0)
		return TRD_POL_WEIGHTED;
	return -1;
}

const char *shim_policy_name(int policy)
{
	if (policy < 0 || policy > TRD_POL_PREFERRED)
		return "?";
	return policy_names[policy];
}

/* "4M", "4MiB", "4194304", "1g" -> bytes; -1 on error. */
static long long parse_size(const char *s)
{
	char *end;
	errno = 0;
	unsigned long long v = strtoull(s, &end, 10);
	if (errno || end == s)
		return -1;
	unsigned shift = 0;
	switch (*end) {
	case 'k': case 'K': shift = 10; end++; break;
	case 'm': case 'M': shift = 20; end++; break;
	case 'g': case 'G': shift = 30; end++; break;
	case 't': case 'T': shift = 40; end++; break;
	}
	if (shift && *end == 'i')
		end++;
	if (*end == 'B' || (*end == 'b' && !shift))
		end++;
	if (*end != '\0' || (shift && v > (~0ULL >> shift)) || (v << shift) > (unsigned long long)LLONG_MAX)
		return -1;
	return (long long)(v << shift);
}

static int parse_bool(const char *s, int dflt)
{
	if (!strcmp(s, "1") || !strcmp(s, "yes") || !strcmp(s, "true") || !strcmp(s, "on"))
		return 1;
	if (!strcmp(s, "0") || !strcmp(s, "no") || !strcmp(s, "false") || !strcmp(s, "off"))
		return 0;
	shim_log(LOG_WARN, "ignoring boolean setting %s (use 0 or 1)", s);
	return dflt;
}

static void copy_str(char *dst, size_t size, const char *src, const char *name)
{
	size_t n = strlen(src);
	if (n >= size) {
		shim_log(LOG_WARN, "%s is longer than %zu bytes; ignored", name, size - 1);
		return;
	}
	memcpy(dst, src, n + 1);
}

void shim_config_load(void)
{
	const char *v;
	struct shim_config *c = &shim_cfg;

	if ((v = secure_getenv("TIERINGD_LOG")))
		c->log_level = atoi(v);
	if ((v = secure_getenv("TIERINGD_DISABLE")) && parse_bool(v, 0))
		return; /* enabled stays 0 */
	if ((v = secure_getenv("TIERINGD_MIN_BYTES"))) {
		long long n = parse_size(v);
		if (n <= 0)
			shim_log(LOG_WARN, "TIERINGD_MIN_BYTES=%s is not a size (e.g. 4M); using %zu", v, c->min_bytes);
		else {
			c->min_bytes = (size_t)n;
			c->env_set |= TRD_CFG_MIN_BYTES;
		}
	}
	if ((v = secure_getenv("TIERINGD_MAX_BYTES"))) {
		long long n = parse_size(v);
		if (n <= 0)
			shim_log(LOG_WARN, "TIERINGD_MAX_BYTES=%s is not a size; no upper bound", v);
		else {
			c->max_bytes = (size_t)n;
			c->env_set |= TRD_CFG_MAX_BYTES;
		}
	}
	if ((v = secure_getenv("TIERINGD_MIN_ALIGN"))) {
		long long n = parse_size(v);
		if (n < 0 || (n & (n - 1)))
			shim_log(LOG_WARN, "TIERINGD_MIN_ALIGN=%s is not a power of two; ignored", v);
		else
			c->min_align = (size_t)n;
	}
	if ((v = secure_getenv("TIERINGD_POLICY"))) {
		int p = shim_parse_policy(v);
		if (p < 0)
			shim_log(LOG_WARN, "TIERINGD_POLICY=%s is not one of none, fast, slow-first, interleave, weighted; using %s",
				 v, shim_policy_name(c->policy));
		else {
			c->policy = p;
			c->env_set |= TRD_CFG_POLICY;
		}
	}
	if ((v = secure_getenv("TIERINGD_PINNED_POLICY"))) {
		int p = shim_parse_policy(v);
		if (p < 0)
			shim_log(LOG_WARN, "TIERINGD_PINNED_POLICY=%s is not a policy; using %s", v,
				 shim_policy_name(c->pinned_policy));
		else {
			c->pinned_policy = p;
			c->env_set |= TRD_CFG_PINNED_POLICY;
		}
	}
	if ((v = secure_getenv("TIERINGD_BACKING"))) {
		if (!strcmp(v, "memfd"))
			c->backing = 1;
		else if (strcmp(v, "anon") != 0)
			shim_log(LOG_WARN, "TIERINGD_BACKING=%s is not anon or memfd; using anon", v);
	}
	if ((v = secure_getenv("TIERINGD_THP"))) {
		c->thp = parse_bool(v, c->thp);
		c->env_set |= TRD_CFG_THP;
	}
	if ((v = secure_getenv("TIERINGD_KSM"))) {
		c->ksm = parse_bool(v, c->ksm);
		c->env_set |= TRD_CFG_KSM;
	}
	if ((v = secure_getenv("TIERINGD_MMAP")))
		c->manage_mmap = parse_bool(v, c->manage_mmap);
	if ((v = secure_getenv("TIERINGD_SMALL_CACHE")))
		c->small_cache = parse_bool(v, c->small_cache);
	if ((v = secure_getenv("TIERINGD_REGISTER")))
		c->do_register = parse_bool(v, c->do_register);
	if ((v = secure_getenv("TIERINGD_RUN_DIR")) && *v)
		copy_str(c->run_dir, sizeof c->run_dir, v, "TIERINGD_RUN_DIR");
	if ((v = secure_getenv("TIERINGD_FS_ROOT")))
		copy_str(c->fs_root, sizeof c->fs_root, v, "TIERINGD_FS_ROOT");
	if ((v = secure_getenv("TIERINGD_TAG")))
		copy_str(c->tag, sizeof c->tag, v, "TIERINGD_TAG");
	c->enabled = 1;
}

/* ---- logging ------------------------------------------------------------------------------------ */

struct out { char *p, *end; };

static void put_c(struct out *o, char c)
{
	if (o->p < o->end)
		*o->p++ = c;
}

static void put_s(struct out *o, const char *s)
{
	if (!s)
		s = "(null)";
	while (*s)
		put_c(o, *s++);
}

static void put_u(struct out *o, unsigned long long v, unsigned base, int neg)
{
	char tmp[24];
	int n = 0;
	do {
		tmp[n++] = "0123456789abcdef"[v % base];
		v /= base;
	} while (v);
	if (neg)
		put_c(o, '-');
	while (n)
		put_c(o, tmp[--n]);
}

static int vformat(char *buf, size_t size, const char *fmt, va_list ap)
{
	struct out o = { buf, buf + size - 1 };
	for (; *fmt; fmt++) {
		if (*fmt != '%') {
			put_c(&o, *fmt);
			continue;
		}
		int l = 0, z = 0;
		fmt++;
		while (*fmt == 'l') { l++; fmt++; }
		if (*fmt == 'z') { z = 1; fmt++; }
		switch (*fmt) {
		case 's': put_s(&o, va_arg(ap, const char *)); break;
		case 'c': put_c(&o, (char)va_arg(ap, int)); break;
		case 'd': {
			long long v = l ? va_arg(ap, long) : va_arg(ap, int);
			put_u(&o, v < 0 ? -(unsigned long long)v : (unsigned long long)v, 10, v < 0);
			break;
		}
		case 'u': put_u(&o, z ? va_arg(ap, size_t) : l ? va_arg(ap, unsigned long) : va_arg(ap, unsigned), 10, 0); break;
		case 'x': put_u(&o, z ? va_arg(ap, size_t) : l ? va_arg(ap, unsigned long) : va_arg(ap, unsigned), 16, 0); break;
		case 'p': put_s(&o, "0x"); put_u(&o, (uintptr_t)va_arg(ap, void *), 16, 0); break;
		case '%': put_c(&o, '%'); break;
		case '\0': fmt--; break;
		default: put_c(&o, '?'); break;
		}
	}
	*o.p = '\0';
	return (int)(o.p - buf);
}

int shim_format(char *buf, size_t size, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	int n = vformat(buf, size, fmt, ap);
	va_end(ap);
	return n;
}

int shim_start_thread(pthread_t *tid, void *(*fn)(void *))
{
	pthread_attr_t attr;
	pthread_attr_init(&attr);
	pthread_attr_setstacksize(&attr, 256 * 1024);
	pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
	sigset_t all, old;
	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &old); /* the new thread inherits the mask: no signals */
	shim_nest++;
	int rc = pthread_create(tid, &attr, fn, NULL);
	shim_nest--;
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	pthread_attr_destroy(&attr);
	return rc;
}

void shim_log(int level, const char *fmt, ...)
{
	if (level > shim_cfg.log_level)
		return;
	int saved = errno;
	char buf[512];
	int n = shim_format(buf, sizeof buf, "tieringd-shim[%d]: ", (int)getpid());
	va_list ap;
	va_start(ap, fmt);
	n += vformat(buf + n, sizeof buf - n - 1, fmt, ap);
	va_end(ap);
	buf[n++] = '\n';
	ssize_t w = write(2, buf, n);
	(void)w;
	errno = saved;
}
