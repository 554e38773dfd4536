"""The fleet's workloads: chat prompts, IME typing sessions, and each client's schedule."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from edge_client.bench.fleet.config import FleetConfig
from edge_client.tokenizer import EdgeTokenizer

# Sentences the simulated IME users type, word by word (written for this benchmark).
IME_SENTENCES: tuple[str, ...] = (
    "I will be a few minutes late because the bus did not come on time this morning",
    "Could you send me the slides from yesterday so I can review them before lunch",
    "Thanks for dinner last night, the pasta was great and we should do it again soon",
    "The package should arrive on Thursday but let me know if it does not show up",
    "Let us move the weekly sync to Friday afternoon since half the team is away",
    "Remember to pick up milk and bread on the way home from the office tonight",
    "I have attached the signed contract and a copy of the invoice for your records",
    "Happy birthday to my favourite sister, I hope your day is full of good surprises",
    "The build failed again on the main branch, I think the new test is flaky",
    "We are planning a short hike on Sunday morning if the weather stays dry",
    "Please water the plants on the balcony while I am travelling next week",
    "Our flight lands at seven so we should be at the hotel around nine",
    "Can we talk about the budget for next quarter before the board meeting",
    "The doctor said the results look fine and there is nothing to worry about",
    "I finished reading the book you lent me and I loved the ending",
    "Do not forget that the library closes early on public holidays",
)


@dataclass(frozen=True)
class Request:
    kind: str  # "chat" or "ime"
    prompt_ids: tuple[int, ...]
    max_new_tokens: int

    @property
    def key(self) -> str:
        """Greedy continuations of one prompt are prefixes of each other: the prompt alone
        keys a recording."""
        return ",".join(map(str, self.prompt_ids))


def chat_requests(tokenizer: EdgeTokenizer, count: int, max_new_tokens: int,
                  max_context: int) -> list[Request]:
    from shared.prompts import CHAT_PROMPTS

    texts = list(CHAT_PROMPTS)
    if count > len(texts):
        from edge_client.tools.distill.prompts import prompt_split

        texts += [p.text for p in prompt_split("heldout") if p.chat and p.kind == "chat"]
    out = []
    for text in texts:
        ids = tokenizer.encode_chat(text)
        n = min(max_new_tokens, max_context - len(ids) - 1)
        if ids and n >= 1:
            out.append(Request("chat", tuple(ids), n))
        if len(out) == count:
            break
    if not out:
        raise ValueError("no chat prompt fits the verifier's context")
    return out


def ime_requests(tokenizer: EdgeTokenizer, count: int, max_context: int,
                 seed: int, document: bool = False) -> list[list[Request]]:
    """Per sentence, its typing session: requests over ever longer prefixes (of the sentence
    alone, or with ``document`` of the text of every sentence before it too)."""
    rng = np.random.default_rng([seed, 7])
    sessions = []
    for i, sentence in enumerate(IME_SENTENCES[:count]):
        before = list(IME_SENTENCES[:i]) if document else []
        words = sentence.split()
        typed = int(rng.integers(1, 4))
        requests = []
        while typed <= len(words):
            ids = tokenizer.encode(" ".join(before + words[:typed]))
            n = min(int(rng.integers(4, 13)), max_context - len(ids) - 1)
            if ids and n >= 1:
                requests.append(Request("ime", tuple(ids), n))
            typed += int(rng.integers(1, 4))
        if requests:
            sessions.append(requests)
    if not sessions:
        raise ValueError("no IME prefix fits the verifier's context")
    return sessions


@dataclass(frozen=True)
class Workload:
    chat: list[Request]
    ime: list[list[Request]]

    def kind_of(self, name: str, client: int) -> str:
        return name if name != "mixed" else ("chat" if client % 2 == 0 else "ime")

    def schedule(self, kind: str, client: int, count: int) -> Iterator[Request]:
        """Client ``client``'s first ``count`` requests, in order, cycling."""
        if kind == "chat":
            order = [self.chat[(client + j) % len(self.chat)] for j in range(len(self.chat))]
        else:
            order = [r for j in range(len(self.ime))
                     for r in self.ime[(client + j) % len(self.ime)]]
        for i in range(count):
            yield order[i % len(order)]

    def all_requests(self, name: str, clients: int) -> list[Request]:
        kinds = {self.kind_of(name, i) for i in range(clients)}
        out = list(self.chat) if "chat" in kinds else []
        if "ime" in kinds:
            out += [r for s in self.ime for r in s]
        return out


def build_workload(tokenizer: EdgeTokenizer, config: FleetConfig, max_context: int) -> Workload:
    chat = (chat_requests(tokenizer, config.prompts, config.chat_tokens, max_context)
            if config.workload in ("chat", "mixed") else [])
    ime = (ime_requests(tokenizer, config.prompts, max_context, config.seed,
                        config.ime_document)
           if config.workload in ("ime", "mixed") else [])
    return Workload(chat, ime)
