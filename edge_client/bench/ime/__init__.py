"""The typing benchmark (``edgespec-bench ime``): what an IME user feels, from a key press to
a suggestion, against a real verifier over real gRPC and an emulated network.

A simulated user (``typist``) types natural messages (``messages.txt``, written for this
benchmark and kept apart from training data) character by character, with key intervals of
80-200 ms, pauses between words and sentences, and the odd typo erased with a backspace. After
every key the IME asks for a suggestion of 4-12 tokens; the next key cancels it if it is still
in flight. The same keys are typed, field by field in turn, by each mode (``modes``): edit
sessions, a new session per key (today's client), and cloud-only decoding, each over its own
connection with the fleet's network emulation (edge_client.bench.fleet.netem). Then an outage
drill per mode kills the verifier in the middle of typing and starts it again (``run``).

Modules: ``typist`` (the keys), ``modes`` (the three strategies and a key's record),
``verifier`` (the verifier process and its counters), ``run`` (the phases), ``report``
(figures and JSON, definitions there), ``plots`` (the CDF), ``cli``.
"""
