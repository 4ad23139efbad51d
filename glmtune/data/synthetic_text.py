"""A synthetic domain corpus for continued pretraining (`glmtune data synth --kind domain_text`).

Two document families in a small, regular vocabulary the tiny tokenizer handles: supply
contracts (parties, a product, payment terms, a notice period, a governing law) and equipment
manuals (a device, its steps, its status lights, its service interval). Each source is one
contract or one manual, several documents long (its clauses or sections), and draws its own
values, so the domain's pattern (the clause order, the phrasing, which value goes where) is what
a model can learn; the values themselves vary per source.

`write_domain_text(out, seed)` writes a directory:
  * `corpus.jsonl`: `{"text", "source"}` rows of the training sources (split by source into
    train/validation by `glmtune train` with `data.source_field: source`);
  * `heldout.jsonl`: the documents of held-out sources (about one in eight, by a hash of the
    source name and the seed), for a domain-perplexity evaluation: no document of these sources is
    in `corpus.jsonl`.
Everything follows from the seed: the same seed writes the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

from glmtune.io.outputs import output_dir

CORPUS_FILE, HELDOUT_FILE = "corpus.jsonl", "heldout.jsonl"
_COMPANIES = ("Northwind Supply", "Acme Tools", "Bluebird Parts", "Granite Works", "Harbor Foods", "Summit Labs",
              "Riverside Metals", "Oakridge Paper", "Lakeside Power", "Maple Freight")
_PRODUCTS = ("steel brackets", "copper wire", "office paper", "safety gloves", "spare filters", "pallet wrap",
             "circuit boards", "cleaning supplies")
_LAWS = ("England and Wales", "the State of New York", "Ontario", "Ireland", "New South Wales")
_DEVICES = ("router", "water pump", "label printer", "air compressor", "battery charger", "door controller")
_LIGHTS = ("green", "amber", "red", "blue")
_ACTIONS = ("Disconnect the power cable", "Open the front cover", "Remove the filter", "Press the reset button",
            "Check the status light", "Replace the fuse", "Close the front cover", "Connect the power cable")


def _contract(rng: random.Random, number: int) -> list[str]:
    supplier, customer = rng.sample(_COMPANIES, 2)
    product, law = rng.choice(_PRODUCTS), rng.choice(_LAWS)
    days, notice, rate = rng.choice((15, 30, 45, 60)), rng.choice((30, 60, 90)), rng.choice((1, 2, 3))
    units = rng.randrange(100, 5000, 50)
    head = f"Supply Contract {number}. This contract is made between {supplier} (the Supplier) and {customer} " \
           f"(the Customer)."
    return [
        f"{head} Section 1. Goods. The Supplier shall deliver {units} units of {product} to the Customer each month.",
        f"Supply Contract {number}. Section 2. Payment. The Customer shall pay each invoice within {days} days of "
        f"delivery. Late payment accrues interest at {rate} percent per month.",
        f"Supply Contract {number}. Section 3. Quality. The Supplier warrants that the {product} meet the agreed "
        f"specification. The Customer shall report any defect within {rng.choice((7, 14, 21))} days of delivery.",
        f"Supply Contract {number}. Section 4. Term. Either party may end this contract with {notice} days of "
        f"written notice. This contract is governed by the laws of {law}.",
    ]


def _manual(rng: random.Random, number: int) -> list[str]:
    device, (light, fault) = rng.choice(_DEVICES), rng.sample(_LIGHTS, 2)
    months, seconds = rng.choice((3, 6, 12)), rng.choice((5, 10, 15, 30))
    steps = rng.sample(_ACTIONS, 4)
    numbered = " ".join(f"Step {i}: {action}." for i, action in enumerate(steps, start=1))
    return [
        f"Service Manual {number} for the {device}. Section 1. Safety. Disconnect the power cable before you open "
        f"the {device}. Keep the {device} dry.",
        f"Service Manual {number}. Section 2. Status lights. The {light} light means the {device} is ready. The {fault} "
        f"light means the {device} needs service.",
        f"Service Manual {number}. Section 3. Reset. {numbered} Hold the reset button for {seconds} seconds.",
        f"Service Manual {number}. Section 4. Maintenance. Service the {device} every {months} months. Replace the "
        f"filter at every service.",
    ]


def _held_out(source: str, seed: int) -> bool:
    return hashlib.sha256(f"{seed}\0{source}".encode()).digest()[0] < 32  # one source in eight


def generate_domain_text(num_sources: int = 160, seed: int = 0) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training rows, held-out rows): `{"text", "source"}` rows, the held-out ones of other sources."""
    rng = random.Random(seed)
    corpus, heldout = [], []
    for index in range(num_sources):
        kind = "contract" if index % 2 == 0 else "manual"
        source = f"{kind}-{index:04d}"
        documents = (_contract if kind == "contract" else _manual)(rng, index + 1)
        target = heldout if _held_out(source, seed) else corpus
        target += [{"text": text, "source": source} for text in documents]
    return corpus, heldout


def write_domain_text(out: str | Path, seed: int = 0, *, num_sources: int = 160, overwrite: bool = False
                      ) -> tuple[Path, int, int]:
    """The corpus directory (module docstring), written in one step; (directory, corpus rows, held-out rows)."""
    corpus, heldout = generate_domain_text(num_sources, seed)
    with output_dir(out, overwrite=overwrite, what="OUT") as tmp:
        for name, rows in ((CORPUS_FILE, corpus), (HELDOUT_FILE, heldout)):
            (tmp / name).write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows),
                                    encoding="utf-8")
    return Path(out), len(corpus), len(heldout)
