"""One error boundary for every command line of the project.

`python -m vlbert_core.<command>` and every workflow script end in `run_command` / `run_script`: an exception
becomes one line on stderr (what failed, and the file, row or key its message names), exit status 1; bad
arguments are argparse's, exit status 2. `--debug` on the command line, or VLBERT_DEBUG=1 in the environment,
shows the traceback as well (docs/reliability.md). A workflow script also writes the traceback into its job's log file, where the
run's record is kept.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from typing import Any, Callable, Sequence

DEBUG_FLAG = "--debug"
DEBUG_ENV = "VLBERT_DEBUG"


def debug_requested(argv: Sequence[str]) -> bool:
    return DEBUG_FLAG in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def one_line(exc: BaseException) -> str:
    """The exception as one line: its type (unless the message says enough) and its message, lines joined."""
    message = " ".join(str(exc).split())
    if isinstance(exc, MemoryError):
        return "out of memory" + (f": {message}" if message else "")
    if isinstance(exc, KeyError) and message:
        return f"missing key {message}"
    if not message:
        return type(exc).__name__
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError)) and exc.filename and \
            str(exc.filename) not in message:
        message = f"{exc.filename}: {message}"
    return message


def report(prog: str, exc: BaseException, *, debug: bool) -> None:
    if debug:
        traceback.print_exception(exc, file=sys.stderr)
    print(f"{prog}: error: {one_line(exc)}", file=sys.stderr)


def run_command(main: Callable[[list[str]], Any], prog: str, argv: Sequence[str] | None = None) -> int:
    """Run a command's `main(argv)`; returns the exit status (`sys.exit(run_command(...))`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_requested(argv)
    try:
        status = main([a for a in argv if a != DEBUG_FLAG])
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # the boundary: every failure becomes one line
        report(prog, exc, debug=debug)
        return 1
    return status if isinstance(status, int) else 0   # a main may return its result instead of a status


def run_script(main: Callable[[Any], Any], smk: Any) -> None:
    """Run a workflow script's `main(snakemake)`; on failure the job's log file gets the traceback and stderr
    one line, and the process exits 1 (Snakemake then reports the failed job and its log)."""
    prog = f"rule {getattr(smk, 'rule', '?')}"
    try:
        main(smk)
    except Exception as exc:  # the boundary of a workflow job
        log_traceback(prog, exc, list(getattr(smk, "log", []) or []))
        report(prog, exc, debug=debug_requested([]))
        sys.exit(1)


def log_traceback(prog: str, exc: BaseException, log_files: list[str]) -> None:
    """The traceback into the job's log file only (the `vlbert` logger's file handlers, or else the rule's
    first log file), not onto stderr."""
    logger = logging.getLogger("vlbert")
    files = [h for h in logger.handlers if isinstance(h, logging.FileHandler)]
    if files:
        record = logger.makeRecord(logger.name, logging.ERROR, __file__, 0, "%s failed", (prog,),
                                   (type(exc), exc, exc.__traceback__))
        for handler in files:
            handler.handle(record)
    elif log_files:
        with open(log_files[0], "a") as f:
            f.write(f"{prog} failed\n" + "".join(traceback.format_exception(exc)))
