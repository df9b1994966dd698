"""A small BM25 (Okapi) index over the example's corpus, in pure Python.

``BM25Index.build(docs)`` indexes ``{"id", "title", "text"}`` entries (title and text together);
``index.search(query, k)`` returns the ``k`` best ``(score, doc)`` pairs, best first, ties broken by
corpus order. :func:`load_index` builds the index on first use and caches it as JSON under
``$AGL_CACHE_DIR/rag_openai_agents/`` (default ``~/.cache/agl``), keyed by the corpus file's SHA-256, so
an edited corpus is re-indexed and never served from a stale cache.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections import Counter
from pathlib import Path

from agl_core import settings

_WORD = re.compile(r"[a-z0-9]+")
STOPWORDS = frozenset(
    "a an and are as at be by did does do for from has have in is it its of on or that the this to was what "
    "when where which who whom whose why with".split()
)


def tokenize(text: str) -> list[str]:
    """Lower-cased alphanumeric words of ``text`` without stopwords."""
    return [w for w in _WORD.findall(text.lower()) if w not in STOPWORDS]


class BM25Index:
    """Okapi BM25 with parameters ``k1`` (term-frequency saturation) and ``b`` (length normalisation)."""

    def __init__(
        self, docs: list[dict], term_freqs: list[dict[str, int]], *, k1: float = 1.5, b: float = 0.75
    ) -> None:
        if len(docs) != len(term_freqs):
            raise ValueError(f"{len(docs)} documents but {len(term_freqs)} term-frequency tables")
        self.docs = docs
        self.term_freqs = term_freqs
        self.k1, self.b = k1, b
        self.lengths = [sum(tf.values()) for tf in term_freqs]
        self.avg_length = sum(self.lengths) / len(self.lengths) if self.lengths else 0.0
        df: Counter[str] = Counter()
        for tf in term_freqs:
            df.update(tf.keys())
        n = len(docs)
        # the "+1" form keeps every idf positive, also for words in more than half the documents
        self.idf = {t: math.log(1 + (n - f + 0.5) / (f + 0.5)) for t, f in df.items()}

    @classmethod
    def build(cls, docs: list[dict], **params: float) -> BM25Index:
        return cls(docs, [dict(Counter(tokenize(f"{d['title']} {d['text']}"))) for d in docs], **params)

    def scores(self, query: str) -> list[float]:
        """The BM25 score of every document for ``query`` (0 for a query with no known word)."""
        terms = [t for t in tokenize(query) if t in self.idf]
        out = []
        for tf, length in zip(self.term_freqs, self.lengths, strict=True):
            norm = self.k1 * (1 - self.b + self.b * length / self.avg_length)
            out.append(sum(self.idf[t] * tf[t] * (self.k1 + 1) / (tf[t] + norm) for t in terms if t in tf))
        return out

    def search(self, query: str, k: int = 3) -> list[tuple[float, dict]]:
        """The ``k`` highest-scoring documents with a positive score, best first."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        scored = [(s, i) for i, s in enumerate(self.scores(query)) if s > 0]
        scored.sort(key=lambda pair: (-pair[0], pair[1]))
        return [(s, self.docs[i]) for s, i in scored[:k]]

    def to_json(self) -> dict:
        return {"k1": self.k1, "b": self.b, "docs": self.docs, "term_freqs": self.term_freqs}

    @classmethod
    def from_json(cls, data: dict) -> BM25Index:
        return cls(data["docs"], data["term_freqs"], k1=data["k1"], b=data["b"])


def read_corpus(path: Path) -> list[dict]:
    docs = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        doc = json.loads(line)
        if not isinstance(doc, dict) or not {"id", "title", "text"} <= doc.keys():
            raise ValueError(f"{path}:{n}: a corpus entry needs 'id', 'title' and 'text'")
        docs.append(doc)
    return docs


def load_index(corpus: Path, cache_dir: Path | None = None) -> BM25Index:
    """The index of ``corpus`` (a JSONL file), from the cache when it holds one for this exact file."""
    raw = corpus.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()[:16]
    cache = (cache_dir or settings.cache_dir() / "rag_openai_agents") / f"bm25-{digest}.json"
    if cache.is_file():
        try:
            return BM25Index.from_json(json.loads(cache.read_text()))
        except (ValueError, KeyError, TypeError):
            pass  # a cache file cut short or from another version: rebuild it
    index = BM25Index.build(read_corpus(corpus))
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(index.to_json()))
    tmp.replace(cache)  # atomic: concurrent workers never read a half-written file
    return index
