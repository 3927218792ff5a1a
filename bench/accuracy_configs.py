"""What an accuracy run runs: the methods and verifiers, and the configurations (method, verifier, N) made
of the command line's grid, its `--configs` and the baselines (bench.accuracy)."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("greedy", "majority", "best_of_n", "beam", "dvts", "particle_filtering", "deepconf")
VERIFIED = ("best_of_n", "beam", "dvts", "particle_filtering")
UNVERIFIED = ("majority", "deepconf")  # N samples that vote, with no verifier
VERIFIERS = ("judge", "confidence", "calculator")  # the verifiers that run on the generator itself


@dataclass(frozen=True)
class Config:
    """One line of the results: a method, its verifier (None when it has none) and N."""

    method: str
    verifier: str | None
    n: int

    @property
    def label(self) -> str:
        return f"{self.method}:{self.verifier}" if self.verifier else self.method


def plan(methods: list[str], verifiers: list[str], ns: list[int],
         known_verifiers: tuple[str, ...] = VERIFIERS) -> list[Config]:
    """Every configuration to run, in order; a ValueError names the first bad input."""
    for method in methods:
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; expected one of {', '.join(METHODS)}")
    for verifier in verifiers:
        if verifier not in known_verifiers:
            raise ValueError(f"unknown verifier {verifier!r}; expected one of {', '.join(known_verifiers)}")
    for n in ns:
        if n < 1:
            raise ValueError(f"N must be at least 1, got {n}")
    configs = []
    for method in methods:
        if method == "greedy":
            configs.append(Config("greedy", None, 1))
        elif method in UNVERIFIED:
            configs += [Config(method, None, n) for n in ns]
        else:
            configs += [Config(method, verifier, n) for verifier in verifiers for n in ns]
    return configs


def parse_configs(text: str, known_verifiers: tuple[str, ...] = VERIFIERS) -> list[Config]:
    """`method[:verifier]@N,...` (e.g. `beam:calculator@8,majority@8`) as configurations; a ValueError names
    the first bad one."""
    configs = []
    for item in names(text):
        label, at, n = item.partition("@")
        method, _, verifier = label.partition(":")
        if not at or not n.strip().isdigit():
            raise ValueError(f"--configs takes method[:verifier]@N, got {item!r}")
        if bool(verifier) != (method in VERIFIED):
            raise ValueError(f"{item!r}: {', '.join(VERIFIED)} take a verifier, greedy, majority and deepconf none")
        configs += [c for c in plan([method], [verifier] if verifier else [], [int(n)], known_verifiers)
                    if c.n == int(n)]
    return configs


def with_baselines(configs: list[Config]) -> list[Config]:
    """`configs` with greedy and majority voting at every N the others use, the baselines first."""
    ns = sorted({c.n for c in configs if c.method != "greedy"})
    baselines = [Config("greedy", None, 1)] + [Config("majority", None, n) for n in ns]
    return baselines + [c for c in configs if c not in baselines]


def names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]
