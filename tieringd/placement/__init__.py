# SPDX-License-Identifier: Apache-2.0
"""Where each KV block belongs: the block table and its four-factor heat (:mod:`.heat`), the plan of
moves per tick (:mod:`.policy`), position-aware prefetch (:mod:`.prefetch`), how many processes share a
block (:mod:`.sharing`), and the KV block size (:mod:`.blocksize`)."""
