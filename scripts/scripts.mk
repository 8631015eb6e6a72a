# SPDX-License-Identifier: Apache-2.0
# The measuring loops of `tieringctl probe` (scripts/membench.c), loaded through ctypes.
MEMBENCH_SO := $(BUILD)/libtieringd-membench.so

$(MEMBENCH_SO): scripts/membench.c
	$(call msg,CC,$@)
	$(Q)mkdir -p $(BUILD)
	$(Q)$(CC) -O2 -g -Wall -Wextra -pthread -fPIC -shared -o $@ $<

BUILD_TARGETS += $(MEMBENCH_SO)
