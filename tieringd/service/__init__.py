# SPDX-License-Identifier: Apache-2.0
"""What turns the loop into a service (:mod:`.service`): the control socket ``tieringctl`` talks to
(:mod:`.control`), the reports it answers with (:mod:`.reports`), Prometheus metrics (:mod:`.metrics`),
process exits (:mod:`.lifecycle`) and systemd's readiness protocol (:mod:`.sd_notify`)."""
