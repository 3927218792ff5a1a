"""What a search's decode steps are, device-independent: the model steps the engine ran, and the
search's longest path, which bounds them from below (a step lasts as long as its longest path)."""

from __future__ import annotations

import time


class StepLog:
    """Wraps the engine's runner: the shape and seconds of every model step it executes."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.execute = runner.execute
        self.decode: list[tuple[int, float]] = []  # (rows, seconds) of steps whose rows are one token each
        self.decode_context: list[int] = []  # per decode step, the tokens its rows attend to, all rows
        self.prefill: list[tuple[int, float]] = []  # (tokens, seconds) of the other steps
        runner.execute = self

    def __call__(self, scheduled, copies, sampled, *rest):
        started = time.perf_counter()
        logits = self.execute(scheduled, copies, sampled, *rest)
        seconds = time.perf_counter() - started
        tokens = sum(entry.num_new_tokens for entry in scheduled)
        if tokens == len(scheduled):
            self.decode.append((len(scheduled), seconds))
            self.decode_context.append(sum(entry.seq.num_computed_tokens + 1 for entry in scheduled))
        else:
            self.prefill.append((tokens, seconds))
        return logits

    def summary(self) -> dict:
        decode_rows = sum(rows for rows, _ in self.decode)
        return {"decode_steps": len(self.decode), "decode_rows": decode_rows,
                "decode_mean_batch": round(decode_rows / len(self.decode), 2) if self.decode else 0.0,
                "decode_seconds": round(sum(s for _, s in self.decode), 2),
                "prefill_steps": len(self.prefill), "prefill_tokens": sum(t for t, _ in self.prefill),
                "prefill_seconds": round(sum(s for _, s in self.prefill), 2)}


def gpu_decode_seconds(log: StepLog, cost, peaks) -> float:
    """A MODEL, not a measurement: the decode steps `log` recorded priced by the roofline
    (scheduler.roofline) for the model `cost` on the device `peaks`: each step reads the weights once
    and its rows' KV, so its rows cost little beside the weights until the batch is compute-bound."""
    return sum(cost.decode_latency(peaks, rows, context // rows)
               for (rows, _), context in zip(log.decode, log.decode_context))


class LongestPath:
    """The most tokens any path the search ended with holds (every candidate, returned or not)."""

    def __init__(self, engine) -> None:
        self.tokens = 0
        self.engine_finished = engine.search_finished
        engine.search_finished = self.search_finished

    def search_finished(self, controller) -> None:
        prompt = len(controller.prompt_ids)
        self.tokens = max([self.tokens] + [p.step_end - prompt for p in controller.final])
        self.engine_finished(controller)
