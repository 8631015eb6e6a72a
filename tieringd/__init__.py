# SPDX-License-Identifier: Apache-2.0
"""tieringd: keep hot LLM KV-cache blocks in fast memory and cold ones in CXL/persistent tiers.

Data flows one way: topology → registry → samplers → heat → policy → mover. The daemon loop and the
CLI sit outside and call in.
"""
__version__ = "0.1.0"
