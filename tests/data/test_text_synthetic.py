"""`glmtune data synth --kind domain_text` (glmtune/data/synthetic_text.py): reproducible by seed,
sources held out whole, and the bundled corpus is what the command writes for seed 0."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from glmtune.data.synthetic_text import generate_domain_text

BUNDLED = Path(__file__).resolve().parents[2] / "recipes" / "tiny" / "domain_text"


def test_reproducible_by_seed_and_held_out_by_source() -> None:
    corpus, heldout = generate_domain_text(seed=0)
    assert (corpus, heldout) == generate_domain_text(seed=0)
    assert generate_domain_text(seed=1)[0] != corpus
    train_sources, held_sources = {r["source"] for r in corpus}, {r["source"] for r in heldout}
    assert held_sources and not train_sources & held_sources
    assert len(held_sources) < len(train_sources) / 4
    assert {s.split("-")[0] for s in held_sources} == {"contract", "manual"}


def test_command_writes_the_bundled_corpus(tmp_path: Path) -> None:
    out = tmp_path / "domain_text"
    done = subprocess.run([sys.executable, "-m", "glmtune", "data", "synth", str(out), "--kind", "domain_text",
                           "--seed", "0"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "wrote 548 documents to" in done.stdout and "92 documents of held-out sources" in done.stdout
    for name in ("corpus.jsonl", "heldout.jsonl"):
        assert (out / name).read_bytes() == (BUNDLED / name).read_bytes()
    assert all(set(json.loads(line)) == {"text", "source"} for line in (out / "corpus.jsonl").read_text().splitlines())
    again = subprocess.run([sys.executable, "-m", "glmtune", "data", "synth", str(out), "--kind", "domain_text"],
                           capture_output=True, text=True)
    assert again.returncode != 0 and "--overwrite" in again.stderr  # an existing output is never replaced unasked
