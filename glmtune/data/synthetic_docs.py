"""Bundled documents of the synthetic support task, and questions only they answer.

`generate_documents(seed)` writes the support team's knowledge base as Markdown files:
  * `triage/<category>.md`, one per issue category: how tickets of that category read (the
    generator's own phrasings, the product left out), the severity and the next action the answer
    must give; `triage/answer_format.md`: the answer's JSON object and its allowed values;
  * `catalog/<product>.md`, one per product: what it is, its plans, its support line, the first
    response time of its enterprise plan, where its data is hosted, its current release, its
    escalation address, and which order numbers are its orders (the rule `lookup_order` follows).
The triage facts are what every ticket needs (synthetic.py draws answers from them); the catalog's
support facts are drawn from `random.Random(seed)` and appear nowhere else, so no model knows
them without the documents. `generate_doc_questions(seed)` asks for them: chat rows (a question,
the reference answer) with `required_facts` (the planted value) and `forbidden_claims` (the same
fact of the other products), for a `facts` set (`glmtune decide`'s retrieval arm, docs/decide.md).
Everything follows from the seed.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from glmtune.data.synthetic import ISSUES, NEXT_ACTIONS, PRODUCTS, SEVERITIES, _PLANS
from glmtune.io.outputs import output_dir

_ABOUT = {
    "CloudSync": "file synchronisation across laptops, phones and the web",
    "PayFlow": "online payments and invoicing for small businesses",
    "MailDesk": "a shared team inbox for customer email",
    "PhotoVault": "photo storage and albums shared with family and teams",
    "TaskBoard": "task boards and project planning for teams",
    "SecureVPN": "a VPN that encrypts traffic on public networks",
}
_REGIONS = ("Frankfurt", "Oregon", "Singapore", "Dublin", "Montreal", "Sydney", "Tokyo", "Sao Paulo")
_QUESTIONS = (
    ("line", "What is the phone number of the {p} support line?", "The {p} support line is {v}."),
    ("response", "How soon do {p} enterprise customers get a first response?",
     "{p} enterprise customers get a first response within {v}."),
    ("region", "Where is the data of {p} hosted?", "{p} data is hosted in {v}."),
    ("release", "Which {p} release is current?", "The current {p} release is {v}."),
    ("escalation", "Where do {p} escalations go?", "{p} escalations go to {v}."),
)


def _distinct(rng: random.Random, draw, n: int) -> list[str]:
    """n different values of `draw(rng)`: one product's fact must not be another's."""
    values: list[str] = []
    while len(values) < n:
        value = draw(rng)
        if value not in values:
            values.append(value)
    return values


def _facts(seed: int) -> dict[str, dict[str, str]]:
    """product -> its planted support facts, each different across products (and none a part of
    another's: single-digit hours, fixed-width numbers), so a forbidden claim never matches the fact."""
    rng = random.Random(f"support-docs-{seed}")
    n = len(PRODUCTS)
    drawn = {"line": _distinct(rng, lambda r: f"+1-555-0{r.randrange(100, 1000)}", n),
             "response": [f"{h} hours" for h in rng.sample(range(2, 10), n)],
             "region": rng.sample(_REGIONS, n),
             "release": _distinct(rng, lambda r: f"{r.randrange(2, 10)}.{r.randrange(10, 20)}.{r.randrange(0, 10)}", n),
             "escalation": _distinct(rng, lambda r: f"ops-{r.randrange(1000, 10000)}", n)}
    return {product: {key: values[i] if key != "escalation" else f"{values[i]}@{product.lower()}.example"
                      for key, values in drawn.items()} for i, product in enumerate(PRODUCTS)}


def _triage_doc(category: str) -> str:
    severity, action, phrasings = ISSUES[category]
    title = category.replace("_", " ")
    examples = "\n".join(f"- \"{p.format(p='the product')}\"" for p in phrasings)
    return (f"# Triage: {title}\n\nTickets in the {title} category read like these:\n\n{examples}\n\n"
            f"A {title} ticket has severity {severity}. Its next action is {action}.\n")


def _answer_format_doc() -> str:
    return ("# Triage: the answer\n\nAnswer every ticket with only a JSON object {\"product\": ..., \"severity\": ..., "
            f"\"next_action\": ...}}.\n\nproduct is one of {', '.join(PRODUCTS)}. severity is one of "
            f"{', '.join(SEVERITIES)}. next_action is one of {', '.join(NEXT_ACTIONS)}.\n\nWhen a ticket gives an "
            "order id but does not name the product, call lookup_order with the order id first.\n")


def _catalog_doc(product: str, facts: dict[str, str]) -> str:
    index = PRODUCTS.index(product)
    return (f"# {product}\n\n{product} is {_ABOUT[product]}.\n\n## Plans\n\n{product} comes in {len(_PLANS)} plans: "
            f"{', '.join(_PLANS)}. {product} enterprise customers get a first response within {facts['response']}.\n\n"
            f"## Support\n\nThe {product} support line is {facts['line']}. {product} escalations go to "
            f"{facts['escalation']}. {product} data is hosted in {facts['region']}. The current {product} release is "
            f"{facts['release']}.\n\n## Orders\n\nAn order number (ORD- and five digits) is a {product} order when "
            f"the number leaves {index} when divided by {len(PRODUCTS)}.\n")


def generate_documents(seed: int = 0) -> dict[str, str]:
    """Relative path -> Markdown text of every document (module docstring)."""
    facts = _facts(seed)
    docs = {f"triage/{category}.md": _triage_doc(category) for category in sorted(ISSUES)}
    docs["triage/answer_format.md"] = _answer_format_doc()
    docs.update({f"catalog/{product.lower()}.md": _catalog_doc(product, facts[product]) for product in PRODUCTS})
    return docs


def generate_doc_questions(seed: int = 0) -> list[dict[str, Any]]:
    """One chat row per product and planted fact, whose answer only the documents hold."""
    facts = _facts(seed)
    rows = []
    for product in PRODUCTS:
        for key, question, answer in _QUESTIONS:
            value = facts[product][key]
            rows.append({"id": f"docq-{seed}-{len(rows):03d}", "group": f"docs-{product}", "category": key,
                         "required_facts": [value],
                         "forbidden_claims": [facts[other][key] for other in PRODUCTS if other != product],
                         "messages": [{"role": "user", "content": question.format(p=product)},
                                      {"role": "assistant", "content": answer.format(p=product, v=value)}]})
    return rows


def write_documents(out: str | Path, seed: int = 0, *, overwrite: bool = False) -> Path:
    """The documents as a directory, written in one step (`glmtune.io.outputs.output_dir`)."""
    with output_dir(out, overwrite=overwrite, what="OUT") as tmp:
        for rel, text in generate_documents(seed).items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_text(text, encoding="utf-8")
    return Path(out)
