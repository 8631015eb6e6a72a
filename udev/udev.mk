# SPDX-License-Identifier: Apache-2.0
# udev rules for memory that arrives at run time (udev/60-tieringd.rules.in, docs/dax.md).
UDEV_RULES_DIR ?= /etc/udev/rules.d
TIERINGD_PYTHON ?= $(abspath $(VENV)/bin/python)
UDEV_RULES     := $(BUILD)/udev/60-tieringd.rules

$(UDEV_RULES): udev/60-tieringd.rules.in
	$(if $(Q),@echo "  GEN     $@")
	$(Q)mkdir -p $(@D)
	$(Q)sed 's|@PYTHON@|$(TIERINGD_PYTHON)|g' $< > $@

BUILD_TARGETS += $(UDEV_RULES)

.PHONY: install-udev uninstall-udev
# Installed only where udev runs (udevadm exists); elsewhere the rules stay in build/udev/.
install-udev: $(UDEV_RULES)
	$(Q)if command -v udevadm >/dev/null; then \
		install -D -m 0644 $(UDEV_RULES) $(DESTDIR)$(UDEV_RULES_DIR)/60-tieringd.rules && \
		{ udevadm control --reload 2>/dev/null || true; }; \
	else echo "install-udev: no udevadm here: rules left in $(UDEV_RULES)"; fi

uninstall-udev:
	$(Q)rm -f $(DESTDIR)$(UDEV_RULES_DIR)/60-tieringd.rules
