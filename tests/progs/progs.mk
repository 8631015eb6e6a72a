# SPDX-License-Identifier: Apache-2.0
# Test programs: every tests/progs/NAME.c becomes build/tests/NAME, every tests/progs/libNAME.c
# becomes build/tests/libNAME.so. No per-file rules needed: drop a .c file here.
PROGS_SRC  := $(filter-out tests/progs/lib%.c,$(wildcard tests/progs/*.c))
PROGS_LIBS := $(wildcard tests/progs/lib*.c)
PROGS      := $(patsubst tests/progs/%.c,$(BUILD)/tests/%,$(PROGS_SRC)) \
              $(patsubst tests/progs/%.c,$(BUILD)/tests/%.so,$(PROGS_LIBS))
PROGS_CFLAGS := -O2 -g -Wall -Wextra -pthread
# Programs that need extra libraries name them in a first-line comment: "// LDLIBS: -ldl -lnuma"
progs_ldlibs = $(shell sed -n '1,3s|^// LDLIBS: ||p' $(1))

# Programs may link the test libraries (LDLIBS: -Lbuild/tests -lNAME): build those first.
$(BUILD)/tests/%: tests/progs/%.c | $(BUILD)/tests $(patsubst tests/progs/%.c,$(BUILD)/tests/%.so,$(PROGS_LIBS))
	$(call msg,CC,$@)
	$(Q)$(CC) $(PROGS_CFLAGS) -o $@ $< $(call progs_ldlibs,$<)

$(BUILD)/tests/lib%.so: tests/progs/lib%.c | $(BUILD)/tests
	$(call msg,CC,$@)
	$(Q)$(CC) $(PROGS_CFLAGS) -fPIC -shared -o $@ $< $(call progs_ldlibs,$<)

$(BUILD)/tests:
	$(Q)mkdir -p $@

BUILD_TARGETS += $(PROGS)
