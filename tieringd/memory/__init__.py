# SPDX-License-Identifier: Apache-2.0
"""The memory this machine has: NUMA nodes and the tier each belongs to, with the evidence
(:mod:`.topology`), measured bandwidth and latency per node (:mod:`.probe`), DAX devices as system RAM
(:mod:`.dax`), and memory that arrives at run time (:mod:`.hotplug`)."""
