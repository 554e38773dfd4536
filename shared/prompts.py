"""Chat prompts written for this project, used by the end-to-end tests and the benchmark.

They mix the kinds of request the edge sees: chat answers, code, lists, short facts and
short completions.
"""

from __future__ import annotations

CHAT_PROMPTS: tuple[str, ...] = (
    "What is the capital of France? Answer in one sentence.",
    "Explain what a hash table is to a new programmer.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "List five fruits that are high in vitamin C.",
    "Give me three tips for sleeping better.",
    "What causes the seasons on Earth?",
    "Write a short poem about the sea at night.",
    "How do I reverse a list in Python?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "What is the difference between weather and climate?",
    "Suggest a name for a small bakery that sells bread and coffee.",
    "Translate 'good morning, how are you?' into Spanish.",
    "Why is the sky blue?",
    "Write a SQL query that counts the rows in a table called users.",
    "What are the three states of matter?",
    "Give a one-paragraph introduction to photosynthesis.",
    "How many days are there in a leap year?",
    "Write an email subject line for a team meeting on Friday.",
    "What does HTTP stand for, and what is it used for?",
    "List the planets of the solar system in order from the Sun.",
    "Complete the sentence: The best way to learn a new language is",
    "Describe a cat to someone who has never seen one.",
    "What is a prime number? Give three examples.",
    "Write a haiku about autumn leaves.",
)
