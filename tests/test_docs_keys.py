"""Every trainer config key the README and docs/*.md use exists in the config schema: in YAML examples,
in ``--set KEY=VALUE`` overrides, and in inline code naming a dotted key (``algorithm.agents``); and the
README within its size."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from agl_trainer.config import config_keys

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
KEYS = set(config_keys())
TOP = {k for k in KEYS if "." not in k}
#: keys whose value is free-form (a mapping passed on as it is): anything below them is not checked
OPEN = {k for k in KEYS if not any(other.startswith(k + ".") for other in KEYS)}


def _known(path: str) -> bool:
    parts = path.split(".")
    return path in KEYS or any(".".join(parts[:i]) in OPEN for i in range(1, len(parts)))


def _flatten(data: object, prefix: str = "") -> list[str]:
    if not isinstance(data, dict):
        return []
    out = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        out.append(path)
        if path not in OPEN:
            out += _flatten(value, path + ".")
    return out


def _used_keys(text: str) -> list[tuple[str, str]]:
    """(key, where) for every config key ``text`` uses."""
    found = []
    for block in re.findall(r"```ya?ml\n(.*?)```", text, flags=re.S):
        try:
            data = yaml.safe_load(block)
        except yaml.YAMLError:
            continue
        if isinstance(data, dict) and set(data) & TOP:
            found += [(key, "yaml example") for key in _flatten(data)]
    for key in re.findall(r"--set[ =]([A-Za-z_][\w.]*)=", text):
        if key not in ("KEY", "key"):  # the placeholder in a synopsis
            found.append((key, "--set"))
    for key in re.findall(r"`([a-z_]+(?:\.[a-z_]+)+)(?::[^`]*)?`", text):
        if key.split(".")[0] in TOP and not key.endswith((".py", ".md", ".yaml", ".jsonl")):
            found.append((key, "inline code"))
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_config_key_the_docs_use_exists(doc):
    unknown = sorted({f"{key} ({where})" for key, where in _used_keys(doc.read_text()) if not _known(key)})
    assert not unknown, f"{doc.name} uses config keys the schema does not have: {unknown}"


def test_the_check_finds_keys():
    used = {key for doc in DOCS for key, _ in _used_keys(doc.read_text())}
    assert {"algorithm.agents", "train.steps"} <= used
    assert not _known("select_agents") and not _known("algorithm.select_agents")


_LINK = re.compile(r"\[`?([\w./-]+\.(?:md|py|yaml|yml|sh|toml|json|jsonl))`?\]\(([^)\s]+)\)")


def _markdown_files() -> list[Path]:
    skip = {".venv", "runs", ".git", "node_modules"}
    return [p for p in ROOT.rglob("*.md") if not skip & set(p.relative_to(ROOT).parts)]


def test_a_link_named_after_a_file_points_at_that_file():
    """A link whose text names a page names the page it opens (``[store.md](import.md)`` sent readers of
    the quickstart to another page than the one it named), and the file it opens exists."""
    wrong = []
    for path in _markdown_files():
        for text, target in _LINK.findall(path.read_text(encoding="utf-8")):
            file = target.split("#")[0]
            if not file or "://" in file:
                continue
            if Path(file.rstrip("/")).name != Path(text).name:
                wrong.append(f"{path.relative_to(ROOT)}: [{text}]({target})")
            elif not (path.parent / file).exists():
                wrong.append(f"{path.relative_to(ROOT)}: [{text}]({target}) opens nothing")
    assert not wrong, "\n".join(wrong)


def test_the_docs_say_which_config_paths_are_relative_to_what():
    text = (ROOT / "docs" / "training.md").read_text()
    assert (
        "relative to **the config file's folder**" in text and "relative to **the working directory**" in text
    )


def test_the_front_page_stays_within_8_kb():
    """The README is the front page: what agl is, install, the two commands, one result, how to make an
    agent trainable, a map. Run history and benchmark prose belong in CHANGELOG.md and bench/."""
    size = len((ROOT / "README.md").read_bytes())
    assert size <= 8 * 1024, f"README.md is {size} bytes; move detail to docs/ or bench/README.md"
