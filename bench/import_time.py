"""How long ``import agl_core`` takes in a fresh interpreter, against the target of 0.3 s.

    python bench/import_time.py [--runs 15]

Each run starts a new Python process that imports the module and prints the wall time of the import
alone (``time.perf_counter`` around it), so interpreter start-up is left out. Prints the median and the
spread over runs for ``agl_core`` and, for scale, for the adapters and ``opentelemetry.sdk.trace``, plus
the slowest imports of one ``agl_core`` run as ``python -X importtime`` reports them.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

TARGET_S = 0.3
MODULES = ("agl_core", "opentelemetry.sdk.trace", "agl_langchain", "agl_openai_agents", "agl_autogen")


def _import_seconds(module: str) -> float:
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(done.stdout.strip())


def _slowest(module: str, n: int) -> list[tuple[int, str]]:
    """The ``n`` imports with the largest cumulative time (microseconds) under ``-X importtime``."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", f"import {module}"],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = []
    for line in done.stderr.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            rows.append((int(parts[1]), parts[2].rstrip()))
    return sorted(rows, reverse=True)[:n]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15, help="fresh interpreters per module (default 15)")
    args = parser.parse_args()
    print(f"{'module':<26} {'median s':>9} {'min s':>7} {'max s':>7}")
    headline = 0.0
    for module in MODULES:
        times = [_import_seconds(module) for _ in range(args.runs)]
        median = statistics.median(times)
        if module == "agl_core":
            headline = median
        print(f"{module:<26} {median:>9.3f} {min(times):>7.3f} {max(times):>7.3f}")
    print("\nslowest imports under `import agl_core` (cumulative us):")
    for us, name in _slowest("agl_core", 8):
        print(f"{us:>10} {name}")
    ok = headline < TARGET_S
    print(f"\nimport agl_core: {headline:.3f} s median, target < {TARGET_S} s: {'ok' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
