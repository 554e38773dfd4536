"""``edge-client chat --embedded`` in a real terminal (tmux), with the real SmolLM2 target:
an answer streams, /stats prints the speculative statistics, a second turn sees the first
(history kept), Ctrl-C cancels an answer and the prompt comes back, /reset, /quit exits 0.

Skipped where tmux is not installed; under CI (which installs it, .ci/run) it fails instead.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.real_model

REPO = Path(__file__).resolve().parent.parent
PROMPT = "you> "
STATS = re.compile(r"\[stats\] acceptance \d\.\d\d, \d+\.\d\d tokens/round, \d+ round trips, "
                   r"\d+\.\d tokens/s")


def tmux_binary() -> str:
    found = shutil.which("tmux")
    if found is None:
        if os.environ.get("CI"):  # .ci/run installs it: never skip there
            pytest.fail("tmux is not installed (apt-get install tmux)")
        pytest.skip("tmux is not installed (apt-get install tmux)")
    return found


class Pane:
    """One detached tmux session on a private server socket."""

    def __init__(self, tmux: str, command: str) -> None:
        self.tmux = tmux
        self.socket = f"edgespec-chat-{uuid.uuid4().hex[:8]}"
        self.run("new-session", "-d", "-x", "150", "-y", "60", "-s", "chat", command)

    def run(self, *args: str) -> str:
        return subprocess.run([self.tmux, "-L", self.socket, *args], check=True,
                              capture_output=True, text=True).stdout

    def screen(self) -> str:
        # -J joins wrapped lines, so a long line is matched whole; -S -: the whole history.
        return self.run("capture-pane", "-p", "-J", "-S", "-", "-t", "chat")

    def send(self, *keys: str) -> None:
        self.run("send-keys", "-t", "chat", *keys)

    def wait_for(self, what, timeout_s: float, why: str) -> str:
        """Polls the screen until ``what(screen)`` is true; fails with the screen if not."""
        deadline = time.monotonic() + timeout_s
        while True:
            screen = self.screen()
            if what(screen):
                return screen
            if time.monotonic() > deadline:
                pytest.fail(f"{why}: not on screen after {timeout_s:.0f} s:\n{screen}")
            time.sleep(0.1)

    def close(self) -> None:
        subprocess.run([self.tmux, "-L", self.socket, "kill-server"], capture_output=True)


def at_prompt(screen: str, prompts: int) -> bool:
    """The program waits at its ``prompts``-th prompt (an empty prompt line, last)."""
    lines = [line for line in screen.splitlines() if line.strip()]
    return screen.count(PROMPT) >= prompts and bool(lines) and lines[-1].rstrip() == PROMPT.strip()


def test_chat_in_a_terminal(real_assets):
    tmux = tmux_binary()
    cli = [sys.executable, "-m", "edge_client.cli", "chat", "--embedded",
           "--max-new-tokens", "160"]
    # The exit status is printed after the program ends; the shell then waits, so the
    # screen can still be read.
    command = (f"cd {shlex.quote(str(REPO))} && {shlex.join(cli)}; "
               "echo EXIT=$?; sleep 120")
    pane = Pane(tmux, command)
    try:
        pane.wait_for(lambda s: at_prompt(s, 1), 240, "the first prompt")
        pane.send("What is the capital of France?", "Enter")
        screen = pane.wait_for(lambda s: at_prompt(s, 2), 120, "the first answer")
        assert re.search(r"bot> .*Paris", screen), screen

        pane.send("/stats", "Enter")
        screen = pane.wait_for(lambda s: at_prompt(s, 3), 30, "the stats")
        assert STATS.search(screen), screen
        assert "chat: 1 answers" in screen

        pane.send("And of Italy?", "Enter")  # needs the first turn to mean anything
        screen = pane.wait_for(lambda s: at_prompt(s, 4), 120, "the second answer")
        assert re.search(r"bot> .*Rome", screen), screen

        pane.send("Write a long story about a dragon who loves books.", "Enter")
        # Ctrl-C once the answer is streaming (some words after "bot> ").
        pane.wait_for(lambda s: re.search(r"books\.\n\s*bot> \S+ \S+ \S+", s), 120,
                      "the third answer streaming")
        pane.send("C-c")
        screen = pane.wait_for(lambda s: "[cancelled]" in s and at_prompt(s, 5), 30,
                               "the prompt after Ctrl-C")
        assert "EXIT=" not in screen  # the program still runs

        pane.send("/stats", "Enter")  # and still answers commands
        screen = pane.wait_for(lambda s: at_prompt(s, 6), 30, "the stats after Ctrl-C")
        assert "chat: 3 answers" in screen

        pane.send("/reset", "Enter")
        pane.wait_for(lambda s: "[conversation cleared]" in s and at_prompt(s, 7), 30,
                      "the reset")
        pane.send("/quit", "Enter")
        screen = pane.wait_for(lambda s: "EXIT=" in s, 60, "the exit")
        assert "EXIT=0" in screen, screen
    finally:
        pane.close()
