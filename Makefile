# SPDX-License-Identifier: Apache-2.0
# tieringd — build, install, test.
#   make          build the C and BPF artefacts into build/
#   make test     install what is missing (apt packages, .venv), build, run every test
#   make bench    benchmarks (figures P1…); JSON + table under build/bench/ (BENCH_ARGS='--only P5')
#   make demo     tieringd keeping a KV workload's hot blocks on node 0, in the lab (build/demo/)
#   make lab      run CMD in a lab guest: make lab PROFILE=cxl KERNEL=6.12 CMD='numactl -H'
# Quiet by default; V=1 prints full commands.

PYTHON  ?= python3
VENV    := .venv
PY      := $(VENV)/bin/python
BUILD   := build

# Quiet by default: one line per output, as the kernel and bcc's libbpf-tools print them
# ("  CC      build/tests/x"); V=1 prints the full commands instead. Fragments write
# "$(call msg,CC,$@)" on the line before a command and prefix commands with $(Q).
ifeq ($(V),)
Q       := @
msg      = @printf '  %-7s %s\n' "$(1)" "$(2)";
else
Q       :=
msg      =
endif

.DELETE_ON_ERROR:
.PHONY: all install install-system venv test test-unit bench lab lab-kernels demo clean distclean

all:

# Each C/BPF part adds its outputs to BUILD_TARGETS in its own fragment.
BUILD_TARGETS :=
-include shim/shim.mk
-include bpf/bpf.mk
-include tests/progs/progs.mk
-include scripts/scripts.mk
-include udev/udev.mk

all: $(BUILD_TARGETS)

install: install-system venv install-udev

install-system:
	$(Q)scripts/install-system.sh

venv: $(VENV)/.installed

$(VENV)/.installed: setup.cfg pyproject.toml
	$(Q)test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(Q)$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	$(Q)touch $@

# TIERINGD_REQUIRE_ALL turns "facility missing" skips into failures: on the machines this project
# is built for, root, BPF, the shim and the lab are all here, and a skip would hide a broken install.
test: install all lab-kernels
	$(Q)TIERINGD_REQUIRE_ALL=1 $(PY) -m pytest $(PYTEST_ARGS)

test-unit: venv
	$(Q)$(PY) -m pytest tests/unit $(PYTEST_ARGS)

# The lab: QEMU/TCG guests with emulated CXL/PMem tiers (scripts/lab.py, docs/lab.md).
PROFILE ?= cxl
KERNEL  ?= 6.12
NODE_MIB ?=
lab: install all lab-kernels
	$(Q)$(PY) scripts/lab.py run --profile $(PROFILE) --kernel $(KERNEL) $(if $(NODE_MIB),--node-mib $(NODE_MIB)) -- "$$CMD"

lab-kernels: install
	$(Q)$(PY) scripts/lab.py fetch

# The demo: tieringd and the unmodified KV workload in the lab (cxl, 1 GiB nodes, 6.12); scripts/demo.py.
DEMO_ARGS ?=
demo: install all lab-kernels
	$(Q)$(PY) scripts/demo.py $(DEMO_ARGS)

bench: install all lab-kernels
	$(Q)$(PY) scripts/bench/run.py --out $(BUILD)/bench $(BENCH_ARGS)

clean:
	rm -rf $(BUILD)

distclean: clean
	rm -rf $(VENV) .cache
