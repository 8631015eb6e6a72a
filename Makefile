# SPDX-License-Identifier: Apache-2.0
# tieringd — build, install, test.
#   make          build the C and BPF artefacts into build/
#   make setup    the development environment: apt packages, .venv (make test does it too)
#   make test     install what is missing (apt packages, .venv), build, run every test
#   make install  install tieringd on this machine: its own venv, the systemd unit, the default config,
#                 udev rules, shell completion (PREFIX=/usr/local, DESTDIR=; docs/service.md)
#   make uninstall  remove what make install put there (a changed config file stays)
#   make bench    benchmarks (figures P1…); JSON + table under build/bench/ (BENCH_ARGS='--only P5')
#   make reliability  the reliability suite: access, fuzzers, load, kill trials and faults (lab); one table, JSON under build/reliability/
#   make engine   the lab's inference engine, llama.cpp (20 minutes on 2 cores, once; .cache/engine/)
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
.PHONY: all setup install uninstall install-system venv test test-unit bench engine reliability lab lab-kernels demo clean distclean

all:

# Each C/BPF part adds its outputs to BUILD_TARGETS in its own fragment.
BUILD_TARGETS :=
-include shim/shim.mk
-include bpf/bpf.mk
-include tests/progs/progs.mk
-include scripts/scripts.mk
-include udev/udev.mk

all: $(BUILD_TARGETS)

# The development environment (the checkout's .venv, editable); `make install` is the operator's.
setup: install-system venv

install-system:
	$(Q)scripts/install-system.sh

venv: $(VENV)/.installed

$(VENV)/.installed: setup.cfg pyproject.toml
	$(Q)test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(Q)$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	$(Q)touch $@

# TIERINGD_REQUIRE_ALL turns "facility missing" skips into failures: on the machines this project
# is built for, root, BPF, the shim and the lab are all here, and a skip would hide a broken install.
# TEST_JOBS pytest-xdist workers (TEST_JOBS=1: one process, as pytest by hand): the host's tests in one
# of them, lab guests two at a time, longest boots first (tests/lab_workers.py says why and how).
TEST_JOBS ?= 2
test: setup all lab-kernels
	$(Q)TIERINGD_REQUIRE_ALL=1 $(PY) -m pytest $(if $(filter-out 1,$(TEST_JOBS)),-n $(TEST_JOBS)) $(PYTEST_ARGS)

test-unit: venv
	$(Q)$(PY) -m pytest tests/unit $(PYTEST_ARGS)

# The lab: QEMU/TCG guests with emulated CXL/PMem tiers (scripts/lab.py, docs/lab.md).
PROFILE ?= cxl
KERNEL  ?= 6.12
NODE_MIB ?=
lab: setup all lab-kernels
	$(Q)$(PY) scripts/lab.py run --profile $(PROFILE) --kernel $(KERNEL) $(if $(NODE_MIB),--node-mib $(NODE_MIB)) -- "$$CMD"

lab-kernels: setup
	$(Q)$(PY) scripts/lab.py fetch

# The demo: tieringd and the unmodified KV workload in the lab (cxl, 1 GiB nodes, 6.12); scripts/demo.py.
DEMO_ARGS ?=
demo: setup all lab-kernels
	$(Q)$(PY) scripts/demo.py $(DEMO_ARGS)

bench: setup all lab-kernels engine
	$(Q)$(PY) scripts/bench/run.py --out $(BUILD)/bench $(BENCH_ARGS)

# The reliability suite (docs/reliability.md): RELIABILITY_ARGS='--quick', '--seed S', '--only fuzz-control'.
RELIABILITY_ARGS ?=
reliability: venv all
	$(Q)$(PY) scripts/reliability/run.py --out $(BUILD)/reliability $(RELIABILITY_ARGS)

# llama.cpp through llama-cpp-python, built from source for generic x86-64 into a venv of its own
# (figure P5-engine, tests/lab/test_engine_lab.py); a no-op once built. scripts/lab/engine_env.py.
engine: setup
	$(Q)$(PY) scripts/lab/engine_env.py

# ---- install / uninstall (docs/service.md) ------------------------------------------------------------
# The package goes into a venv of its own, root-owned, under PREFIX: Debian 12's python3 is externally
# managed (PEP 668: pip refuses the system site), bookworm's python3-prometheus-client is 0.16 (0.17 is
# needed), and a root service must not run code from a checkout its owner can still write to. The
# venv is built in place (venvs do not move): DESTDIR is for staging and tests, not for packages.
PREFIX     ?= /usr/local
SYSCONFDIR ?= /etc
UNITDIR    ?= $(PREFIX)/lib/systemd/system
LIBDIR     := $(PREFIX)/lib/tieringd
SHAREDIR   := $(PREFIX)/share/tieringd
COMPLETIONDIR ?= $(PREFIX)/share/bash-completion/completions
IVENV      := $(LIBDIR)/venv
# the group whose members may use the control socket; empty: no group is created
TIERINGD_GROUP ?= tieringd
D          := $(DESTDIR)

