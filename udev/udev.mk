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
# Installed only where udev runs (udevadm exists). Generated straight from the template with the
# installed Python: the build tree's copy ($(UDEV_RULES), the checkout's venv) is the lab's and stays
# as it is (rewriting it with a temporary prefix's Python broke test_dax_lab after test_service_install).
install-udev:
	$(Q)if command -v udevadm >/dev/null; then \
		install -d $(DESTDIR)$(UDEV_RULES_DIR) && \
		sed 's|@PYTHON@|$(TIERINGD_PYTHON)|g' udev/60-tieringd.rules.in > $(DESTDIR)$(UDEV_RULES_DIR)/60-tieringd.rules && \
		chmod 0644 $(DESTDIR)$(UDEV_RULES_DIR)/60-tieringd.rules && \
		{ udevadm control --reload 2>/dev/null || true; }; \
	else echo "install-udev: no udevadm here: no rules installed (the template: udev/60-tieringd.rules.in)"; fi

uninstall-udev:
	$(Q)rm -f $(DESTDIR)$(UDEV_RULES_DIR)/60-tieringd.rules
