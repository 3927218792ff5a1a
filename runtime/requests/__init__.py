"""Requests: admitting them (granularity, budget, the residency a request needs), plain generation,
and each request's and choice's state, turned from the wire's request into prompt tokens."""
