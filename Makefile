# SPDX-License-Identifier: Apache-2.0
# tieringd — build, install, test.
#   make          build the C and BPF artefacts into build/
#   make test     install what is missing (apt packages, .venv), build, run every test
#   make bench    benchmarks (figures P1…); JSON + table under build/bench/
#   make lab      run CMD in a lab guest: make lab PROFILE=cxl KERNEL=6.12 CMD='numactl -H'
# Quiet by default; V=1 prints full commands.

PYTHON  ?= python3
VENV    := .venv
PY      := $(VENV)/bin/python
BUILD   := build
Q       := $(if $(V),,@)

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
lab: install all lab-kernels
	$(Q)$(PY) scripts/lab.py run --profile $(PROFILE) --kernel $(KERNEL) -- "$$CMD"

lab-kernels: install
	$(Q)$(PY) scripts/lab.py fetch

# The demo needs the daemon loop, which is not built yet (README): say so rather than "no rule".
demo:
	@echo "make demo: not built yet; it arrives with the daemon loop (see README). Meanwhile: make test, make bench, make lab." >&2
	@exit 2

bench: install all lab-kernels
	$(Q)$(PY) scripts/bench/run.py --out $(BUILD)/bench $(BENCH_ARGS)

clean:
	rm -rf $(BUILD)

distclean: clean
	rm -rf $(VENV) .cache
