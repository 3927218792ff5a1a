"""The accuracy benchmark's report: its table (with the paired comparisons), its plot, and a pilot's advice."""

from __future__ import annotations

from pathlib import Path

from bench import paired


def table(results: dict) -> str:
    levels = results["levels"]
    source = results.get("dataset") or "generated"
    rows = [f"accuracy benchmark: {results['model']}, {results['problems']} problems ({source}; levels "
            f"{','.join(map(str, levels)) or 'none'}, seed {results['seed']}), max_tokens {results['max_tokens']}, "
            f"steps <= {results['max_steps']} x {results['max_step_tokens']} tokens, temperature "
            f"{results['temperature']}, {results['threads']} threads",
            f"{'method':<22} {'N':>3} {'accuracy':>9} {'95% CI':>13} {'unparsed':>9} "
            + " ".join(f"{'L' + str(level):>5}" for level in levels)
            + f" {'gen tok':>8} {'anchor tok':>10} {'by anchor':>9} {'verif tok':>10} {'seconds':>8} {'tok/s':>7}"]
    for r in results["results"]:
        low, high = r["ci95"]
        rows.append(f"{r['label']:<22} {r['n']:>3} {r['accuracy']:>9.3f} {f'{low:.2f}-{high:.2f}':>13} "
                    f"{r['unparsed']:>9} " + " ".join(f"{r['by_level'][str(level)]:>5.2f}" for level in levels)
                    + f" {r['tokens_generated']:>8.1f} {r.get('anchor_tokens', 0.0):>10.1f} "
                    f"{r.get('answered_by_anchor', 0):>9} {r['verifier_tokens']:>10.1f} {r['seconds']:>8.1f} "
                    f"{r['tok_s']:>7.1f}")
    rows.append("tokens are per problem (generator sampled, of them the greedy anchor's, verifier prefilled); by "
                "anchor: problems answered with greedy's text because no candidate outranked it; seconds for the "
                "whole set")
    rows += paired.comparison_lines(results["comparisons"], results["alpha"])
    return "\n".join(rows)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    labels = list(dict.fromkeys(r["label"] for r in results["results"]))
    # `*`: significantly different (exact McNemar) from majority voting at the nearest tokens
    marked = {(c["label"], c["n"]) for c in results["comparisons"]
              if c.get("vs_majority", {}).get("p_value", 1.0) < results["alpha"]}
    for label in labels:
        rows = sorted((r for r in results["results"] if r["label"] == label), key=lambda r: r["n"])
        xs = [max(r["tokens_generated"], 1.0) for r in rows]
        ys = [r["accuracy"] for r in rows]
        errors = [[r["accuracy"] - r["ci95"][0] for r in rows], [r["ci95"][1] - r["accuracy"] for r in rows]]
        line = ax.errorbar(xs, ys, yerr=errors, marker="o", capsize=3, label=label, alpha=0.85)
        for x, y, r in zip(xs, ys, rows):
            star = "*" if (label, r["n"]) in marked else ""
            ax.annotate(f"N={r['n']}{star}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7,
                        color=line[0].get_color())
    ax.set_xscale("log")
    ax.set_xlabel("generated tokens per problem (generator)")
    ax.set_ylabel("accuracy (95% Wilson interval)")
    ax.set_ylim(0, 1)
    ax.set_title(f"{results['model']}: {results['problems']} problems, seed {results['seed']} "
                 f"(*: differs from majority at equal tokens, p < {results['alpha']})", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def pilot_lines(path: str, advice: dict) -> list[str]:
    """`paired.pilot_advice` as text: the levels to run and each method's discordance with greedy."""
    band = ",".join(map(str, advice["levels_in_band"])) or "none"
    low, high = advice["band"]
    lines = [f"pilot {path}: greedy accuracy by level {advice['greedy_by_level']}; levels where greedy is right "
             f"on {100 * low:.0f}-{100 * high:.0f} %: {band}"
             + (f" (run with --levels {band})" if advice["levels_in_band"] else "")]
    for row in advice["rows"]:
        needed = row["problems_needed"] or "- (discordance at or below the difference)"
        lines.append(f"  {row['label']} N={row['n']}: discordance with greedy {100 * row['discordance']:.0f} %, "
                     f"problems needed {needed}")
    return lines
