// SPDX-License-Identifier: Apache-2.0
// A pool with known bytes, for the shared-block tests (tests/host/test_shim_share.py): the test
// shares a range of it with a file holding the same bytes and checks what the process then sees.
// Knows nothing of tieringd. Every byte the process reads or writes goes through the pool, from
// user mode (poke) or kernel mode (write(2) from the pool, read(2) into it).
//
//   share_pool MIB        fills the pool with a pattern, prints "pool ADDR LEN", then obeys stdin,
//                         one line each, answering one line:
//     save PATH           writes the whole pool to PATH (write(2): kernel-mode reads)   -> "saved"
//     poke OFF BYTE       stores BYTE over the page at OFF (user mode)                  -> "poked"
//     sum                 adds every byte of the pool in user mode                       -> "sum N"
//     fork PATH           forks; the child saves the pool to PATH and exits 0; waited     -> "forked STATUS"
//     renew               frees the pool, allocates a new one, fills it the same way       -> "pool ADDR LEN"
//     stop                exits 0
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define PAGE 4096UL

static unsigned char *pool;
static size_t len;

static int save(const char *path)
{
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
	if (fd < 0)
		return -1;
	size_t done = 0;
	while (done < len) {
		ssize_t n = write(fd, pool + done, len - done);
		if (n <= 0)
			break;
		done += (size_t)n;
	}
	close(fd);
	return done == len ? 0 : -1;
}

static void fill(void)
{
	for (size_t i = 0; i < len; i++) /* differs from page to page and within each page */
		pool[i] = (unsigned char)(i * 7 + (i / PAGE) * 13 + 1);
}

int main(int argc, char **argv)
{
	size_t mib = argc > 1 ? strtoul(argv[1], NULL, 10) : 16;
	len = mib << 20;
	pool = malloc(len);
	if (!pool)
		return 2;
	fill();
	printf("pool %p %zu\n", (void *)pool, len);
	fflush(stdout);
	char line[4200], path[4096];
	while (fgets(line, sizeof line, stdin)) {
		unsigned long off, byte;
		if (sscanf(line, "save %4095s", path) == 1) {
			printf(save(path) == 0 ? "saved\n" : "failed\n");
		} else if (sscanf(line, "poke %lu %lu", &off, &byte) == 2 && off + PAGE <= len) {
			memset(pool + off, (int)byte, PAGE);
			printf("poked\n");
		} else if (strncmp(line, "sum", 3) == 0) {
			unsigned long sum = 0;
			for (size_t i = 0; i < len; i++)
				sum += pool[i];
			printf("sum %lu\n", sum);
		} else if (sscanf(line, "fork %4095s", path) == 1) {
			fflush(stdout);
			pid_t pid = fork();
			if (pid == 0)
				_exit(save(path) == 0 ? 0 : 1);
			int status = -1;
			if (pid > 0)
				waitpid(pid, &status, 0);
			printf("forked %d\n", status);
		} else if (strncmp(line, "renew", 5) == 0) {
			free(pool);
			if (!(pool = malloc(len)))
				return 2;
			fill();
			printf("pool %p %zu\n", (void *)pool, len);
		} else if (strncmp(line, "stop", 4) == 0) {
			return 0;
		} else {
			printf("what?\n");
		}
		fflush(stdout);
	}
	return 0;
}
