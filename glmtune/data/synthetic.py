"""Bundled synthetic task: support-ticket triage into a JSON answer.

Each row is a customer ticket; the assistant replies with exactly one JSON object
`{"product": ..., "severity": "low|medium|high|critical", "next_action": ...}`
that satisfies `SCHEMA_PATH` (assets/support_ticket.schema.json).

The mapping is deterministic given keywords, so a tiny model can learn it:
  * product: the product named in the ticket; when the ticket names no product but
    quotes an order id, the assistant first calls `lookup_order` and copies the
    product from the tool response (the ~20% tool-calling subset). `lookup_order`
    is a real function of the order number (product, plan and status follow from it,
    see `lookup_order`), so an evaluation can execute the model's call and compare
    results: every order id in the data belongs to the row's product;
  * severity and next_action: fixed by the issue category, which is recognisable
    from the phrasing (each phrasing belongs to exactly one category).
Greetings, dates, sign-offs and customer names are noise. Rows carry a `group`
(the customer id) so splits can keep a customer's tickets together, and a `category`
for evaluation scorecards: "tool_call" for the rows solved through the lookup, else
the issue category (training reads only messages and tools).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from glmtune.io.outputs import check_output, output_file

SCHEMA_PATH = Path(__file__).parent / "assets" / "support_ticket.schema.json"

PRODUCTS = ("CloudSync", "PayFlow", "MailDesk", "PhotoVault", "TaskBoard", "SecureVPN")
SEVERITIES = ("low", "medium", "high", "critical")

# category -> (severity, next_action, phrasings). `{p}` is the product reference.
ISSUES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "outage": ("critical", "escalate_to_oncall", (
        "{p} is completely down for our whole team",
        "{p} shows a 503 error on every page",
        "nobody in the company can reach {p} right now",
    )),
    "data_loss": ("critical", "restore_from_backup", (
        "all of my files disappeared from {p}",
        "{p} deleted a month of our records",
        "after syncing, {p} wiped the shared folder",
    )),
    "login": ("high", "reset_credentials", (
        "I cannot log in to {p} anymore",
        "the password reset mail for {p} never arrives",
        "{p} keeps saying my account is locked",
    )),
    "bug": ("high", "open_bug_report", (
        "the export button in {p} crashes the app",
        "{p} saves the wrong date on every entry",
        "search in {p} returns results from other projects",
    )),
    "billing": ("medium", "review_billing", (
        "I was charged twice for {p} this month",
        "the invoice for {p} shows the wrong amount",
        "my discount for {p} was not applied",
    )),
    "performance": ("medium", "collect_diagnostics", (
        "{p} has become very slow since Monday",
        "pages in {p} take minutes to load",
        "{p} uses all the memory on my laptop",
    )),
    "feature_request": ("low", "forward_to_product", (
        "it would be great if {p} had a dark mode",
        "please add CSV export to {p}",
        "could {p} support shared calendars",
    )),
    "how_to": ("low", "send_documentation", (
        "how do I invite a colleague to {p}",
        "where can I change the language in {p}",
        "how can I move my data into {p}",
    )),
}
NEXT_ACTIONS = tuple(sorted({action for _, action, _ in ISSUES.values()}))

_GREETINGS = ("Hi,", "Hello team,", "Hey there,", "Good morning,", "Dear support,", "")
_WHEN = ("This started yesterday.", "It began this morning.", "It happened after the last update.",
         "We noticed it two days ago.", "", "")
_CLOSINGS = ("Thanks, {n}", "Regards, {n}", "- {n}", "Cheers, {n}", "Best, {n}")
_NAMES = ("Ana", "Ben", "Chloe", "Dmitri", "Elif", "Farah", "Goran", "Hana", "Ivan", "Jia",
          "Kofi", "Lena", "Mateo", "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tomas")
_STATUSES = ("active", "trial", "past_due", "cancelled")
_PLANS = ("starter", "business", "enterprise")

SYSTEM_PROMPT = (
    "You are a support triage assistant. Read the customer's ticket and reply with only a JSON object "
    '{"product": ..., "severity": ..., "next_action": ...}. '
    f"product is one of: {', '.join(PRODUCTS)}. "
    f"severity is one of: {', '.join(SEVERITIES)}. "
    f"next_action is one of: {', '.join(NEXT_ACTIONS)}. "
    "If the ticket gives an order id but does not name the product, call lookup_order first."
)

LOOKUP_ORDER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "lookup_order",
        "description": "Look up an order by id and return its product, plan and status.",
        "parameters": {
            "type": "object",
            "properties": {"order_id": {"type": "string", "description": "Order id such as ORD-12345."}},
            "required": ["order_id"],
        },
    },
}

# Fractions of rows: the tool-calling subset, and rows that quote an order id but
# also name the product (tools offered, no call needed).
_TOOL_CALL_FRACTION = 0.2
_ORDER_NO_CALL_FRACTION = 0.1


def load_schema() -> dict[str, Any]:
    """The JSON Schema every final answer of the synthetic task satisfies."""
    return json.loads(SCHEMA_PATH.read_text())


def lookup_order(order_id: str) -> dict[str, str]:
    """The order behind an id `ORD-<5 digits>`: its product, plan and status are fixed by the
    number (product = PRODUCTS[n % 6], plan = _PLANS[n // 6 % 3], status = _STATUSES[n // 18 % 4]).

    The tool responses of the generated data are exactly this function's results; the
    bundled eval suite registers it as the `lookup_order` tool (`glmtune eval`).

    Raises:
        KeyError: an id that is not `ORD-` followed by five digits (no such order).
    """
    digits = order_id[4:] if isinstance(order_id, str) and order_id.startswith("ORD-") else ""
    if len(digits) != 5 or not digits.isdigit() or digits[0] == "0":
        raise KeyError(f"no order {order_id!r}")
    number = int(digits)
    return {"order_id": order_id, "product": PRODUCTS[number % len(PRODUCTS)],
            "plan": _PLANS[number // len(PRODUCTS) % len(_PLANS)],
            "status": _STATUSES[number // (len(PRODUCTS) * len(_PLANS)) % len(_STATUSES)]}


def _order_id(rng: random.Random, product: str) -> str:
    """A random five-digit order id whose order (`lookup_order`) is for `product`."""
    number = rng.randrange(10000 // len(PRODUCTS) + 1, 100000 // len(PRODUCTS)) * len(PRODUCTS)
    return f"ORD-{number + PRODUCTS.index(product)}"


def _answer(product: str, category: str) -> str:
    severity, next_action, _ = ISSUES[category]
    return json.dumps({"product": product, "severity": severity, "next_action": next_action})


def _ticket(rng: random.Random, product_ref: str, category: str, suffix: str) -> str:
    phrasing = rng.choice(ISSUES[category][2]).format(p=product_ref)
    parts = [rng.choice(_GREETINGS), phrasing[0].upper() + phrasing[1:] + ".", rng.choice(_WHEN), suffix,
             rng.choice(_CLOSINGS).format(n=rng.choice(_NAMES))]
    return " ".join(part for part in parts if part)


def generate_row(rng: random.Random, index: int, *, seed: int, num_customers: int) -> dict[str, Any]:
    """One synthetic ticket row; all randomness comes from `rng`."""
    product = rng.choice(PRODUCTS)
    category = rng.choice(sorted(ISSUES))
    customer = f"cust-{rng.randrange(num_customers):05d}"
    order_id = _order_id(rng, product)
    kind = rng.random()
    row: dict[str, Any] = {"id": f"synth-{seed}-{index:06d}", "group": customer,
                           "category": "tool_call" if kind < _TOOL_CALL_FRACTION else category}
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT}]
    if kind < _TOOL_CALL_FRACTION:
        # The ticket never names the product: the only way to it is the order lookup.
        ticket = _ticket(rng, f"the product on order {order_id}", category, "")
        response = lookup_order(order_id)
        assert response["product"] == product
        messages += [
            {"role": "user", "content": ticket},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "lookup_order", "arguments": {"order_id": order_id}}}]},
            {"role": "tool", "content": json.dumps(response)},
            {"role": "assistant", "content": _answer(product, category)},
        ]
        row["tools"] = [LOOKUP_ORDER_TOOL]
    else:
        suffix = f"Order {order_id}." if kind < _TOOL_CALL_FRACTION + _ORDER_NO_CALL_FRACTION else ""
        messages += [
            {"role": "user", "content": _ticket(rng, product, category, suffix)},
            {"role": "assistant", "content": _answer(product, category)},
        ]
        if suffix:
            row["tools"] = [LOOKUP_ORDER_TOOL]
    row["messages"] = messages
    return row


def generate_rows(num_rows: int, seed: int = 0, num_customers: int | None = None) -> list[dict[str, Any]]:
    """`num_rows` deterministic rows for `seed`.

    Args:
        num_rows: rows to generate.
        seed: seeds a private `random.Random`, so output never depends on global state.
        num_customers: size of the customer pool (the `group` values); defaults to
            num_rows // 4 so each customer has a few tickets.
    """
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    num_customers = num_customers or max(1, num_rows // 4)
    rng = random.Random(seed)
    return [generate_row(rng, i, seed=seed, num_customers=num_customers) for i in range(num_rows)]


def check_jsonl_target(path: str | Path, *, overwrite: bool) -> Path:
    """Refuse a `path` that `write_jsonl` must not replace (one-line ValueError).

    A directory is never replaced by the file, even with `overwrite`: it holds whatever
    its owner put there, and a JSONL file in its place is never what was meant. A link
    is a file here (replacing it leaves what it points to alone).
    """
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        raise ValueError(f"OUT {path} is a directory and the output is a .jsonl file; --overwrite never replaces "
                         f"a directory by a file: name a file (e.g. {path / 'synth.jsonl'})")
    return check_output(path, kind="file", overwrite=overwrite)


def write_jsonl(rows: list[dict[str, Any]], path: str | Path, *, overwrite: bool = True) -> Path:
    """Write rows as JSONL (one compact JSON object per line), atomically; returns the path.

    Args:
        overwrite: replace an existing file at `path` (never a directory:
            `check_jsonl_target`). `glmtune data synth` passes its --overwrite; the
            default serves callers that write their own temporary file.
    """
    path = check_jsonl_target(path, overwrite=overwrite)
    with output_file(path, overwrite=overwrite) as tmp, tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path
