#!/usr/bin/env python3
"""Arithmetic word problems for configs/demo.yaml, in GSM8K's layout: {question, answer} per line.

Each answer ends with "#### N" as in GSM8K, so the math_answer reward and `troupe eval gsm8k` read
these files unchanged. Problems are drawn from a random generator seeded by --seed; the same
arguments give the same files. The test split is fixed: its problems are drawn first, and no
train question repeats a test question. Difficulty levels (--level):

  1  one step: a + b or a - b, numbers up to 20 ("Tom has 7 apples and buys 5 more. ...")
  2  two steps: a + b - c or a - b + c, numbers up to 20
  3  one step: a * b with a, b in 2..9 ("4 boxes hold 6 pens each. ...")
  4  two steps: a * b + c or a * b - c
  mix  levels 1-4 in equal parts

Standard library only; scripts/setup.sh runs it once (so `make setup` makes data/arithmetic_*.jsonl).
Run from the repository root:

    python3 scripts/make_arithmetic_words.py
    python3 scripts/make_arithmetic_words.py --level 2 --train 4000 --test 200 --seed 0 --out data
"""
import argparse
import json
import os
import random

NAMES = ["Tom", "Anna", "Ben", "Lily", "Sam", "Mia", "Jack", "Emma", "Leo", "Zoe", "Max", "Ella"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "stamps", "shells", "cards", "coins"]
BOXES = ["boxes", "bags", "jars", "baskets", "packs", "shelves"]


def level1(r):
    name, item = r.choice(NAMES), r.choice(ITEMS)
    a = r.randint(2, 20)
    if r.random() < 0.5:
        b = r.randint(1, 20)
        q = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"
        return q, f"{name} has {a} + {b} = {a + b} {item}.", a + b
    b = r.randint(1, a - 1)
    q = f"{name} has {a} {item} and gives {b} to a friend. How many {item} does {name} have left?"
    return q, f"{name} has {a} - {b} = {a - b} {item} left.", a - b


def level2(r):
    name, item = r.choice(NAMES), r.choice(ITEMS)
    a = r.randint(5, 20)
    if r.random() < 0.5:
        b = r.randint(1, 20)
        c = r.randint(1, a + b - 1)
        q = (f"{name} has {a} {item}, buys {b} more, then gives {c} away. "
             f"How many {item} does {name} have now?")
        return q, f"After buying: {a} + {b} = {a + b}. After giving away: {a + b} - {c} = {a + b - c}.", a + b - c
    b = r.randint(1, a - 1)
    c = r.randint(1, 20)
    q = (f"{name} has {a} {item}, loses {b}, then finds {c} more. "
         f"How many {item} does {name} have now?")
    return q, f"After losing: {a} - {b} = {a - b}. After finding: {a - b} + {c} = {a - b + c}.", a - b + c


def level3(r):
    name, item, box = r.choice(NAMES), r.choice(ITEMS), r.choice(BOXES)
    a, b = r.randint(2, 9), r.randint(2, 9)
    q = f"{name} has {a} {box} with {b} {item} in each. How many {item} does {name} have in all?"
    return q, f"{a} * {b} = {a * b} {item}.", a * b


def level4(r):
    name, item, box = r.choice(NAMES), r.choice(ITEMS), r.choice(BOXES)
    a, b = r.randint(2, 9), r.randint(2, 9)
    if r.random() < 0.5:
        c = r.randint(1, 20)
        q = (f"{name} has {a} {box} with {b} {item} in each, and {c} more {item} loose. "
             f"How many {item} does {name} have in all?")
        return q, f"In the {box}: {a} * {b} = {a * b}. In all: {a * b} + {c} = {a * b + c}.", a * b + c
    c = r.randint(1, a * b - 1)
    q = (f"{name} has {a} {box} with {b} {item} in each, and gives {c} {item} away. "
         f"How many {item} does {name} have left?")
    return q, f"In the {box}: {a} * {b} = {a * b}. Left: {a * b} - {c} = {a * b - c}.", a * b - c


LEVELS = {"1": [level1], "2": [level2], "3": [level3], "4": [level4], "mix": [level1, level2, level3, level4]}


def draw(r, makers, count, taken):
    rows = []
    while len(rows) < count:
        q, steps, n = r.choice(makers)(r)
        if q in taken:
            continue
        taken.add(q)
        rows.append({"question": q, "answer": f"{steps}\n#### {n}"})
    return rows


def write(path, rows):
    with open(path + ".part", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(path + ".part", path)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--level", default="2", choices=sorted(LEVELS))
    p.add_argument("--train", type=int, default=4000, help="train problems")
    p.add_argument("--test", type=int, default=200, help="held-out test problems (drawn first, never in train)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="data", help="folder for arithmetic_train.jsonl and arithmetic_test.jsonl")
    p.add_argument("--prefix", default="arithmetic", help="file name prefix")
    a = p.parse_args()
    r = random.Random(a.seed)
    makers, taken = LEVELS[a.level], set()
    test = draw(r, makers, a.test, taken)
    train = draw(r, makers, a.train, taken)
    os.makedirs(a.out, exist_ok=True)
    write(os.path.join(a.out, f"{a.prefix}_test.jsonl"), test)
    write(os.path.join(a.out, f"{a.prefix}_train.jsonl"), train)
    print(f"{a.prefix}: level {a.level}, {len(train)} train + {len(test)} test problems in {a.out}/")


if __name__ == "__main__":
    main()
