"""Chat prompts written for this project, used by the end-to-end tests and the benchmarks.

They mix the kinds of request the edge sees: chat answers, code, lists, short facts and
short completions. The prompts are data, kept in ``chat_prompts.json`` beside this module
(shipped as package data); this module only loads them.
"""

from __future__ import annotations

import json
from importlib.resources import files

CHAT_PROMPTS: tuple[str, ...] = tuple(
    json.loads(files(__package__).joinpath("chat_prompts.json").read_text(encoding="utf-8")))
