"""The launchers' watchdog: cancels a job's allocations if the kernel dies before it could.

The kernel starts ``python -m elastic_magic.launchers.watchdog`` in a session of its own
(a kernel killed with its process group leaves it running) with its stdin a pipe that only
the kernel writes. The kernel sends one JSON line per change: ``{"add": ID, "run":
[ARGV, ...]}`` when an allocation starts (what would end it), ``{"drop": ID}`` when it was
ended normally, ``{"exit": true}`` when the job has ended cleanly. If stdin ends without
``exit`` (the kernel died, however), every command still held is run, and the watchdog
exits. Nothing here reads anything but that pipe.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from typing import IO, Any


def watch(lines: IO[str]) -> dict[str, list[list[str]]]:
    """What is still to be ended when ``lines`` ends without ``exit``."""
    held: dict[str, list[list[str]]] = {}
    for line in lines:
        try:
            order: dict[str, Any] = json.loads(line)
        except ValueError:
            continue
        if order.get("exit"):
            return {}
        if "add" in order:
            held[str(order["add"])] = [[str(word) for word in argv] for argv in order["run"]]
        elif "drop" in order:
            held.pop(str(order["drop"]), None)
    return held


def main() -> int:
    held = watch(sys.stdin)
    for commands in held.values():
        for argv in commands:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, timeout=60)
    return 0


class Watchdog:
    """The kernel's side: starts the watchdog, tells it what to end, lets it go."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "elastic_magic.launchers.watchdog"],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, text=True,
            env={**{k: v for k, v in os.environ.items() if k != "ELASTIC_MAGIC_TOKEN"},
                 "PYTHONPATH": os.pathsep.join(filter(None, [_package_parent(),
                                                             os.environ.get("PYTHONPATH")]))})

    def _send(self, order: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        with contextlib.suppress(OSError, ValueError):
            self.proc.stdin.write(json.dumps(order) + "\n")
            self.proc.stdin.flush()

    def add(self, allocation_id: str, commands: list[list[str]]) -> None:
        if commands:
            self._send({"add": allocation_id, "run": commands})

    def drop(self, allocation_id: str) -> None:
        self._send({"drop": allocation_id})

    def close(self) -> None:
        """The job ended cleanly: the watchdog exits without running anything."""
        self._send({"exit": True})
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _package_parent() -> str:
    """The folder this elastic_magic was imported from, so the watchdog runs the same."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


if __name__ == "__main__":
    sys.exit(main())
