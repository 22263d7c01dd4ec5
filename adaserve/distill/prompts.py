"""Chat prompts for distillation: a topic x instruction x format grid, split by topic.

Held-out prompts are whole topics the draft never saw in training (every `EVAL_TOPIC_EVERY`-th
topic), so agreement measured on them is agreement on prompts not used in training, not on
re-worded training prompts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

TOPICS = (
    "volcanoes",
    "the French Revolution",
    "photosynthesis",
    "black holes",
    "sourdough bread",
    "machine learning",
    "the stock market",
    "honeybees",
    "the Roman Empire",
    "climate change",
    "the human heart",
    "electric cars",
    "chess openings",
    "the water cycle",
    "jazz music",
    "quantum computing",
    "the Great Wall of China",
    "vaccines",
    "coral reefs",
    "the internet",
    "Shakespeare's plays",
    "compound interest",
    "sleep",
    "the Moon landing",
    "recycling",
    "dinosaurs",
    "public speaking",
    "the immune system",
    "renewable energy",
    "origami",
    "the Python programming language",
    "ancient Egypt",
    "earthquakes",
    "coffee",
    "friendship",
    "time management",
    "the solar system",
    "democracy",
    "marathon training",
    "gardening",
)

INSTRUCTIONS = (
    "Explain {topic} to a ten-year-old.",
    "Write a short poem about {topic}.",
    "List five interesting facts about {topic}.",
    "What are the main advantages and disadvantages of {topic}?",
    "Write a short story that involves {topic}.",
    "Give a one-paragraph summary of {topic}.",
    "How would you teach {topic} to a class of high-school students?",
    "Write three quiz questions about {topic}, with answers.",
    "What are common misconceptions about {topic}?",
    "Describe the history of {topic} in a few sentences.",
    "Write a persuasive paragraph about why people should care about {topic}.",
    "Compare {topic} with something from everyday life.",
    "What questions do experts still have about {topic}?",
    "Write a short dialogue between two friends discussing {topic}.",
    "Give step-by-step advice for someone who wants to learn about {topic}.",
)

# Appended to the instruction; "" keeps it plain. Varies length and layout of the answers.
FORMATS = (
    "",
    " Keep it under 80 words.",
    " Use a bulleted list.",
    " Answer in a friendly, informal tone.",
    " Be precise and technical.",
    " Start with a one-sentence summary.",
)

EVAL_TOPIC_EVERY = 10  # topics 9, 19, 29, 39 are held out


@dataclass(frozen=True)
class ChatPrompt:
    """One cell of the grid; `index` is its place in the full grid (stable across runs)."""

    index: int
    topic: str
    instruction: str
    format: str

    @property
    def text(self) -> str:
        return self.instruction.format(topic=self.topic) + self.format

    @property
    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.text}]


@dataclass(frozen=True)
class PromptGrid:
    """The grid; tests pass their own (tiny-vocabulary) topics and instructions."""

    topics: tuple[str, ...] = TOPICS
    instructions: tuple[str, ...] = INSTRUCTIONS
    formats: tuple[str, ...] = FORMATS
    eval_topic_every: int = EVAL_TOPIC_EVERY

    def __post_init__(self) -> None:
        if not self.topics or not self.instructions or not self.formats:
            raise ValueError("a prompt grid needs at least one topic, instruction and format")
        if self.eval_topic_every < 2 or self.eval_topic_every > len(self.topics):
            raise ValueError(
                f"eval_topic_every must be in [2, {len(self.topics)}] so that both splits "
                f"have topics, got {self.eval_topic_every}"
            )

    def is_eval_topic(self, topic_index: int) -> bool:
        return topic_index % self.eval_topic_every == self.eval_topic_every - 1

    def all_prompts(self) -> list[ChatPrompt]:
        cells = []
        for t, topic in enumerate(self.topics):
            for i, instruction in enumerate(self.instructions):
                for f, fmt in enumerate(self.formats):
                    index = (t * len(self.instructions) + i) * len(self.formats) + f
                    cells.append(ChatPrompt(index, topic, instruction, fmt))
        return cells

    def split(self, name: str, seed: int = 0) -> list[ChatPrompt]:
        """'train' or 'eval' prompts in a seeded shuffled order (a prefix is a fair sample)."""
        if name not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {name!r}")
        per_topic = len(self.instructions) * len(self.formats)
        want_eval = name == "eval"
        cells = [
            c for c in self.all_prompts() if self.is_eval_topic(c.index // per_topic) == want_eval
        ]
        if not want_eval:
            random.Random(seed).shuffle(cells)
            return cells
        # Held-out prompts in the plain format come first: they stand for ordinary requests.
        plain = [c for c in cells if c.format == ""]
        rest = [c for c in cells if c.format != ""]
        random.Random(seed).shuffle(plain)
        random.Random(seed + 1).shuffle(rest)
        return plain + rest
