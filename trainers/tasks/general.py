"""General-instruction prompts (drafter training, acceptance measurement) and the held-out prompt
sets, generated procedurally.

A **template** is an instruction pattern with slots (topic, count, form, audience...);
filling the slots from the word lists below gives thousands of distinct prompts from a
few hundred template x form combinations. The **split** of a prompt is a fixed function
of its text's hash (as in ``trainers.tasks``), so train and held-out never share a prompt.
"""

from __future__ import annotations

import hashlib
import random

from rollout.chat import chat_ids
from trainers.tasks.arithmetic import make_problems

TOPICS = (
    "photosynthesis", "the water cycle", "black holes", "the French Revolution", "machine learning",
    "climate change", "the human heart", "volcanoes", "the stock market", "recycling", "the moon landing",
    "honey bees", "electric cars", "the internet", "vaccines", "the Roman Empire", "rainbows", "gravity",
    "healthy sleep", "coffee", "the ocean tides", "earthquakes", "democracy", "the printing press",
    "solar panels", "dinosaurs", "the immune system", "compound interest", "chess", "jazz music",
    "the Great Wall of China", "volunteering", "time management", "public speaking", "friendship",
    "bread baking", "DNA", "the periodic table", "renewable energy", "the Amazon rainforest",
    "penguins", "the Olympic Games", "smartphones", "meditation", "learning a language", "gardening",
    "the solar system", "inflation", "bicycles", "the Renaissance", "clouds", "magnets", "video games",
    "the pyramids of Egypt", "libraries", "first aid", "the human brain", "origami", "tea", "deserts",
)
THINGS = (
    "fruits", "countries in Europe", "programming languages", "musical instruments", "ways to save water",
    "healthy breakfast ideas", "board games", "famous scientists", "ways to reduce stress", "planets",
    "study tips", "kitchen tools", "animals that live in the ocean", "indoor hobbies", "colors",
    "reasons to exercise", "things to pack for a trip", "birthday party ideas", "mammals", "vegetables",
)
FORMS = ("poem", "short story", "haiku", "limerick", "letter", "diary entry", "dialogue", "news report",
         "product description", "speech")
AUDIENCES = ("a five-year-old", "a high school student", "a beginner", "an expert", "a grandparent")
ACTIVITIES = ("learning to cook", "running a marathon", "starting a blog", "saving money", "making friends at a new school",
              "writing an essay", "keeping a plant alive", "preparing for a job interview", "traveling on a budget",
              "staying focused while studying")
CODE_TASKS = ("reverses a string", "checks whether a number is prime", "returns the largest item in a list",
              "counts the vowels in a word", "computes the factorial of n", "sorts a list of names",
              "converts Celsius to Fahrenheit", "sums the even numbers in a list", "checks if a word is a palindrome",
              "removes duplicates from a list")
LANGS = ("Python", "JavaScript")
SENTENCES = (
    "The cat sat quietly on the warm windowsill, watching the birds outside.",
    "Our team finished the project two days early because everyone helped each other.",
    "The museum will be closed on Monday for repairs to the roof.",
    "She planted tomatoes in the spring and had a huge harvest by August.",
    "The train was delayed by an hour due to heavy snow on the tracks.",
    "Reading every day can improve your vocabulary and your focus.",
)

TEMPLATES = (
    "Explain {topic} to {audience}.",
    "What is {topic}? Answer in {n} sentences.",
    "Give me {n} interesting facts about {topic}.",
    "Write a {form} about {topic}.",
    "Write a short {form} about {topic} for {audience}.",
    "List {n} {things}.",
    "Name {n} {things} and say one thing about each.",
    "What are the pros and cons of {topic}?",
    "Why is {topic} important?",
    "How does {topic} work?",
    "Summarize the history of {topic} in a few sentences.",
    "Give me some tips for {activity}.",
    "What are {n} common mistakes people make when {activity}?",
    "Write a step-by-step plan for {activity}.",
    "Compare {topic} and {topic2}.",
    "What do {topic} and {topic2} have in common?",
    "Write a {lang} function that {code}.",
    "Explain what this task means and how to solve it in {lang}: a function that {code}.",
    "Rewrite this sentence in a more formal style: {sentence}",
    "Summarize this sentence in five words: {sentence}",
    "Translate this sentence into simple English: {sentence}",
    "Write a title for a blog post about {topic}.",
    "Ask me {n} quiz questions about {topic}.",
    "Describe {topic} using only simple words.",
    "Write a friendly email inviting a colleague to a talk about {topic}.",
    "What would happen if {topic} did not exist?",
    "Give a one-paragraph introduction to {topic}.",
    "Tell me a fun story that involves {topic}.",
    "How can I explain {topic} to {audience}?",
    "What questions should I ask to learn more about {topic}?",
)


def _fill(rng: random.Random, template: str) -> str:
    topic, topic2 = rng.sample(TOPICS, 2)
    return template.format(
        topic=topic, topic2=topic2, audience=rng.choice(AUDIENCES), n=rng.randint(2, 5),
        form=rng.choice(FORMS), things=rng.choice(THINGS), activity=rng.choice(ACTIVITIES),
        lang=rng.choice(LANGS), code=rng.choice(CODE_TASKS), sentence=rng.choice(SENTENCES),
    )


def split_of_text(text: str, heldout_per_mille: int = 150) -> str:
    """A prompt's split: a fixed function of its text."""
    digest = hashlib.sha256(text.encode()).hexdigest()
    return "heldout" if int(digest[:8], 16) % 1000 < heldout_per_mille else "train"


def general_prompts(n: int, split: str = "train", seed: int = 0) -> list[str]:
    """``n`` distinct general instructions from ``split`` ("train" or "heldout")."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    rng = random.Random(seed)
    out: list[str] = []
    seen: set[str] = set()
    for _ in range(200 * n + 1000):
        if len(out) == n:
            return out
        text = _fill(rng, rng.choice(TEMPLATES))
        if text not in seen and split_of_text(text) == split:
            seen.add(text)
            out.append(text)
    raise ValueError(f"could not draw {n} distinct {split} prompts (asked for too many)")


def heldout_prompts(n_arithmetic: int, difficulties: tuple[int, ...], seed: int,
                    n_general: int = 0) -> tuple[list[str], list[str]]:
    """The held-out prompt set: ``n_arithmetic`` held-out problems from ``trainers.tasks``
    spread evenly over ``difficulties``, then ``n_general`` held-out general instructions
    (both seeded by ``seed``). Returns (texts, kinds), kinds "arithmetic" | "general"."""
    per = -(-n_arithmetic // len(difficulties))
    arith = [p.prompt for lv in difficulties for p in make_problems(per, lv, "heldout", seed)][:n_arithmetic]
    general = general_prompts(n_general, "heldout", seed)
    return arith + general, ["arithmetic"] * len(arith) + ["general"] * len(general)


def benchmark_prompts(tok, n: int, seed: int) -> list[list[int]]:
    """The benchmarks' prompts: n held-out arithmetic problems (difficulties 1-3, seeded by
    ``seed + 1000``) through the chat template, as token ids."""
    texts, _ = heldout_prompts(n, (1, 2, 3), seed + 1000)
    return [chat_ids(tok, t) for t in texts]
