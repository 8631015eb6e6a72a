# SPDX-License-Identifier: Apache-2.0
"""Python side of ``bpf/dmacopy.bpf.c``: host memory read or written by DMA-copy APIs, per (pid, block).

The uprobes are attached by symbol to every ELF object a tracked process maps that defines one of
:data:`DMA_SYMBOLS` — libcudart.so, libcuda.so, a framework that links cudart statically, or the
tests' libfakecudart.so — with pid -1 (a uprobe belongs to the file, not the process; the in-kernel
filter keeps tracked tgids). Libraries opened later (frameworks dlopen CUDA lazily) are picked up by
:meth:`DmaCopySampler.refresh`, which :meth:`read_blocks` calls when the tracked set changed and every
``refresh_s`` seconds.
"""
from __future__ import annotations

import logging
import os
import time

from tieringd.kernel import procfs
from tieringd.kernel.procfs import read_maps
from tieringd.contracts import SampleSource

from . import _elf
from .base import BpfSampler, SamplerUnavailable, explain_bpf_error

log = logging.getLogger(__name__)

# bpf/dmacopy.h, every #define (tests/unit/test_sampling_headers.py compiles the header and compares)
DMA_API_CUDA_MEMCPY = 1
DMA_API_CU_HTOD = 2
DMA_API_CU_DTOH = 3
DMA_DIR_READ = 1
DMA_DIR_WRITE = 2
DMA_MAX_BLOCKS = 64
API_NAMES = {DMA_API_CUDA_MEMCPY: "cudaMemcpy*", DMA_API_CU_HTOD: "cuMemcpyHtoD*",
             DMA_API_CU_DTOH: "cuMemcpyDtoH*"}

# exported symbol → BPF program (the program knows which argument is the host pointer)
DMA_SYMBOLS = {
    "cudaMemcpy": "cuda_memcpy",
    "cudaMemcpyAsync": "cuda_memcpy",
    "cudaMemcpy_ptds": "cuda_memcpy",          # per-thread default stream builds
    "cudaMemcpyAsync_ptsz": "cuda_memcpy",
    "cuMemcpyHtoD": "cu_memcpy_htod",
    "cuMemcpyHtoD_v2": "cu_memcpy_htod",
    "cuMemcpyHtoDAsync": "cu_memcpy_htod",
    "cuMemcpyHtoDAsync_v2": "cu_memcpy_htod",
    "cuMemcpyDtoH": "cu_memcpy_dtoh",
    "cuMemcpyDtoH_v2": "cu_memcpy_dtoh",
    "cuMemcpyDtoHAsync": "cu_memcpy_dtoh",
    "cuMemcpyDtoHAsync_v2": "cu_memcpy_dtoh",
}


def mapped_objects(pid: int) -> list[str]:
    """Executable file mappings of ``pid`` (paths as the process sees them)."""
    out = []
    for vma in read_maps(pid, []):
        if vma.executable and vma.path.startswith("/") and not vma.path.endswith("(deleted)") \
                and vma.path not in out:
            out.append(vma.path)
    return out


class DmaCopySampler(BpfSampler):
    tool = "dmacopy"
    source = SampleSource.DMA

    def __init__(self, tracked, *, refresh_s: float = 5.0, **kw):
        super().__init__(tracked, **kw)
        self.refresh_s = refresh_s
        self.attached: dict[tuple[int, int], list[str]] = {}   # (dev, ino) → symbols probed
        self._scanned: dict[tuple[int, int, int], dict[str, int]] = {}   # (dev, ino, mtime) → offsets
        self._generation = -1
        self._last_refresh = 0.0

    def attach(self) -> None:
        self.refresh()

    def attach_object(self, path: str) -> list[str]:
        """Probe every DMA symbol ``path`` defines (once per inode); returns the symbols probed."""
        try:
            st = os.stat(path)
        except OSError:
            return []
        ident = (st.st_dev, st.st_ino)
        if ident in self.attached:
            return self.attached[ident]
        key = (st.st_dev, st.st_ino, st.st_mtime_ns)
        if key not in self._scanned:
            try:
                self._scanned[key] = _elf.function_offsets(path, set(DMA_SYMBOLS))
            except (OSError, _elf.ElfError) as e:
                log.debug("dmacopy: skip %s: %s", path, e)
                self._scanned[key] = {}
        offsets = self._scanned[key]
        if not offsets:
            return []
        done = []
        for sym, off in sorted(offsets.items()):
            try:
                self.links.append(self.obj.program(DMA_SYMBOLS[sym]).attach_uprobe(path, off))
            except OSError as e:
                raise SamplerUnavailable(explain_bpf_error(e, f"dmacopy uprobe {sym}")) from e
            done.append(sym)
        self.attached[ident] = done
        log.info("dmacopy: probing %s in %s", ", ".join(done), path)
        return done

    def refresh(self) -> None:
        """Attach to what the tracked processes map now. A library that cannot be probed is logged
        and skipped (once per inode): the other sources keep running."""
        for pid in self.tracked.pids():
            for obj in mapped_objects(pid):
                # through the process's root: right even when it runs in another mount namespace
                path = procfs.root_path(pid, obj)
                try:
                    self.attach_object(path)
                except SamplerUnavailable as e:
                    log.warning("dmacopy: %s", e)
                    try:
                        st = os.stat(path)
                        self.attached[(st.st_dev, st.st_ino)] = []
                    except OSError:
                        pass
        self._generation = self.tracked.generation
        self._last_refresh = time.monotonic()

    def read_blocks(self):
        if self._generation != self.tracked.generation or \
                time.monotonic() - self._last_refresh > self.refresh_s:
            self.refresh()
        return super().read_blocks()
