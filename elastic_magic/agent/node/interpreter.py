"""The command line of the interpreters we start: the warm pool's zygote, ``--no-pool``
workers, the launchers' watchdog and joins.

``python -m`` puts the current directory first on ``sys.path``: a ``cloudpickle.py`` or
``torch.py`` in the folder a job was started from (a shared folder, say) would run as the
user in every worker, before any cell. Neither ``python script.py`` nor a console script
does that, and neither may we. So our interpreters start with ``-c`` and a small runner that,
before anything is imported (the same on every Python version, where ``-P`` exists only
from 3.11), removes from the path the current directory ``-c`` puts first, the current
directory itself, and what PYTHONPATH's empty or relative entries made of it
(``PYTHONPATH=:/x`` or ``PYTHONPATH=lib`` would put the start folder back). Absolute entries
the user chose stay, inside the start folder too (a project's ``src`` or ``.venv``, a user
site in the home folder): the kernel imports from them as well. Then it imports
elastic_magic from the folder the kernel imported it from (so workers always run the
kernel's copy, whatever their path finds first), then exits with what the module's
``main()`` returns. The module's name stays a word of the command line, as with ``-m``.
The cell gets the kernel's cwd and ``sys.path`` only when it runs, after the worker's own
imports (``worker/runner.py``). The launchers start the watchdog and joins the same way (a
remote one: ``remote_command``, whose path is cleaned the same way: a Slurm job runs in the
notebook's folder with the kernel's PYTHONPATH).
"""

from __future__ import annotations

import os
import sys

import elastic_magic

# The folder of the kernel's elastic_magic, as the kernel found it.
PACKAGE_DIR = os.path.dirname(os.path.abspath(elastic_magic.__file__))

# Removes from the path what names the start folder: ``-c``'s "" and the folder itself, and
# what PYTHONPATH's empty and relative entries made of it (Python made them absolute).
# Simple statements only, for both runners: the remote one is this on one line.
_CLEAN_PATH = (
    "import os, sys",
    "here = os.path.realpath(os.getcwd())",
    "drop = {here} | {os.path.realpath(os.path.join(here, entry)) for entry in "
    "os.environ.get(\"PYTHONPATH\", \"\").split(os.pathsep) if not os.path.isabs(entry)}",
    "sys.path[:] = [entry for entry in sys.path if entry and os.path.isabs(entry) "
    "and os.path.realpath(entry) not in drop]",
)

# argv: PACKAGE_DIR MODULE ARGS...; the module's main() sees sys.argv[1:] == ARGS.
RUNNER = "\n".join((*_CLEAN_PATH, """\
import importlib.util
package, module = sys.argv[1:3]
del sys.argv[1:3]
spec = importlib.util.spec_from_file_location(
    "elastic_magic", package + "/__init__.py", submodule_search_locations=[package])
sys.modules["elastic_magic"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sys.modules["elastic_magic"])
sys.exit(importlib.import_module(module).main())
"""))

# The same for an interpreter elsewhere (a node of a cluster, in the job's working folder
# with the kernel's PYTHONPATH, as sbatch passes it on), whose elastic_magic is the one its
# own path finds. One line, with no ' or ! in it: it goes through the remote login's shell,
# whatever it is. argv: MODULE ARGS...
REMOTE_RUNNER = "; ".join((*_CLEAN_PATH, "import importlib", "module = sys.argv.pop(1)",
                           "sys.exit(importlib.import_module(module).main())"))


def without_relative_pythonpath(env: dict[str, str]) -> dict[str, str]:
    """``env`` with PYTHONPATH's empty and relative entries left out (all of it, if none is
    left). Python puts them on the path while it starts, before any runner cleans it, and
    imports ``sitecustomize`` (and, before 3.11, ``site``) from there: a file planted in the
    start folder would run. The cell still gets the kernel's path when it runs."""
    entries = [e for e in env.get("PYTHONPATH", "").split(os.pathsep) if os.path.isabs(e)]
    cleaned = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    if entries:
        cleaned["PYTHONPATH"] = os.pathsep.join(entries)
    return cleaned


def command(module: str, *args: str) -> list[str]:
    """``python -m module args...``, without the current directory on the path and with
    this process's elastic_magic. ``module`` has a ``main()``."""
    return [sys.executable, "-c", RUNNER, PACKAGE_DIR, module, *args]


def remote_command(python: str, module: str, *args: str) -> list[str]:
    """``PYTHON -m module args...`` for another machine's interpreter, without the current
    directory (there: the job's working directory, a shared folder) on the path."""
    return [python, "-c", REMOTE_RUNNER, module, *args]
