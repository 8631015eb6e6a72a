// SPDX-License-Identifier: Apache-2.0
// A memory-bound workload for figure P3 (sampler overhead): sums a buffer much larger than the caches,
// over and over, for --seconds, and reports the bytes read per second.
//
//   stream_sum [--mib N] [--seconds S] [--wait]
//
// Prints {"pid", "base", "len"} once the buffer is populated (with --wait it then reads a line before
// starting), and {"done": true, "bytes": B, "seconds": S, "gb_s": X} at the end.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

static double now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(int argc, char **argv)
{
	long mib = 256;
	double seconds = 3;
	int wait = 0;

	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--mib") && i + 1 < argc) mib = atol(argv[++i]);
		else if (!strcmp(argv[i], "--seconds") && i + 1 < argc) seconds = atof(argv[++i]);
		else if (!strcmp(argv[i], "--wait")) wait = 1;
		else {
			fprintf(stderr, "usage: %s [--mib N] [--seconds S] [--wait]\n", argv[0]);
			return 2;
		}
	}
	if (mib < 1 || seconds <= 0) {
		fprintf(stderr, "stream_sum: --mib and --seconds must be positive\n");
		return 2;
	}
	size_t len = (size_t)mib << 20, n = len / sizeof(uint64_t);
	uint64_t *buf = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (buf == MAP_FAILED) {
		perror("mmap");
		return 1;
	}
	for (size_t i = 0; i < n; i++)
		buf[i] = i;
	printf("{\"pid\": %d, \"base\": %lu, \"len\": %zu}\n", getpid(), (unsigned long)buf, len);
	fflush(stdout);
	if (wait) {
		char line[64];
		if (!fgets(line, sizeof(line), stdin))
			return 0;
	}
	uint64_t sum = 0, bytes = 0;
	double t0 = now_s(), t;
	do {
		for (size_t i = 0; i < n; i += 4)
			sum += buf[i] + buf[i + 1] + buf[i + 2] + buf[i + 3];
		bytes += len;
		t = now_s();
	} while (t - t0 < seconds);
	printf("{\"done\": true, \"bytes\": %lu, \"seconds\": %.6f, \"gb_s\": %.4f, \"sum\": %lu}\n",
	       (unsigned long)bytes, t - t0, bytes / (t - t0) / 1e9, (unsigned long)sum);
	return 0;
}
