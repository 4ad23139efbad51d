"""Peak memory and speed of the raw-text pass (`data.kind: text`) on a corpus larger than RAM is
likely to be on a user's machine: the figure issue 47 asks for (a 5 GB corpus).

Writes a JSONL corpus of MB megabytes (1.4 KB contract-like documents, ten per source, each
unique) unless it is there, then runs `build_text_corpus` on it, the function `glmtune train`
calls, in a fresh interpreter, with the tiny tokenizer, and reports the process's peak RSS
(VmHWM), the time, the input MB/s and the contract's counts:

    python benchmarks/text_corpus_memory.py --mb 5120 --dir /tmp/corpus5g

Prints one JSON line; the corpus and the token cache stay in --dir (delete them after).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEASURED = """
import json, re, time
from glmtune.data.text_corpus import TextCorpusOptions, build_text_corpus
from glmtune.data.text_sources import TextReadOptions
start = time.perf_counter()
corpus = build_text_corpus([{corpus!r}], TextCorpusOptions(read=TextReadOptions(source_field="source")),
                           tokenizer_dir=None, cache_dir={cache!r})
seconds = time.perf_counter() - start
peak = int(re.search(r"VmHWM:\\s*(\\d+) kB", open("/proc/self/status").read())[1]) * 1024
print("RESULT", json.dumps({{"seconds": seconds, "peak_rss_bytes": peak, "input": corpus.report["input"],
                            "removed": corpus.report.get("removed")}}))
"""


def write_corpus(path: Path, megabytes: float) -> int:
    """The corpus of docs/data.md's memory table; returns its bytes."""
    written, i = 0, 0
    with path.open("w") as f:
        while written < megabytes * (1 << 20):
            text = f"Contract {i}. " + " ".join(f"Clause {k}: the buyer pays invoice {i * 31 + k} within "
                                                  f"{k % 9 + 7} days of delivery." for k in range(20))
            line = json.dumps({"text": text, "source": f"c{i // 10}"}) + "\n"
            f.write(line)
            written, i = written + len(line), i + 1
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, required=True, help="corpus size in MiB")
    parser.add_argument("--dir", type=Path, required=True, help="where the corpus and the cache go")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    corpus = args.dir / f"corpus_{args.mb:g}mb.jsonl"
    if not corpus.is_file():
        started = time.perf_counter()
        write_corpus(corpus, args.mb)
        print(f"wrote {corpus} in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    code = MEASURED.format(corpus=str(corpus), cache=str(args.dir / "cache"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(done.stderr[-3000:])
    result = json.loads(done.stdout.split("RESULT", 1)[1])
    size = corpus.stat().st_size
    result.update(corpus_bytes=size, mb_per_s=size / 2**20 / result["seconds"], cpus=os.cpu_count(),
                  load_average=os.getloadavg())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
