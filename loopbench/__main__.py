"""``python -m loopbench``: the ``loopbench`` command (harness/cli.py) without the console script."""
import sys

from loopbench.harness.cli import main

sys.exit(main())
