"""``predict``'s argument parser and its error status, shared by ``predictors/cli.py`` and
``predictors/memory/cli.py`` (which ``predictors/cli.py`` mounts, so neither can import the
other's)."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

# Every error of `predict` exits 1 (a usage error, a refused flag, an unknown precision, ...):
# `predict memory`'s verdict takes 0, 3 and 2 (oom), and a script that skips a job on 2 read
# argparse's own usage status 2, and main's 2 for a named error, as "oom"
EXIT_ERROR = 1


class PredictArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose usage errors exit :data:`EXIT_ERROR`, not argparse's 2, with
    argparse's usage line and ``<prog>: error: <message>``. ``add_subparsers`` makes each
    subcommand's parser of its parent's class, so theirs do too."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message}\n")
