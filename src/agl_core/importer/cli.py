"""``agl import PATH... [--store URL|FILE] [--format auto|otlp-json|otlp-proto]``.

Exit status: 0 when everything was imported; 1 when some lines or records were skipped (each named on
stderr with its file and line, or record and byte offset) or the store refused some spans, the rest being
imported; 2 when the import could not start or was stopped (bad arguments, a missing file, the store
unreachable or failing; what was written before stays, and importing again is safe); 130 when
interrupted (Ctrl-C), the same.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TextIO

from .. import settings
from ._files import FORMATS

__all__ = ["add_import_arguments", "run_import"]

DEFAULT_STORE = "agl-store.sqlite"


def add_import_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "paths", nargs="+", metavar="PATH", help="OTLP trace files (JSON lines or protobuf, gzip)"
    )
    parser.add_argument(
        "--store",
        default=DEFAULT_STORE,
        help="a SQLite file (created if missing), postgresql://user@host:port/db, or a running store's URL"
        " (default: %(default)s)",
    )
    parser.add_argument(
        "--format",
        dest="fmt",
        choices=FORMATS,
        default="auto",
        help="what the files hold; auto tells JSON lines, length-prefixed and bare protobuf apart (default:"
        " %(default)s)",
    )
    parser.add_argument(
        "--token", default=None, help="a running store's bearer token (default: $AGL_STORE_TOKEN)"
    )
    parser.add_argument(
        "--redact",
        action="append",
        default=[],
        metavar="RULE",
        help="redact before writing to a store file (repeatable; as agl store serve --redact): key:GLOB,"
        " regex:PATTERN, email, api-key",
    )
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress bar on a terminal")


class _ProgressLine:
    """One line on stderr, rewritten at most ten times a second, on a terminal only."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.last = 0.0
        self.shown = False

    def __call__(self, phase: str, file: str, done: int, total: int, spans: int) -> None:
        now = time.monotonic()
        if now - self.last < 0.1:
            return
        self.last = now
        width = 30
        filled = int(width * done / total) if total else width
        what = {"scan": "reading", "finish": f"finishing, {spans:,} spans"}.get(
            phase, f"importing, {spans:,} spans"
        )
        line = (
            f"[{'#' * filled}{'.' * (width - filled)}] {done / 1e6:,.1f}/{total / 1e6:,.1f} MB {what}: {file}"
        )
        self.stream.write("\r" + line[:160].ljust(160))
        self.stream.flush()
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r" + " " * 160 + "\r")
            self.stream.flush()


def run_import(args: argparse.Namespace) -> int:
    from ..store import StoreError
    from ..store.redact import parse_rules
    from ._run import import_traces

    def fail(message: str) -> int:
        print(f"agl import: {settings.masked_url(message)}", file=sys.stderr)
        return 2

    missing = [p for p in args.paths if not Path(p).is_file()]
    if missing:
        return fail(f"no such file: {', '.join(missing)}")
    remote = args.store.startswith(("http://", "https://"))
    if remote and args.redact:
        return fail("--redact is for a store file; a running store applies its own --redact rules")
    try:
        redactor = parse_rules(args.redact)
    except ValueError as exc:
        return fail(str(exc))
    progress = None if args.quiet or not sys.stderr.isatty() else _ProgressLine(sys.stderr)
    started = time.perf_counter()
    try:
        summary = import_traces(
            args.paths,
            args.store,
            fmt=args.fmt,
            token=settings.store_token(args.token) if remote else None,
            redactor=redactor if redactor else None,
            progress=progress,
        )
    except (StoreError, OSError, ImportError) as exc:
        if progress is not None:
            progress.clear()
        return fail(f"stopped: {exc}. What was written before stays; importing again is safe.")
    except KeyboardInterrupt:
        if progress is not None:
            progress.clear()
        print(
            "agl import: interrupted. What was written before stays; run the same command again to import"
            " the rest (nothing is stored twice).",
            file=sys.stderr,
        )
        return 130
    if progress is not None:
        progress.clear()
    for problem in summary.problems:
        print(f"agl import: skipped {problem}", file=sys.stderr)
    elapsed = time.perf_counter() - started
    already = summary.spans - summary.new_spans
    print(
        f"imported {summary.spans:,} spans ({summary.new_spans:,} new, {max(already, 0):,} already stored) in"
        f" {summary.rollouts:,} rollout(s) from {summary.files} file(s)"
        f" into {settings.masked_url(args.store)} in {elapsed:.1f} s;"
        f" skipped: {len(summary.problems)} line(s)/record(s)"
        + (f", {summary.refused_spans} span(s) refused" if summary.refused_spans else "")
        + (
            f"; {summary.merged_spans:,} span(s) of earlier imports moved into their trace's rollout"
            if summary.merged_spans
            else ""
        )
    )
    return summary.exit_code
