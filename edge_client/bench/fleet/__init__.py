"""A simulated fleet of edge devices load-testing a verifier over real gRPC (grpc.aio).

Each of N asyncio clients is one device (``device``): its own connection (its own TCP
connection), its own network profile injected around every message (``netem``), its own
workload (``workload``), and the client core the app API runs (edge_client.core): deadlines,
reopening after evictions and restarts, back-off with jitter as the server asks, a retry
budget. The fleet adds no client logic of its own; it injects the network emulation (a
``Link``) and the drafts (a ``Propose``), and turns the core's deliveries into records.

Modes: ``spec`` runs speculative sessions (``--protocol lookahead``, the default: the
verifier decodes back to back while the device streams drafts ahead; or ``rounds``: a
Verify round trip per round, with cloud-side Decodes when drafting does not pay);
``baseline`` is cloud-only decoding through the verifier's Generate stream (one target
forward per token, the same continuous batching): the core's "cloud" protocol.

Drafts (spec mode, ``drafts``): ``model`` runs the ONNX draft on the client (in a worker
thread, so the event loop keeps serving the other devices); ``replay`` sends drafts
recorded from the same model (``replay``), which takes edge CPU out of a server benchmark
on a small machine. Recording (greedy only): the target's greedy continuation of every
request of the workload, from the verifier's Generate RPC (lossless verification commits
exactly that), and the model's K greedy drafts after every prefix of it. In greedy mode a
proposal depends only on the committed context, and the first k of K greedy drafts are the
k drafts, so a replayed proposal is exactly what the model would send whatever K the round
uses. A context that is not in the book (a near tie resolved differently under batching)
falls back to the model and is counted as a replay miss. Books are cached on disk per
(target, draft, K).

Workloads: ``chat`` sends chat prompts (shared.prompts.CHAT_PROMPTS, then the held-out split
of edge_client.tools.distill.prompts) for long answers (``chat_tokens``). ``ime`` types
sentences word by word: after every 1-3 more words, the grown raw-text prefix is sent for a
completion of 4-12 tokens, with a typing pause (``think_ms``, +-50 %) before each request;
with ``ime_document`` the sentences are one document, so each prompt also holds every
sentence before the one being typed. ``mixed`` makes even-numbered clients chat and
odd-numbered ones type.

Timing definitions (all times are when the device has the data, i.e. after the emulated
downlink delay; per-token figures count only what was delivered inside the window):

- a request's **TTFT** is from its start (before its first draft is made or its request is
  sent) to the delivery of its first token;
- a request's **TPOT** is (delivery of its last token - delivery of its first token) /
  (tokens - 1), over requests with at least 2 tokens. Tokens that arrive together (a
  speculative round) share one delivery time. A request cut by the end of the window counts
  with the tokens it had by then;
- percentiles are over requests, all clients together (per client: over its requests);
- **tokens/s** is tokens delivered inside the window / window length;
- round trips, target forwards and bytes (serialized protobuf, both directions, failed
  attempts included) are per token delivered inside the window;
- server queue / forward ms per token add up the verifier's own timing fields as each
  session sees them (a forward shared by B sessions counts once for each of them).

Before the window, one uncounted request per workload kind warms the server up; clients then
start spread over ``ramp_s`` and run closed-loop (next request as soon as the last one ends,
after the think time) until the window closes, when in-flight requests are cancelled (which
closes their streams and the server's sessions). Loops are bounded: requests per client,
and the core's retry budget per generation.

Modules: ``config`` (FleetConfig, the loopback check), ``workload``, ``netem``, ``replay``
(recorded drafts), ``drafts`` (a device's proposer), ``device``, ``report``, ``run``
(run_fleet), ``sweep`` (the capacity sweep), ``plots``, ``verifier`` (the verifier a run
targets), ``cli`` (``edgespec-bench fleet`` / ``sweep``).
"""
