"""`elastic-magic --help` reads as plain text (no reStructuredText quoting)."""

import subprocess
import sys


def test_help_has_no_literal_backticks():
    run = subprocess.run([sys.executable, "-m", "elastic_magic.cli", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "``" not in run.stdout
    assert "elastic-magic join HOST:PORT --token-file PATH" in run.stdout
    assert "(%%elastic --nnodes 1:4 --rdzv-endpoint HOST:PORT)" in run.stdout