install: all
	$(call msg,VENV,$(D)$(IVENV))
	$(Q)test -x $(D)$(IVENV)/bin/python || $(PYTHON) -m venv $(D)$(IVENV)
	$(call msg,PIP,tieringd into $(D)$(IVENV))
	$(Q)$(D)$(IVENV)/bin/python -m pip install -q --disable-pip-version-check --no-warn-script-location .
	$(call msg,INSTALL,$(D)$(PREFIX)/bin/tieringd $(D)$(PREFIX)/bin/tieringctl)
	$(Q)install -d $(D)$(PREFIX)/bin
	$(Q)ln -sf $(IVENV)/bin/tieringd $(D)$(PREFIX)/bin/tieringd
	$(Q)ln -sf $(IVENV)/bin/tieringctl $(D)$(PREFIX)/bin/tieringctl
	$(call msg,INSTALL,$(D)$(LIBDIR) (shim and BPF objects))
	$(Q)install -D -m 0755 $(BUILD)/libtieringd-shim.so $(D)$(LIBDIR)/libtieringd-shim.so
	$(Q)install -d $(D)$(LIBDIR)/bpf && install -m 0644 $(BUILD)/bpf/*.bpf.o $(D)$(LIBDIR)/bpf/
	$(call msg,INSTALL,$(D)$(UNITDIR)/tieringd.service)
	$(Q)install -d $(D)$(UNITDIR)
	$(Q)sed -e 's|/usr/local|$(PREFIX)|g' -e 's|/etc/tieringd|$(SYSCONFDIR)/tieringd|g' systemd/tieringd.service \
		> $(D)$(UNITDIR)/tieringd.service
	$(Q)install -D -m 0644 etc/tieringd.toml $(D)$(SHAREDIR)/tieringd.toml
	$(Q)install -D -m 0644 docs/service.md $(D)$(PREFIX)/share/doc/tieringd/service.md
	$(Q)if [ -e $(D)$(SYSCONFDIR)/tieringd/tieringd.toml ]; then \
		echo "  KEEP    $(D)$(SYSCONFDIR)/tieringd/tieringd.toml (the shipped one: $(SHAREDIR)/tieringd.toml)"; \
	else printf '  %-7s %s\n' INSTALL $(D)$(SYSCONFDIR)/tieringd/tieringd.toml; \
		install -D -m 0644 etc/tieringd.toml $(D)$(SYSCONFDIR)/tieringd/tieringd.toml; fi
	$(call msg,GEN,$(D)$(COMPLETIONDIR)/tieringctl)
	$(Q)install -d $(D)$(COMPLETIONDIR)
	$(Q)_TIERINGCTL_COMPLETE=bash_source $(D)$(IVENV)/bin/tieringctl > $(D)$(COMPLETIONDIR)/tieringctl
	$(Q)if [ -f udev/udev.mk ]; then $(MAKE) --no-print-directory install-udev \
		TIERINGD_PYTHON=$(IVENV)/bin/python; fi
	$(Q)if [ -n "$(TIERINGD_GROUP)" ] && [ -z "$(DESTDIR)" ] && ! getent group $(TIERINGD_GROUP) >/dev/null; then \
		printf '  %-7s %s\n' GROUP $(TIERINGD_GROUP); groupadd --system $(TIERINGD_GROUP); fi
	$(Q)if [ -z "$(DESTDIR)" ] && [ -d /run/systemd/system ]; then systemctl daemon-reload; fi
	@echo "installed. Start it: systemctl enable --now tieringd; reports: tieringctl status" \
		"(root$(if $(TIERINGD_GROUP), or members of group $(TIERINGD_GROUP)))"

uninstall:
	$(Q)if [ -z "$(DESTDIR)" ] && [ -d /run/systemd/system ]; then \
		systemctl disable --now tieringd 2>/dev/null || true; fi
	$(call msg,RM,$(D)$(LIBDIR) $(D)$(SHAREDIR) and the links to them)
	$(Q)if [ -f $(D)$(SYSCONFDIR)/tieringd/tieringd.toml ] && \
		! cmp -s $(D)$(SYSCONFDIR)/tieringd/tieringd.toml $(D)$(SHAREDIR)/tieringd.toml; then \
		echo "  KEEP    $(D)$(SYSCONFDIR)/tieringd/tieringd.toml (changed since the install)"; \
	else rm -f $(D)$(SYSCONFDIR)/tieringd/tieringd.toml; rmdir $(D)$(SYSCONFDIR)/tieringd 2>/dev/null || true; fi
	$(Q)rm -rf $(D)$(LIBDIR) $(D)$(SHAREDIR) $(D)$(PREFIX)/share/doc/tieringd
	$(Q)rm -f $(D)$(PREFIX)/bin/tieringd $(D)$(PREFIX)/bin/tieringctl $(D)$(UNITDIR)/tieringd.service \
		$(D)$(COMPLETIONDIR)/tieringctl
	$(Q)if [ -f udev/udev.mk ]; then $(MAKE) --no-print-directory uninstall-udev; fi
	$(Q)if [ -z "$(DESTDIR)" ] && [ -d /run/systemd/system ]; then systemctl daemon-reload; fi
	@echo "uninstalled$(if $(TIERINGD_GROUP),; the group $(TIERINGD_GROUP) stays (groupdel $(TIERINGD_GROUP)),)"

clean:
	rm -rf $(BUILD)

distclean: clean
	rm -rf $(VENV) .cache
