"""A math problem set made from a seed, with exact integer answers, in levels of difficulty.

    problem_set(seed=0, per_level=8) -> list[Problem]

The same seed always gives the same problems (one `random.Random(seed)` drives every choice). Levels:

1. one-digit addition or subtraction (`What is 7 + 5?`);
2. a two-digit number plus or minus a one-digit one, or one-digit times one-digit;
3. plain multi-digit arithmetic: two-digit plus or minus two-digit, two-digit times one-digit;
4. word problems in two steps (buy and give away, packs plus what one had, change from a bill);
5. word problems in three steps (packs, a gift and what one had; wages over two days less spending;
   rows of chairs, some taken away and some brought in);
6. word problems in one step, each operation alike often: more bought (+), some given away (-),
   boxes of equal size (x), a number shared equally (/, always exact);
7. word problems in two steps, each pairing two operations: boxes less a gift (x, -), two gifts shared
   equally (+, /), a share of what is left (-, /), what one had plus boxes (x, +).

Every answer is a non-negative integer, computed alongside the text that states it. A user's own set
(`bench.datasets`) gives Problems too, with the answer as the file writes it and a level when it has one.

    levels_in_band({"1": 0.9, "2": 0.45, ...}, low=0.2, high=0.7) -> [2, ...]

picks the levels whose greedy accuracy (a pilot run's `by_level`) lies in [low, high]: there a method and
greedy decoding disagree most often, so a paired comparison needs the fewest problems (`bench.paired`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

LEVELS = (1, 2, 3, 4, 5, 6, 7)
WORD_LEVELS = (4, 5, 6, 7)

NAMES = ("Ava", "Ben", "Chloe", "Dan", "Emma", "Finn", "Grace", "Hugo", "Iris", "Jack", "Kate", "Leo", "Mia",
         "Noah", "Olivia", "Sam")
ITEMS = ("apples", "pencils", "stickers", "marbles", "cookies", "books", "stamps", "shells")
CONTAINERS = ("boxes", "bags", "packs", "jars")


@dataclass(frozen=True)
class Problem:
    level: int | None  # None: a user's problem from a file without levels
    question: str
    answer: int | str  # an int here; a file's answer as written (LaTeX allowed) in bench.datasets

    @property
    def gold(self) -> str:
        return str(self.answer)


def problem_set(seed: int = 0, per_level: int = 8, levels: tuple[int, ...] = LEVELS) -> list[Problem]:
    """`per_level` problems of each level in `levels`, level by level, all drawn from `seed`."""
    unknown = [level for level in levels if level not in LEVELS]
    if unknown:
        raise ValueError(f"unknown level {unknown[0]}; levels are {', '.join(map(str, LEVELS))}")
    rng = random.Random(seed)
    return [_MAKERS[level](rng) for level in levels for _ in range(per_level)]


def select_levels(problems: list[Problem], levels: tuple[int, ...]) -> list[Problem]:
    """The problems of `levels`, in order; a ValueError when none is left."""
    chosen = [p for p in problems if p.level in levels]
    if not chosen:
        found = sorted({p.level for p in problems if p.level is not None})
        raise ValueError(f"no problem of level {', '.join(map(str, levels))}; the set has levels "
                         f"{', '.join(map(str, found)) or 'none'}")
    return chosen


def levels_in_band(accuracy_by_level: dict[str, float], low: float = 0.2, high: float = 0.7) -> list[int]:
    """The levels whose accuracy lies in [low, high], in order."""
    return sorted(int(level) for level, accuracy in accuracy_by_level.items() if low <= accuracy <= high)


def _plain(level: int, a: int, op: str, b: int) -> Problem:
    answer = {"+": a + b, "-": a - b, "*": a * b}[op]
    return Problem(level, f"What is {a} {op} {b}?", answer)


def _level_1(rng: random.Random) -> Problem:
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    if rng.random() < 0.5:
        return _plain(1, a, "+", b)
    return _plain(1, max(a, b) + 5, "-", min(a, b))


def _level_2(rng: random.Random) -> Problem:
    kind = rng.randrange(3)
    if kind == 2:
        return _plain(2, rng.randint(2, 9), "*", rng.randint(2, 9))
    a, b = rng.randint(11, 99), rng.randint(2, 9)
    return _plain(2, a, "+", b) if kind == 0 else _plain(2, a, "-", b)


def _level_3(rng: random.Random) -> Problem:
    kind = rng.randrange(3)
    if kind == 2:
        return _plain(3, rng.randint(11, 49), "*", rng.randint(3, 9))
    a, b = rng.randint(12, 99), rng.randint(12, 99)
    return _plain(3, a, "+", b) if kind == 0 else _plain(3, max(a, b), "-", min(a, b))


def _level_4(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randint(5, 20), rng.randint(2, 12)
        c = rng.randint(3, a + b - 1)
        return Problem(4, f"{name} has {a} {item}. {name} buys {b} more and then gives away {c}. "
                          f"How many {item} does {name} have now?", a + b - c)
    if kind == 1:
        a, b, c = rng.randint(2, 9), rng.randint(3, 12), rng.randint(1, 20)
        box = rng.choice(CONTAINERS)
        return Problem(4, f"{name} buys {a} {box} of {item} with {b} {item} in each. {name} already had {c} "
                          f"{item}. How many {item} does {name} have in total?", a * b + c)
    price, count = rng.randint(2, 9), rng.randint(2, 5)
    bill = rng.choice([bill for bill in (20, 50, 100) if bill > price * count])
    return Problem(4, f"A shop sells {item} for ${price} each. {name} buys {count} of them and pays with a "
                      f"${bill} bill. How much change does {name} get, in dollars?", bill - price * count)


def _level_5(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.randrange(3)
    if kind == 0:
        a, b, c = rng.randint(5, 30), rng.randint(2, 6), rng.randint(3, 10)
        d = rng.randint(2, a + b * c - 1)
        box = rng.choice(CONTAINERS)
        return Problem(5, f"{name} has {a} {item}. {name} buys {b} {box} with {c} {item} in each, then gives "
                          f"{d} {item} to a friend. How many {item} does {name} have now?", a + b * c - d)
    if kind == 1:
        wage, monday, tuesday = rng.randint(5, 15), rng.randint(2, 6), rng.randint(2, 6)
        spent = rng.randint(5, wage * (monday + tuesday) - 1)
        return Problem(5, f"{name} earns ${wage} per hour, works {monday} hours on Monday and {tuesday} hours "
                          f"on Tuesday, and then spends ${spent}. How many dollars does {name} have left?",
                       wage * (monday + tuesday) - spent)
    rows, per_row = rng.randint(3, 9), rng.randint(4, 12)
    removed, added = rng.randint(1, rows * per_row - 1), rng.randint(2, 15)
    return Problem(5, f"A hall has {rows} rows of {per_row} chairs. {removed} chairs are taken away and {added} "
                      f"more are brought in. How many chairs are in the hall now?", rows * per_row - removed + added)


def _level_6(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randint(3, 40), rng.randint(2, 30)
        return Problem(6, f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?", a + b)
    if kind == 1:
        a = rng.randint(8, 60)
        b = rng.randint(2, a - 1)
        return Problem(6, f"{name} has {a} {item} and gives away {b}. How many {item} does {name} have left?", a - b)
    if kind == 2:
        a, b = rng.randint(2, 9), rng.randint(2, 12)
        box = rng.choice(CONTAINERS)
        return Problem(6, f"{name} has {a} {box} with {b} {item} in each. How many {item} does {name} have?", a * b)
    friends, each = rng.randint(2, 9), rng.randint(2, 12)
    return Problem(6, f"{name} shares {friends * each} {item} equally among {friends} friends. How many {item} "
                      f"does each friend get?", each)


def _level_7(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    box = rng.choice(CONTAINERS)
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randint(2, 9), rng.randint(3, 12)
        c = rng.randint(1, a * b - 1)
        return Problem(7, f"{name} has {a} {box} with {b} {item} in each and gives away {c} {item}. How many "
                          f"{item} does {name} have left?", a * b - c)
    if kind == 1:
        friends, each = rng.randint(2, 6), rng.randint(3, 12)
        a = rng.randint(1, friends * each - 1)
        return Problem(7, f"{name} gets {a} {item} from one friend and {friends * each - a} {item} from another, "
                          f"then shares them equally among {friends} children. How many {item} does each child "
                          f"get?", each)
    if kind == 2:
        friends, each = rng.randint(2, 6), rng.randint(2, 10)
        gone = rng.randint(1, 20)
        return Problem(7, f"{name} has {friends * each + gone} {item}, loses {gone}, and shares the rest equally "
                          f"among {friends} friends. How many {item} does each friend get?", each)
    a, b, c = rng.randint(2, 30), rng.randint(2, 9), rng.randint(2, 12)
    return Problem(7, f"{name} has {a} {item} and buys {b} {box} with {c} {item} in each. How many {item} does "
                      f"{name} have now?", a + b * c)


_MAKERS = {1: _level_1, 2: _level_2, 3: _level_3, 4: _level_4, 5: _level_5, 6: _level_6, 7: _level_7}
