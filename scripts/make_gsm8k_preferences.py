#!/usr/bin/env python3
"""GSM8K preference pairs for configs/smollm2_gsm8k_dpo.yaml: {question, chosen, rejected} per line.

chosen is GSM8K's reference solution as it is; rejected is the same solution with the final
"#### N" and the last N in the reasoning (with its calculator annotation "<<...=N>>") replaced by
a wrong number, so the pair differs only in the answer. The wrong number is drawn from a random
generator seeded by --seed and the line number: the same input gives the same file. Standard
library only; scripts/setup.sh runs it once (so `make setup` makes data/gsm8k_preferences.jsonl).
Run from the repository root:

    python3 scripts/make_gsm8k_preferences.py
    python3 scripts/make_gsm8k_preferences.py --input ../shared/data/gsm8k/train.jsonl \
        --output data/gsm8k_preferences.jsonl --seed 0 --limit 1000
"""
import argparse
import json
import os
import random
import re
import sys

# A number as GSM8K writes it: optional minus, digits with optional thousands commas, optional decimals.
NUMBER = r"-?\d[\d,]*(?:\.\d+)?"
FINAL = re.compile(r"####\s*(" + NUMBER + r")\s*$")


def parse(text):
    value = float(text.replace(",", ""))
    return int(value) if value.is_integer() and "." not in text else value


def render(value, like):
    """`value` written in the style of `like`: thousands commas and decimals kept as they were."""
    decimals = len(like.split(".")[1]) if "." in like else 0
    return f"{value:,.{decimals}f}" if "," in like else f"{value:.{decimals}f}"


def wrong_number(value, rng):
    """A plausible wrong answer: off by a little, by ten, or by a factor of two; never the answer
    itself, and never negative when the answer is not."""
    candidates = [value + d for d in (-10, -3, -2, -1, 1, 2, 3, 10)] + [value * 2]
    if isinstance(value, int) and value % 2 == 0 and value != 0:
        candidates.append(value // 2)
    candidates = [c for c in candidates if c != value and (value < 0 or c >= 0)]
    return rng.choice(candidates)


def last_occurrence(reasoning, final_text):
    """(start, end) of the last standalone occurrence of the final answer in the reasoning, as
    written after #### or without its commas; None when the reasoning never states it."""
    forms = {final_text, final_text.replace(",", "")}
    best = None
    for form in forms:
        # Not part of a longer number: no digit (or digit-and-point) on either side.
        pattern = re.compile(r"(?<![\d.,])" + re.escape(form) + r"(?![\d]|[.,]\d)")
        for m in pattern.finditer(reasoning):
            if best is None or m.start() > best[0]:
                best = (m.start(), m.end())
    return best


def make_rejected(answer, rng):
    """The solution with a wrong final answer, or None when it has no "#### N" line."""
    m = FINAL.search(answer)
    if not m:
        return None
    final_text = m.group(1)
    wrong = wrong_number(parse(final_text), rng)
    reasoning, tail = answer[: m.start()], answer[m.start():]
    at = last_occurrence(reasoning, final_text)
    if at:
        start, end = at
        stated = reasoning[start:end]  # as the reasoning writes it: with or without commas
        replacement = render(wrong, stated)
        # GSM8K's calculator annotation right before the number ("<<48+24=72>>72") says it too,
        # always without commas.
        plain = stated.replace(",", "")
        annotation = re.search(r"=" + re.escape(plain) + r">>$", reasoning[:start])
        if annotation:
            start = annotation.start()
            replacement = "=" + render(wrong, plain) + ">>" + replacement
        reasoning = reasoning[:start] + replacement + reasoning[end:]
    return reasoning + tail[: m.start(1) - m.start()] + render(wrong, final_text) + tail[m.end(1) - m.start():]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", default="../shared/data/gsm8k/train.jsonl", help="GSM8K JSONL (question, answer)")
    p.add_argument("--output", default="data/gsm8k_preferences.jsonl", help="the preference JSONL to write")
    p.add_argument("--seed", type=int, default=0, help="seeds the wrong numbers")
    p.add_argument("--limit", type=int, default=0, help="use the first N records (0: all)")
    a = p.parse_args()

    written = skipped = 0
    os.makedirs(os.path.dirname(a.output) or ".", exist_ok=True)
    with open(a.input, encoding="utf-8") as src, open(a.output, "w", encoding="utf-8") as out:
        for line_no, line in enumerate(src, 1):
            if a.limit and written >= a.limit:
                break
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                question, answer = record["question"], record["answer"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                sys.exit(f"{a.input}:{line_no}: expected a JSON object with question and answer ({e})")
            rng = random.Random(a.seed * 1_000_003 + line_no)
            rejected = make_rejected(answer, rng)
            if rejected is None:
                skipped += 1
                print(f"{a.input}:{line_no}: no '#### N' final answer; skipped", file=sys.stderr)
                continue
            out.write(json.dumps({"question": question, "chosen": answer, "rejected": rejected}) + "\n")
            written += 1
    print(f"wrote {written} pairs to {a.output}" + (f" ({skipped} skipped)" if skipped else ""))


if __name__ == "__main__":
    main()
