"""The fuzz suite: Hypothesis strategies over every request (``strategies``), the documented
statuses (``statuses``), the live verifier and the honest session beside the fuzz
(``target``), the run and its properties (``run``), ``edgespec-bench fuzz`` (``cli``). See
docs/chaos.md."""
