"""Offline benchmarks of the edge side (``edgespec-bench``); they import torch and the verifier.

- ``edge`` (``edgespec-bench e2e``): the same prompts through the target alone, transformers
  assisted generation and edgespec (loopback and with an injected RTT), side by side;
- ``acceptance``: how much of each drafter's output the target accepts, in-process;
- ``fleet``: simulated devices load-testing a verifier, and the capacity sweep;
- ``restart_drill``: a verifier killed and restarted mid-generation;
- ``cli``: the ``edgespec-bench`` command.

The device runtime never imports this package.
"""
