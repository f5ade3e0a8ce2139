"""The warm pool: a zygote (``worker/zygote.py``) that imported torch
and the worker runtime forks each rank's shepherd, so workers start without importing
torch again. One zygote serves every job of this process while what workers would
inherit stays the same (environment, cwd, sys.path, installed packages: the
``fingerprint``); a change starts a new one, and the old one ends once its last worker is
reaped. It dies with this process (PR_SET_PDEATHSIG against the long-lived thread that
spawned it, and EOF on its socket).

A zygote, and the ranks it forks, are handled through ``zygote_link.py``.

Each zygote also imports the kernel's preload list (``preload.py``): when workers report
modules it lacks, a successor is built in the background with the longer list; the current
zygote serves every cell until the successor is ready, then retires as above. A cell never
waits for a rebuild; only the first zygote, or one for new inherited settings, is built in
a cell's path (as before).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import sys
import threading
from collections.abc import Iterable
from pathlib import Path

from .preload import Entry, PreloadList
from .zygote_link import PooledProcess, PoolError, Tainted, Zygote, zygote_env

__all__ = ["PoolError", "PooledProcess", "WarmPool", "Zygote", "fingerprint", "prewarm",
           "shutdown_pool", "warm_pool", "zygote_env"]

_PACKAGE_DIR = Path(__file__).resolve().parents[1]


def _can_watch_others() -> bool:
    """pidfd_open (Linux 5.3): how we see a shepherd that is not our child exit."""
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        return False
    return True


_SUPPORTED = sys.platform.startswith("linux") and _can_watch_others()


def fingerprint(env: dict[str, str], cwd: str, sys_path: Iterable[str]) -> str:
    """What a zygote's imports depend on: the environment, cwd, sys.path, and the
    installed packages (the modification times of sys.path's package folders, which
    installing or removing a package changes, and of this package's own files). A user's
    own folders are not looked at: the zygote imports nothing from them."""
    paths = list(sys_path)
    stamps = {}
    packages = [p for p in paths if Path(p).name in ("site-packages", "dist-packages")]
    for entry in [*packages, *map(str, _PACKAGE_DIR.rglob("*.py"))]:
        with contextlib.suppress(OSError):
            stamps[entry] = os.stat(entry).st_mtime_ns
    text = json.dumps([sys.executable, sorted(zygote_env(env).items()), cwd, paths, stamps])
    return hashlib.sha256(text.encode()).hexdigest()


class WarmPool:
    """This process's zygotes: the current one, a successor being built with a longer
    preload list, and retired ones until their last worker is reaped."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a background build ended
        self._current: Zygote | None = None
        self._retired: list[Zygote] = []
        self._prewarming: threading.Thread | None = None
        self._failed: set[str] = set()  # fingerprints whose zygote could not start
        self.preload = PreloadList()
        self._builder: threading.Thread | None = None  # building a successor
        self._building: Zygote | None = None
        self._stopping = False
        self._gave_up: set[str] = set()  # fingerprints whose successor could not start

    def zygote_for(self, env: dict[str, str], cwd: str, sys_path: Iterable[str],
                   preload: Iterable[str] = ()) -> Zygote:
        """The zygote whose workers inherit what these would: the current one, or a new
        one (the old one retires). ``preload``: modules the job names; the current zygote
        serves meanwhile if it lacks them. Raises PoolError when it cannot start."""
        if not _SUPPORTED:
            raise PoolError("the warm pool needs Linux 5.3 or later (pidfd_open)")
        sys_path = list(sys_path)
        key = fingerprint(env, cwd, sys_path)
        with self._lock:
            self.preload.add(((name, None) for name in preload), named=True)
            current = self._current
            if current is not None and current.key == key and current.alive():
                self._rebuild_if_grown()
                return current
            if key in self._failed:  # it would fail again: fresh workers say why
                raise PoolError("the worker pool failed to start with these settings")
            if current is not None:
                self._retire(current)
                self._current = None
            while True:  # each module that taints a zygote is left out: this ends
                try:
                    zygote = Zygote(env, cwd, key, sys_path, self.preload.modules())
                    zygote.wait_ready()
                except Tainted as exc:
                    self.preload.leave_out(exc.module, exc.why)
                    continue
                except PoolError:
                    self._failed.add(key)
                    raise
                self._install(zygote)
                return zygote

    def learn(self, modules: Iterable[Entry]) -> None:
        """Modules a pooled worker imported beyond its zygote: the next zygote has them
        (built now, in the background)."""
        with self._lock:
            if self.preload.add(modules):
                self._rebuild_if_grown()

    def _install(self, zygote: Zygote) -> None:
        for name, why in zygote.left_out.items():
            self.preload.leave_out(name, why)
        self.preload.drop_implied(zygote.implied)
        self._current = zygote

    def _rebuild_if_grown(self) -> None:
        """With the lock held: start building a successor when the current zygote lacks
        part of the preload list (one build at a time; the next follows if need be)."""
        current = self._current
        if self._builder is not None or self._stopping or current is None \
                or not current.alive() or current.key in self._gave_up \
                or self.preload.covered_by(current.modules):
            return
        self._builder = threading.Thread(target=self._build,
                                         args=(current, self.preload.modules()),
                                         name="elastic-pool-rebuild", daemon=True)
        self._builder.start()

    def _build(self, current: Zygote, modules: tuple[Entry, ...]) -> None:
        """A successor to ``current`` with ``modules``; it takes over once ready, if
        ``current`` is still the zygote for those settings."""
        env, cwd, sys_path = current.inputs
        successor: Zygote | None = None
        try:
            successor = Zygote(env, cwd, current.key, sys_path, modules, current.spares)
            with self._lock:
                self._building = successor
                if self._stopping:
                    successor.cancel()
            successor.wait_ready()
        except Tainted as exc:  # a module it must not import, or one it died on
            successor = None
            with self._lock:
                if self._current is current:  # (else the list was forgotten meanwhile)
                    self.preload.leave_out(exc.module, exc.why)
        except PoolError:  # not a module's doing (it could not start): try no more
            successor = None
            with self._lock:
                if not self._stopping:  # (else we ended it ourselves)
                    self._gave_up.add(current.key)
        stale = None
        with self._lock:
            self._builder = self._building = None
            if successor is not None:
                if self._current is current and current.alive() and not self._stopping:
                    self._retire(current)
                    self._install(successor)
                else:  # the settings changed meanwhile, or the pool is ending
                    stale = successor
            self._rebuild_if_grown()  # the list may have grown meanwhile
            self._changed.notify_all()
        if stale is not None:
            stale.close()

    @property
    def rebuilding(self) -> bool:
        """A successor with a longer preload list is being built."""
        with self._lock:
            return self._builder is not None

    def wait_rebuilt(self, timeout: float) -> bool:
        """Wait until no successor is being built (the current zygote has the whole
        preload list, or what could not be had is left out); False after ``timeout``."""
        with self._changed:
            return self._changed.wait_for(lambda: self._builder is None, timeout)

    def describe(self) -> list[str]:
        """What ``%elastic status`` says of the pool."""
        with self._lock:
            pid = self._current.pid if self._current is not None else None
            lines = self.preload.describe()
            if self._builder is not None:
                lines.append("a zygote with a longer list is being built")
        return [f"zygote PID {pid}" if pid else "no zygote running", *lines]

    def forget(self) -> None:
        """Forget the modules learned, named and left out: the next job's zygote is built
        with the defaults (``%elastic pool forget``). Running workers are left alone; a
        successor being built is dropped when done."""
        with self._lock:
            self.preload = PreloadList()
            self._gave_up.clear()
            self._failed.clear()
            if self._current is not None:
                self._retire(self._current)
                self._current = None

    def prewarm(self, env: dict[str, str], cwd: str, sys_path: list[str],
                preload: Iterable[str] = ()) -> None:
        def start() -> None:
            with contextlib.suppress(PoolError):
                self.zygote_for(env, cwd, sys_path, preload)

        self._prewarming = threading.Thread(target=start, name="elastic-pool-prewarm",
                                            daemon=True)
        self._prewarming.start()

    def _retire(self, zygote: Zygote) -> None:
        zygote.retired = True
        zygote.keep_spares(0)  # it forks no rank again: its live ranks keep it
        self._retired = [z for z in [*self._retired, zygote] if z.alive()]
        for old in [z for z in self._retired if not z.live]:
            old.close()
            self._retired.remove(old)

    @property
    def pids(self) -> list[int]:
        """The live zygotes' PIDs (a successor still importing is not one yet)."""
        with self._lock:
            zygotes = [z for z in [self._current, *self._retired] if z is not None]
            return [z.pid for z in zygotes if z.alive()]

    def shutdown(self) -> None:
        """End every zygote (and so any rank still running from one)."""
        if self._prewarming is not None:  # it may be about to start one
            self._prewarming.join()
        with self._lock:
            self._stopping = True
            builder, building = self._builder, self._building
        if building is not None:
            building.cancel()
        if builder is not None:
            builder.join()
        with self._lock:
            zygotes = [z for z in [self._current, *self._retired] if z is not None]
            self._current, self._retired = None, []
            self._stopping = False
        for zygote in zygotes:
            zygote.close()


_POOL: WarmPool | None = None
_POOL_LOCK = threading.Lock()


def warm_pool() -> WarmPool:
    """This process's pool, made on first use."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = WarmPool()
            atexit.register(_POOL.shutdown)
        return _POOL


def prewarm(env: dict[str, str], cwd: str, sys_path: Iterable[str],
            preload: Iterable[str] = ()) -> None:
    """Start the zygote for workers that inherit this, on a thread (``%load_ext``: it
    imports torch while the kernel does); a job that needs another rebuilds it."""
    warm_pool().prewarm(env, cwd, list(sys_path), preload)


def shutdown_pool() -> None:
    """End the pool if there is one (``%unload_ext``): no zygote is left."""
    with _POOL_LOCK:
        pool = _POOL
    if pool is not None:
        pool.shutdown()
