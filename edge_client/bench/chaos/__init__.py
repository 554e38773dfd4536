"""The chaos suite: a count-based TCP fault proxy (``proxy``, over ``http2``'s message
counts), the scenarios (``scenarios``) and ``edgespec-bench chaos`` (``run``). See
docs/chaos.md."""
