"""Prompt lookup: draft tokens copied from earlier in the request's own tokens.

The last ``n`` tokens (``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``) are
looked for earlier in the prompt and output; the tokens that followed their most recent
earlier occurrence are the proposal. A request that quotes or edits its prompt (summaries,
rewrites, code edits) finds long runs this way at no model cost.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix
    of ``token_ids`` of ``min_n``..``max_n`` tokens; empty if none occurs earlier."""
    length = len(token_ids)
    if k < 1 or length <= min_n:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows starting before length - n: each has at least one token after it.
        windows = sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []
