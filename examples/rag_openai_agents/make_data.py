"""Writes the example's fictional corpus and question splits, deterministically (seeded, no downloads).

The world: 8 provinces, 40 cities, 32 companies and 120 people, one short encyclopedia entry each
(``corpus.jsonl``, 200 entries). Facts link the entities: a person was born in a city and works for a
company; a city lies in a province; a company is headquartered in a city and makes something.

Questions come in two kinds, each split into ``train`` / ``val`` / ``dev`` files disjoint by question:

- one hop (``train.jsonl``, ``val.jsonl``, ``dev.jsonl``): the answer is in the entry of the entity the
  question names ("In which city was Mara Voss born?" -> "Quillfield");
- two hops (``train_2hop.jsonl``, ...): the answer is in the entry of an entity that the named entity's
  entry points to ("In which province was Mara Voss born?" -> her city's province).

Each task is ``{"id", "question", "answer", "hops", "entities"}``: ``entities`` lists the titles of the
entries that hold the path to the answer, in order.

Run ``python make_data.py`` to regenerate (the files are checked in; the output is byte-identical).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 20240607
N_PROVINCES, N_CITIES, N_COMPANIES, N_PEOPLE = 8, 40, 32, 120
#: Questions per split; the rest go to train.
DEV_SIZE, VAL_SIZE = 60, 100

_ONSETS = [
    "b",
    "br",
    "c",
    "d",
    "dr",
    "f",
    "g",
    "gr",
    "h",
    "k",
    "l",
    "m",
    "n",
    "p",
    "qu",
    "r",
    "s",
    "st",
    "t",
    "th",
    "v",
    "w",
    "z",
]
_VOWELS = ["a", "e", "i", "o", "u", "ae", "ia", "ou"]
_CODAS = ["", "l", "n", "r", "s", "th", "v", "x", "nd", "rk"]
_CITY_ENDINGS = ["field", "haven", "mere", "ford", "wick", "stead", "holm", "gate", "port", "brook"]
_COMPANY_KINDS = [
    ("Brassworks", ["copper kettles", "brass bells", "ship lanterns", "door hinges"]),
    ("Looms", ["wool blankets", "linen sails", "silk scarves", "felt hats"]),
    ("Foundry", ["iron stoves", "cast anchors", "railway bolts", "church bells"]),
    ("Optics", ["brass telescopes", "reading glasses", "lighthouse lenses", "pocket compasses"]),
    ("Mills", ["rye flour", "paper reams", "oat biscuits", "barley malt"]),
    ("Clockworks", ["tower clocks", "pocket watches", "music boxes", "metronomes"]),
    ("Potteries", ["blue teapots", "clay pipes", "roof tiles", "stoneware jugs"]),
    ("Shipyards", ["fishing boats", "river barges", "ice breakers", "canal ferries"]),
]
_PROFESSIONS = [
    "cartographer",
    "glassblower",
    "beekeeper",
    "violinist",
    "astronomer",
    "bookbinder",
    "botanist",
    "blacksmith",
    "surveyor",
    "weaver",
    "ferryman",
    "chemist",
    "stonemason",
    "lighthouse keeper",
    "cooper",
    "archivist",
]
_RIVERS = ["Sel", "Morrow", "Tane", "Ilve", "Corrin", "Vash", "Odra", "Lume"]
_KNOWN_FOR = [
    "its salt markets",
    "a stone bridge",
    "an old observatory",
    "its spring fair",
    "a ruined abbey",
    "its harbour",
    "a clock tower",
    "its orchards",
    "a glass market",
    "its canals",
]


def _word(rng: random.Random, syllables: int) -> str:
    parts = []
    for i in range(syllables):
        parts.append(
            rng.choice(_ONSETS) + rng.choice(_VOWELS) + (rng.choice(_CODAS) if i == syllables - 1 else "")
        )
    return "".join(parts).capitalize()


def _unique(rng: random.Random, n: int, make, taken: set[str]) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        name = make()
        key = name.lower()
        if key in taken or len(name) < 4 or len(name) > 11:
            continue
        taken.add(key)
        out.append(name)
    return out


def build_world(seed: int = SEED) -> dict:
    """The entities and their facts, as plain dicts (deterministic for a seed)."""
    rng = random.Random(seed)
    taken: set[str] = set()
    provinces = _unique(rng, N_PROVINCES, lambda: _word(rng, 2), taken)
    cities = _unique(rng, N_CITIES, lambda: _word(rng, 1).rstrip("aeiou") + rng.choice(_CITY_ENDINGS), taken)
    company_words = _unique(rng, N_COMPANIES, lambda: _word(rng, 2), taken)
    firsts = _unique(rng, N_PEOPLE, lambda: _word(rng, 2), taken)
    lasts = _unique(rng, N_PEOPLE, lambda: _word(rng, 1 + rng.randrange(2)), taken)

    world: dict = {"provinces": [], "cities": [], "companies": [], "people": []}
    city_province = {c: provinces[i % N_PROVINCES] for i, c in enumerate(cities)}
    for i, p in enumerate(provinces):
        capital = cities[i]  # city i lies in province i % N_PROVINCES, so its capital is its own city
        world["provinces"].append({"name": p, "capital": capital, "river": _RIVERS[i]})
    for c in cities:
        world["cities"].append(
            {
                "name": c,
                "province": city_province[c],
                "known_for": rng.choice(_KNOWN_FOR),
                "founded": rng.randrange(1100, 1800),
            }
        )
    for i, word in enumerate(company_words):
        kind, products = _COMPANY_KINDS[i % len(_COMPANY_KINDS)]
        world["companies"].append(
            {
                "name": f"{word} {kind}",
                "city": rng.choice(cities),
                "product": rng.choice(products),
                "founded": rng.randrange(1820, 1990),
            }
        )
    for first, last in zip(firsts, lasts, strict=True):  # N_PEOPLE of each
        world["people"].append(
            {
                "name": f"{first} {last}",
                "city": rng.choice(cities),
                "company": rng.choice(world["companies"])["name"],
                "profession": rng.choice(_PROFESSIONS),
            }
        )
    return world


def _article(noun: str) -> str:
    return "an" if noun[0] in "aeiou" else "a"


def corpus(world: dict) -> list[dict]:
    """One entry per entity: ``{"id", "title", "text"}``."""
    out = []
    for p in world["provinces"]:
        out.append(
            {
                "title": p["name"],
                "text": (
                    f"{p['name']} is a province. The capital of {p['name']} is {p['capital']}. "
                    f"The river {p['river']} runs through {p['name']}."
                ),
            }
        )
    for c in world["cities"]:
        out.append(
            {
                "title": c["name"],
                "text": (
                    f"{c['name']} is a city in the province of {c['province']}. "
                    f"It was founded in {c['founded']} and is known for {c['known_for']}."
                ),
            }
        )
    for c in world["companies"]:
        out.append(
            {
                "title": c["name"],
                "text": (
                    f"{c['name']} is a company headquartered in {c['city']}. "
                    f"{c['name']} makes {c['product']}. It was founded in {c['founded']}."
                ),
            }
        )
    for p in world["people"]:
        out.append(
            {
                "title": p["name"],
                "text": (
                    f"{p['name']} is {_article(p['profession'])} {p['profession']}. "
                    f"{p['name']} was born in {p['city']}. {p['name']} works for {p['company']}."
                ),
            }
        )
    return [{"id": f"doc-{i:03d}", **entry} for i, entry in enumerate(out)]


def questions(world: dict) -> tuple[list[dict], list[dict]]:
    """(one-hop, two-hop) questions with gold answers and the entries on the path to the answer."""
    city = {c["name"]: c for c in world["cities"]}
    company = {c["name"]: c for c in world["companies"]}
    one, two = [], []

    def q(bucket: list[dict], question: str, answer: str, entities: list[str]) -> None:
        bucket.append({"question": question, "answer": answer, "hops": len(entities), "entities": entities})

    for p in world["people"]:
        n = p["name"]
        q(one, f"In which city was {n} born?", p["city"], [n])
        q(one, f"Which company does {n} work for?", p["company"], [n])
        q(one, f"What is the profession of {n}?", p["profession"], [n])
        q(two, f"In which province was {n} born?", city[p["city"]]["province"], [n, p["city"]])
        q(
            two,
            f"In which city is the company that {n} works for headquartered?",
            company[p["company"]]["city"],
            [n, p["company"]],
        )
        q(
            two,
            f"What does the company that {n} works for make?",
            company[p["company"]]["product"],
            [n, p["company"]],
        )
    for c in world["cities"]:
        q(one, f"In which province is the city of {c['name']}?", c["province"], [c["name"]])
    for c in world["companies"]:
        q(one, f"In which city is {c['name']} headquartered?", c["city"], [c["name"]])
        q(one, f"What does {c['name']} make?", c["product"], [c["name"]])
        q(
            two,
            f"In which province is {c['name']} headquartered?",
            city[c["city"]]["province"],
            [c["name"], c["city"]],
        )
    for p in world["provinces"]:
        q(one, f"What is the capital of the province of {p['name']}?", p["capital"], [p["name"]])
    return one, two


def split(items: list[dict], prefix: str, seed: int) -> dict[str, list[dict]]:
    """Shuffle (seeded) and cut into dev / val / train; ids are ``{prefix}-{split}-NNN``."""
    rng = random.Random(seed)
    items = list(items)
    rng.shuffle(items)
    parts = {
        "dev": items[:DEV_SIZE],
        "val": items[DEV_SIZE : DEV_SIZE + VAL_SIZE],
        "train": items[DEV_SIZE + VAL_SIZE :],
    }
    return {
        name: [{"id": f"{prefix}-{name}-{i:03d}", **t} for i, t in enumerate(tasks)]
        for name, tasks in parts.items()
    }


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def main(out_dir: Path = HERE) -> None:
    world = build_world()
    write_jsonl(out_dir / "corpus.jsonl", corpus(world))
    one, two = questions(world)
    for name, tasks in split(one, "q1", SEED + 1).items():
        write_jsonl(out_dir / f"{name}.jsonl", tasks)
    for name, tasks in split(two, "q2", SEED + 2).items():
        write_jsonl(out_dir / f"{name}_2hop.jsonl", tasks)


if __name__ == "__main__":
    main()
