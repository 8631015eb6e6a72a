# SPDX-License-Identifier: Apache-2.0
"""Kernel settings the daemon borrows: set for its run, put back on every exit path.

The access signal needs global kernel state changed — NUMA balancing's mode and scan rate, the
tiering mode's promotion rate limit, reclaim-time demotion (docs/loop.md). Global state is borrowed,
never taken: :class:`Knobs` writes a value only after it has recorded the original in a state file
(JSON, written atomically, by default ``/run/tieringd/knobs.json``), so a daemon that crashes leaves
behind exactly what the next start needs to undo it; :meth:`Knobs.recover` does that first and says
so. :meth:`Knobs.restore` puts everything back (last borrowed, first restored) and removes the file.

A setting somebody else changed while it was borrowed is left as they set it (and logged): putting
our original back would undo their change, not ours.

Settings are named as the kernel documents them (:data:`KNOWN`); a name can stand for several paths,
the first that exists is used (the scan settings moved from sysctl to debugfs in v5.13, commit
8a99b6833c88 "sched: Move SCHED_DEBUG sysctl to debugfs"). A setting the kernel lacks is not an
error: :meth:`Knobs.borrow` returns None and :attr:`Knobs.missing` says why, and the caller decides.
Every read and write goes through :mod:`tieringd.kernel.sysfs`, so tests run against a fake tree.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
import time

from tieringd.kernel import procfs, sysfs

log = logging.getLogger(__name__)

SCHEMA = "tieringd.knobs/1"
DEFAULT_STATE_PATH = "/run/tieringd/knobs.json"
DEBUGFS_NUMA = "/sys/kernel/debug/sched/numa_balancing"

# name → candidate paths, first existing wins.
KNOWN: dict[str, tuple[str, ...]] = {
    "kernel.numa_balancing": (procfs.sysctl_path("kernel.numa_balancing"),),
    # v6.1 (memory tiering's hot page selection): MB/s the tiering mode may promote; 0 = nothing,
    # except while the fast node has plenty free (pgdat_free_space_enough(), docs/sampling.md)
    "kernel.numa_balancing_promote_rate_limit_MBps":
        (procfs.sysctl_path("kernel.numa_balancing_promote_rate_limit_MBps"),),
    # v5.15: reclaim demotes to the next tier instead of discarding
    "mm.numa.demotion_enabled": ("/sys/kernel/mm/numa/demotion_enabled",),
    **{f"numa_balancing.{k}": (f"{DEBUGFS_NUMA}/{k}", procfs.sysctl_path(f"kernel.numa_balancing_{k}"))
       for k in ("scan_delay_ms", "scan_period_min_ms", "scan_period_max_ms", "scan_size_mb")},
    # v6.1, debugfs only
    "numa_balancing.hot_threshold_ms": (f"{DEBUGFS_NUMA}/hot_threshold_ms",),
    # DAMON_STAT (v6.17; Debian's 7.x enables it at boot) runs its kdamond exclusively: while it runs
    # the DAMON sysfs interface cannot start one (EBUSY)
    "damon_stat.enabled": ("/sys/module/damon_stat/parameters/enabled",),
}


class KnobError(RuntimeError):
    """The state file cannot be used (unreadable, held by a live process)."""


@dataclasses.dataclass(frozen=True)
class Change:
    """One borrowed setting: where, what it was, what we set (and set before, when borrowed again)."""
    name: str
    path: str
    original: str
    value: str
    earlier: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.name} {self.original}→{self.value}"

    def ours(self, now: str) -> bool:
        """Whether ``now`` is a value we wrote (so putting the original back undoes only us)."""
        return any(_same(now, v) for v in (self.value, *self.earlier))


def resolve(name: str) -> tuple[str | None, str]:
    """(path, "") of a known setting or an absolute path, or (None, why it is absent)."""
    candidates = KNOWN.get(name) or ((name,) if name.startswith("/") else ())
    if not candidates:
        raise ValueError(f"unknown kernel setting {name!r}; known: {', '.join(KNOWN)}")
    for p in candidates:
        if sysfs.exists(p):
            return p, ""
    if any(p.startswith("/sys/kernel/debug/") for p in candidates) and \
            not sysfs.exists("/sys/kernel/debug/sched"):
        return None, f"{name}: absent ({candidates[0]}; is debugfs mounted on /sys/kernel/debug?)"
    return None, f"{name}: this kernel has no {' or '.join(candidates)}"


def _same(a: str, b: str) -> bool:
    # demotion_enabled reads "true"/"false" but is written 1/0 as well
    norm = {"true": "1", "false": "0", "y": "1", "n": "0"}
    return norm.get(a.lower(), a) == norm.get(b.lower(), b)


class Knobs:
    """The settings this process borrowed. Use as ``with Knobs(path) as k: k.borrow(...)``, or call
    :meth:`recover` at start and :meth:`restore` on every exit path."""

    def __init__(self, state_path: str | os.PathLike = DEFAULT_STATE_PATH):
        self.state_path = os.fspath(state_path)
        self.changes: list[Change] = []
        self.missing: dict[str, str] = {}
        self.recovered: list[Change] = []
        self._started = time.strftime("%Y-%m-%dT%H:%M:%S%z")

    # -- start ----------------------------------------------------------------------------------

    def recover(self) -> list[Change]:
        """Restore what a previous run left in the state file (it crashed or was killed), remove the
        file, and return what was put back. Refuses while the process that wrote it still runs."""
        state = self._read_state()
        if state is None:
            return []
        pid = state.get("pid")
        if isinstance(pid, int) and pid != os.getpid() and procfs.alive(pid):
            raise KnobError(f"{self.state_path}: kernel settings are borrowed by pid {pid}, which "
                            f"still runs (another tieringd?)")
        left = self._changes(state)
        log.warning("restoring %d kernel setting(s) left borrowed by a previous run (pid %s, "
                    "started %s): %s", len(left), pid, state.get("started", "?"),
                    ", ".join(map(str, left)) or "none")
        self.recovered = [c for c in reversed(left) if self._put_back(c)]
        self._remove_state()
        return self.recovered

    def holder(self) -> tuple[int, list[Change]] | None:
        """(pid, its borrowed settings) when another process that still runs holds the state file
        (the daemon, or another ``tieringctl sample``) — what makes :meth:`recover` refuse; else None.
        Raises :class:`KnobError` for an unreadable state file."""
        state = self._read_state()
        pid = state.get("pid") if state else None
        if not isinstance(pid, int) or pid == os.getpid() or not procfs.alive(pid):
            return None
        return pid, self._changes(state)

    # -- borrowing ------------------------------------------------------------------------------

    def borrow(self, name: str, value: str | int) -> Change | None:
        """Set ``name`` (a :data:`KNOWN` name or an absolute path) to ``value`` for this run.
        Returns the change, or None when the kernel lacks the setting or it cannot be read
        (:attr:`missing` says why) or it already has that value. Raises :class:`tieringd.kernel.sysfs.SysfsError` when the write fails
        (nothing is then recorded)."""
        path, why = resolve(name)
        if path is None:
            self.missing[name] = why
            log.info("kernel setting %s", why)
            return None
        value = str(value)
        old = next((c for c in self.changes if c.path == path), None)
        if old is not None:         # borrowed already: the first original is the one to restore
            if _same(old.value, value):
                return old
            change = dataclasses.replace(old, value=value, earlier=(*old.earlier, old.value))
        else:
            try:
                original = sysfs.read_text(path)
            except OSError as e:    # e.g. debugfs under lockdown: EPERM; unknown original, no write
                self.missing[name] = f"{name}: {e}"
                log.info("kernel setting %s", self.missing[name])
                return None
            if _same(original, value):
                log.debug("kernel setting %s is already %s", name, original)
                return None
            change = Change(name, path, original, value)
        others = [c for c in self.changes if c is not old]
        self._write_state(others + [change])                # recorded before it is changed
        try:
            sysfs.write_text(path, value)
        except OSError:
            self._write_state(self.changes)
            raise
        self.changes = others + [change]
        log.info("borrowed %s: %s → %s", name, old.value if old else change.original, value)
        return change

    def restore(self) -> list[Change]:
        """Put every borrowed setting back (last first), remove the state file; idempotent."""
        restored = [c for c in reversed(self.changes) if self._put_back(c)]
        self.changes = []
        self._remove_state()
        return restored

    def describe(self) -> str:
        """"kernel.numa_balancing 0→3, …" for the log and the status; "none" when nothing."""
        return ", ".join(map(str, self.changes)) or "none"

    def __enter__(self) -> "Knobs":
        self.recover()
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    # -- internals ------------------------------------------------------------------------------

    def _put_back(self, c: Change) -> bool:
        now = sysfs.read_text(c.path, None)
        if now is None:
            log.warning("cannot restore %s to %s: %s is gone", c.name, c.original, c.path)
            return False
        if _same(now, c.original):
            return False            # never changed (a crash between recording and writing)
        if not c.ours(now):
            log.warning("%s was changed to %s by someone else while borrowed (we set %s); left as "
                        "it is, not restored to %s", c.name, now, c.value, c.original)
            return False
        try:
            sysfs.write_text(c.path, c.original)
        except OSError as e:
            log.error("cannot restore %s to %s: %s", c.name, c.original, e)
            return False
        log.info("restored %s: %s → %s", c.name, c.value, c.original)
        return True

    def _changes(self, state: dict) -> list[Change]:
        try:
            return [Change(**{**c, "earlier": tuple(c.get("earlier", ()))})
                    for c in state.get("changes", [])]
        except (TypeError, AttributeError) as e:
            raise KnobError(f"{self.state_path}: not a {SCHEMA} state file: {e}") from None

    def _read_state(self) -> dict | None:
        try:
            with open(self.state_path, encoding="utf-8") as f:
                state = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise KnobError(f"{self.state_path}: unreadable state file ({e}); check the kernel "
                            f"settings by hand, then remove it") from None
        if not isinstance(state, dict) or state.get("schema") != SCHEMA:
            raise KnobError(f"{self.state_path}: not a {SCHEMA} state file")
        return state

    def _write_state(self, changes: list[Change]) -> None:
        d = os.path.dirname(self.state_path) or "."
        os.makedirs(d, exist_ok=True)
        state = {"schema": SCHEMA, "pid": os.getpid(),
                 "started": self._started,
                 "changes": [dataclasses.asdict(c) for c in changes]}
        fd, tmp = tempfile.mkstemp(prefix=".knobs.", dir=d)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(state, f, indent=1)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.state_path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def _remove_state(self) -> None:
        try:
            os.unlink(self.state_path)
        except FileNotFoundError:
            pass
