# SPDX-License-Identifier: Apache-2.0
# BPF CO-RE objects: every bpf/NAME.bpf.c becomes build/bpf/NAME.bpf.o, compiled once against the pinned
# bpf/vmlinux.h and relocated by libbpf at load time on each kernel (6.1 … 6.18). No per-file rules.
BPF_CLANG ?= clang
BPF_STRIP ?= llvm-strip
# The pinned bpf/vmlinux.h holds x86-64's kernel types (scripts/gen-vmlinux-h.sh). CO-RE relocates field
# offsets, not another architecture's pt_regs or syscall wrappers: elsewhere, stop before compiling.
BPF_HOST_ARCH ?= $(shell uname -m)
BPF_ARCH  := $(if $(filter x86_64,$(BPF_HOST_ARCH)),x86)
bpf_arch_check = $(if $(BPF_ARCH),,$(error bpf/vmlinux.h is x86_64's and this machine is $(BPF_HOST_ARCH): \
  regenerate it there with scripts/gen-vmlinux-h.sh and map $(BPF_HOST_ARCH) in bpf/bpf.mk))
BPF_CFLAGS := -g -O2 -target bpf -D__TARGET_ARCH_$(BPF_ARCH) -Wall -Wno-unused-function -Ibpf
BPF_SRC   := $(wildcard bpf/*.bpf.c)
BPF_OBJS  := $(patsubst bpf/%.bpf.c,$(BUILD)/bpf/%.bpf.o,$(BPF_SRC))
BPF_HDRS  := bpf/vmlinux.h bpf/tracking.h bpf/tracking.bpf.h bpf/core_fixes.bpf.h

# -g keeps BTF (CO-RE needs it); llvm-strip -g then drops DWARF only, not .BTF/.BTF.ext.
$(BUILD)/bpf/%.bpf.o: bpf/%.bpf.c bpf/%.h $(BPF_HDRS) | $(BUILD)/bpf
	$(bpf_arch_check)
	$(call msg,BPF,$@)
	$(Q)$(BPF_CLANG) $(BPF_CFLAGS) -c $< -o $@
	$(Q)$(BPF_STRIP) -g $@

$(BUILD)/bpf:
	$(Q)mkdir -p $@

BUILD_TARGETS += $(BPF_OBJS)
