# SPDX-License-Identifier: Apache-2.0
# The LD_PRELOAD shim: build/libtieringd-shim.so from shim/*.c (docs/shim.md).
SHIM_SO     := $(BUILD)/libtieringd-shim.so
SHIM_SRCS   := $(wildcard shim/*.c)
SHIM_OBJS   := $(patsubst shim/%.c,$(BUILD)/shim/%.o,$(SHIM_SRCS))
# -fvisibility=hidden: only the interposed symbols are exported, and the shim's own globals are
# reached RIP-relative, not through the GOT (the fast path reads one of them on every malloc).
# -fno-stack-protector / -fno-plt: nothing extra on that path. -z now: no lazy binding (and so no
# resolver running) inside malloc.
SHIM_CFLAGS := -O2 -g -std=gnu11 -Wall -Wextra -fPIC -fvisibility=hidden -fno-plt \
               -fno-stack-protector -ftls-model=initial-exec -pthread
SHIM_LDFLAGS := -shared -Wl,-z,now -Wl,-z,relro -Wl,--no-undefined -pthread
SHIM_LDLIBS := -ldl

$(SHIM_SO): $(SHIM_OBJS)
	$(call msg,LD,$@)
	$(Q)$(CC) $(SHIM_LDFLAGS) -o $@ $^ $(SHIM_LDLIBS)

$(BUILD)/shim/%.o: shim/%.c $(wildcard shim/*.h) | $(BUILD)/shim
	$(call msg,CC,$@)
	$(Q)$(CC) $(SHIM_CFLAGS) -c -o $@ $<

$(BUILD)/shim:
	$(Q)mkdir -p $@

# Test programs that link the fake CUDA runtime (tests/progs/libfakecudart.c).
$(BUILD)/tests/pinned_kv: $(BUILD)/tests/libfakecudart.so

BUILD_TARGETS += $(SHIM_SO)
