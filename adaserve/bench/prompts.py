"""Fixed benchmark prompts, so every benchmark run feeds the same text."""

from __future__ import annotations

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a refrigerator keeps food cold.",
    "def quicksort(arr):",
    "List five tips for staying focused while studying.",
    "What causes the seasons on Earth?",
    "Summarize the plot of Romeo and Juliet.",
    "Describe the water cycle in simple terms.",
    "Write a Python function that checks whether a number is prime.",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
    "What are the benefits of regular exercise?",
    "Translate 'good morning' into French, Spanish and German.",
    "How does a bicycle stay upright?",
    "Write a haiku about autumn leaves.",
    "Explain the difference between a virus and a bacterium.",
    "What is the Pythagorean theorem?",
]


def prompts(n: int) -> list[str]:
    """n prompts, cycling through the list."""
    return [PROMPTS[i % len(PROMPTS)] for i in range(n)]
