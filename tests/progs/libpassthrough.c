// SPDX-License-Identifier: Apache-2.0
// The least an LD_PRELOAD malloc interposer can be: every call forwarded to glibc, nothing else.
// Figure P1 runs it beside the shim, so the shim's cost is read against the floor that the
// extra call layer itself sets.
#include <stddef.h>

extern void *__libc_malloc(size_t);
extern void __libc_free(void *);

void *malloc(size_t n) { return __libc_malloc(n); }
void free(void *p) { __libc_free(p); }
