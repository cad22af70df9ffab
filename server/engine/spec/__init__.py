"""Speculative decoding: proposers (``proposer.py``), the acceptance rule (``accept.py``)
and each request's speculation state with its adaptive k (``state.py``)."""
