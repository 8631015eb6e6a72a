# SPDX-License-Identifier: Apache-2.0
"""``tieringctl run [--policy P] [--min-bytes N] -- CMD ARGS…``: exec CMD with the shim preloaded.

Settings come, strongest first, from the options, from ``TIERINGD_*`` variables already in the
environment, and from the ``[shim]`` table of the configuration file. The shim is found at
``--shim``, ``$TIERINGD_SHIM``, the repository's ``build/`` (a development checkout), or
``<prefix>/lib/tieringd/``. CMD's children inherit the preload (docs/shim.md: fork and exec).

Before the exec it knocks on the daemon's registry socket (``$RUN_DIR/registry.sock``, where the
shim registers): when nothing answers, one warning line on stderr says that CMD runs without tiering
and how to start the daemon (``-v``: which socket was tried, and why it failed). CMD runs anyway: its
shim connects by itself once a daemon starts."""
from __future__ import annotations

import errno
import os
import shutil
import socket
import sys
from pathlib import Path

import click

from tieringd import config
from tieringd.shim import protocol
from tieringd.shim.settings import MIN_BYTES_FLOOR, ShimSettings
from tieringd.cli._output import fail
from tieringd.units import parse_size

SHIM_NAME = "libtieringd-shim.so"
POLICIES = [p.label for p in protocol.ALLOCATION_POLICIES]


def find_shim(explicit: str | None) -> Path:
    if explicit:
        candidates = [Path(explicit)]
    else:
        candidates = [Path(p) for p in [os.environ.get("TIERINGD_SHIM")] if p]
        candidates += [Path(__file__).resolve().parents[2] / "build" / SHIM_NAME,
                       Path(sys.prefix) / "lib" / "tieringd" / SHIM_NAME,
                       Path(sys.prefix).parent / SHIM_NAME,      # make install: PREFIX/lib/tieringd/venv
                       Path("/usr/local/lib/tieringd") / SHIM_NAME,
                       Path("/usr/lib/tieringd") / SHIM_NAME]
    for c in candidates:
        if c.is_file():
            return c.resolve()
    fail(f"cannot find {SHIM_NAME} (looked in {', '.join(str(c) for c in candidates)}); "
         "build it with 'make' or name it with --shim")
    raise AssertionError("unreachable")


_FALSE = ("0", "no", "false", "off")       # shim/config.c parse_bool


def registry_refusal(run_dir: str | None) -> tuple[str, str] | None:
    """None when a daemon answers on the registry socket; else (the socket, why not). The probe
    connects and closes without a HELLO, which the registry drops quietly (tieringd/shim/registry.py)."""
    path = protocol.socket_path(run_dir)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    s.settimeout(2.0)
    try:
        s.connect(path)
    except FileNotFoundError:
        return path, "no such socket"
    except ConnectionRefusedError:
        return path, "connection refused (a stale socket: no daemon listens on it)"
    except OSError as e:
        return path, e.strerror or errno.errorcode.get(e.errno or 0, str(e))
    finally:
        s.close()
    return None


def warn_without_daemon(env: dict[str, str], cmd0: str, verbose: int) -> None:
    """One stderr line when CMD is about to run with no daemon to register with (docs/cli.md)."""
    if env.get("TIERINGD_REGISTER", "").lower() in _FALSE or \
            env.get("TIERINGD_DISABLE", "").lower() not in ("", *_FALSE):
        return                      # the shim was told not to talk to a daemon, or is off
    refusal = registry_refusal(env.get("TIERINGD_RUN_DIR") or None)
    if refusal is None:
        return
    path, why = refusal
    tried = f" (tried {path}: {why})" if verbose else ""
    click.echo(f"tieringctl: warning: no tieringd daemon answers{tried}: {cmd0} runs without tiering "
               f"until one starts (its shim registers then). Start it with 'systemctl start tieringd' "
               f"(or run 'tieringd' as root); set TIERINGD_RUN_DIR or --run-dir if it uses another run "
               f"directory", err=True)


def _size(ctx, param, value):
    if value is None:
        return None
    try:
        n = parse_size(value, param.opts[0], minimum=1)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    if param.name == "min_bytes" and n < MIN_BYTES_FLOOR:
        raise click.BadParameter("must be at least 2 MiB (a managed region is whole 2 MiB pages)")
    return n


@click.command("run", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--policy", type=click.Choice(POLICIES), help="placement of managed regions (default fast)")
@click.option("--pinned-policy", type=click.Choice(POLICIES),
              help="placement of pools that get pinned for a GPU (default weighted)")
@click.option("--min-bytes", callback=_size, metavar="SIZE",
              help="smallest allocation managed, e.g. 4M (default 4 MiB)")
@click.option("--max-bytes", callback=_size, metavar="SIZE", help="largest allocation managed")
@click.option("--backing", type=click.Choice(["anon", "memfd"]), help="memory behind managed regions")
@click.option("--thp/--no-thp", default=None, help="madvise(MADV_HUGEPAGE) on managed regions")
@click.option("--ksm/--no-ksm", default=None, help="madvise(MADV_MERGEABLE) on managed regions")
@click.option("--tag", help="label sent with every region (23 bytes at most)")
@click.option("--run-dir", type=click.Path(file_okay=False), help="the daemon's socket directory")
@click.option("--shim", "shim_path", type=click.Path(dir_okay=False), help="the shim library to preload")
@click.option("-v", "--verbose", count=True, help="shim log on stderr (-v info, -vv debug)")
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
def command(policy, pinned_policy, min_bytes, max_bytes, backing, thp, ksm, tag, run_dir, shim_path,
            verbose, cmd):
    """Run CMD with the tieringd shim preloaded (put -- before CMD)."""
    shim = find_shim(shim_path)
    cfg = None
    try:
        cfg = config.load()
        settings = ShimSettings.from_config(config.section(cfg, "shim"))
    except config.ConfigError as e:
        fail(f"configuration: {cfg.locate(e) if cfg is not None else e}")
    env = dict(os.environ)
    for key, value in settings.to_env().items():
        env.setdefault(key, value)
    options = {
        "TIERINGD_POLICY": policy, "TIERINGD_PINNED_POLICY": pinned_policy,
        "TIERINGD_MIN_BYTES": None if min_bytes is None else str(min_bytes),
        "TIERINGD_MAX_BYTES": None if max_bytes is None else str(max_bytes),
        "TIERINGD_BACKING": backing, "TIERINGD_THP": None if thp is None else str(int(thp)),
        "TIERINGD_KSM": None if ksm is None else str(int(ksm)), "TIERINGD_TAG": tag,
        "TIERINGD_RUN_DIR": run_dir, "TIERINGD_LOG": str(1 + verbose) if verbose else None,
    }
    if tag is not None and len(tag.encode()) > 23:
        raise click.BadParameter("at most 23 bytes", param_hint="--tag")
    env.update({k: v for k, v in options.items() if v is not None})
    preload = [p for p in env.get("LD_PRELOAD", "").replace(":", " ").split() if Path(p).name != SHIM_NAME]
    env["LD_PRELOAD"] = " ".join([str(shim)] + preload)
    program = shutil.which(cmd[0], path=env.get("PATH")) if "/" not in cmd[0] else cmd[0]
    if program is None or not os.access(program, os.X_OK):
        fail(f"{cmd[0]}: command not found", code=127)
    warn_without_daemon(env, os.path.basename(cmd[0]), verbose)
    try:
        os.execve(program, list(cmd), env)
    except OSError as e:
        fail(f"cannot run {cmd[0]}: {e.strerror}", code=126)
