"""A model's loss on the domain set's windows (`domain_text.py`), source by source, through its backend.

Apart from `domain_text.py` because it needs the backends (the suite, which reads the domain
set's configuration, must not import them): each source's windows are one `Backend.text_loss`
call, the general text's scoring (a local model: one forward per window through the family's
loss; an endpoint: the engine's prompt log-probabilities of each window).
"""

from __future__ import annotations

from glmtune.eval.backends import Backend, NotAvailable
from glmtune.eval.domain_text import DOMAIN_METRICS, METRIC_PREFIX


def domain_losses(backend: Backend, windows: dict[str, list[list[int]]] | None,
                  not_available: dict[str, str]) -> dict[str, list[float]] | None:
    """Source -> [summed loss in nats, predicted tokens] under `backend`; None without a domain set.
    A backend that cannot (an engine without prompt log-probabilities) gives {} and its reason
    in `not_available` for both domain metrics (null values, never a silent zero)."""
    if windows is None:
        return None
    sums: dict[str, list[float]] = {}
    try:
        for source, source_windows in windows.items():
            mean, count = backend.text_loss(source_windows)
            sums[source] = [mean * count, count]
    except NotAvailable as exc:
        why = str(exc).replace("general-text loss", "domain-text loss")
        not_available.update({f"{METRIC_PREFIX}/{definition.name}": why for definition in DOMAIN_METRICS})
        return {}
    return sums
