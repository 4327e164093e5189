"""Progress of long jobs: a live bar on a terminal, plain lines elsewhere.

On a terminal (stderr is a TTY) `Progress` is tqdm's bar. Redirected (Snakemake's console sent to a file, CI,
`nohup`, an sbatch output file) every redraw would be kept: there it writes one plain line through the
`vlbert` logger at most every PLAIN_INTERVAL_S seconds, and at the end, so the console and the job's log file
get a readable record instead of thousands of carriage returns.
"""

from __future__ import annotations

import logging
import sys

from tqdm import tqdm

PLAIN_INTERVAL_S = 30.0
PLAIN_FORMAT = "{desc}: {n_fmt}/{total_fmt} ({percentage:.0f}%) {elapsed} elapsed, {remaining} left, {rate_fmt}{postfix}"
PLAIN_FORMAT_NO_TOTAL = "{desc}: {n_fmt} {elapsed} elapsed, {rate_fmt}{postfix}"


class _LogLines:
    """A file-like target for tqdm that logs each refresh as one line."""

    def __init__(self) -> None:
        self.logger = logging.getLogger("vlbert").getChild("progress")

    def write(self, text: str) -> None:
        line = text.replace("\r", "").strip()
        if line:
            self.logger.info(line)

    def flush(self) -> None:
        pass


class Progress(tqdm):
    """tqdm, with plain log lines instead of a bar when stderr is not a terminal (see the module)."""

    def __init__(self, *args, **kwargs):
        plain = not kwargs.get("disable") and not _stderr_is_terminal()
        if plain:
            kwargs.update(file=_LogLines(), mininterval=max(float(kwargs.get("mininterval", 0.1)), PLAIN_INTERVAL_S),
                          maxinterval=max(float(kwargs.get("maxinterval", 10.0)), PLAIN_INTERVAL_S),
                          bar_format=PLAIN_FORMAT if _known_total(args, kwargs) else PLAIN_FORMAT_NO_TOTAL,
                          dynamic_ncols=False, leave=True)
        self.plain = plain
        super().__init__(*args, **kwargs)

    # tqdm redraws on every postfix or description change by default; plain lines come at their interval only
    def set_postfix(self, ordered_dict=None, refresh=True, **kwargs):
        super().set_postfix(ordered_dict, refresh=refresh and not self.plain, **kwargs)

    def set_postfix_str(self, s="", refresh=True):
        super().set_postfix_str(s, refresh=refresh and not self.plain)

    def set_description(self, desc=None, refresh=True):
        super().set_description(desc, refresh=refresh and not self.plain)


def _known_total(args: tuple, kwargs: dict) -> bool:
    if kwargs.get("total") is not None:
        return True
    iterable = args[0] if args else kwargs.get("iterable")
    try:
        return iterable is not None and len(iterable) >= 0
    except TypeError:
        return False


def _stderr_is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):   # a closed or replaced stderr
        return False
