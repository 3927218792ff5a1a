"""Where a graph-replayed decode step's time goes: the host's part and the device's.

A replayed step is three things in a row: the host writes the step's token ids, positions, slots and
block tables into the static buffers (`DecodeGraphs._fill`), the device replays the graph, and the
host reads the next tokens back (argmax, `.tolist()`, which waits for the device). `split(runner,
steps)` times each over `steps` one-stream greedy steps: the fill with the host's clock, the replay
with CUDA events around it (on a CPU, where the static step runs eagerly, with the host's clock), and
the whole step with the host's clock, so `other_us` (step - fill - replay) is what neither covers:
launch latency, the copy back and the Python between them. The decode-only figures that the kernel
profile cannot give (its eager steps include the prompt's step and have no graph).
"""

from __future__ import annotations

import time

import torch

from bench.gpu_models import sync


def split(runner, steps: int, prompt_tokens: int = 64, seed: int = 0) -> dict:
    """Mean microseconds a step of one greedy stream spends filling, replaying, and in all."""
    from scheduler.scheduler import ScheduledSequence
    from scheduler.sequence import Sequence

    graphs = runner.graphs
    if graphs is None:
        raise ValueError("the runner has no decode graphs (ModelRunner.use_graphs)")
    cuda = graphs.capture
    fills, replays = [], []
    fill, replay_of = graphs._fill, dict(graphs.graphs)

    def timed_fill(scheduled, size):
        start = time.perf_counter()
        fill(scheduled, size)
        fills.append(time.perf_counter() - start)

    class TimedGraph:  # the size's graph, its replay bracketed by events
        def __init__(self, graph) -> None:
            self.graph = graph

        def replay(self) -> None:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            self.graph.replay()
            end.record()
            replays.append((begin, end))

    step_eagerly = graphs._step

    def timed_step(size):
        start = time.perf_counter()
        logits = step_eagerly(size)
        replays.append(time.perf_counter() - start)
        return logits

    seq = Sequence(torch.randint(3, runner.model.config.vocab_size, (prompt_tokens,),
                                 generator=torch.Generator().manual_seed(seed)).tolist())
    seq.block_table = list(range(-(-(prompt_tokens + steps + 2) // runner.block_size)))
    logits = runner.execute([ScheduledSequence(seq, prompt_tokens)], [], [0])
    graphs._fill = timed_fill
    if cuda:
        graphs.graphs = {size: TimedGraph(graph) for size, graph in replay_of.items()}
    else:
        graphs._step = timed_step
    walls = []
    try:
        for step in range(steps + 1):
            start = time.perf_counter()
            token = logits.argmax(-1).tolist()[0]
            seq.num_computed_tokens = len(seq.token_ids)
            seq.token_ids.append(token)
            logits = runner.execute([ScheduledSequence(seq, 1)], [], [0])
            if step:  # (the first: the prompt's logits read back; not a replayed step's)
                walls.append(time.perf_counter() - start)
        logits.argmax(-1).tolist()
        sync(runner.device)
    finally:
        del graphs._fill
        graphs.graphs = replay_of
        if not cuda:
            del graphs._step
    fills, replays = fills[1:], replays[1:]  # (as the walls: from the second step on)
    device_s = [b.elapsed_time(e) / 1e3 for b, e in replays] if cuda else replays
    mean = lambda xs: 1e6 * sum(xs) / len(xs)  # noqa: E731
    step_us, fill_us, replay_us = mean(walls), mean(fills), mean(device_s)
    return {"steps": len(walls), "step_us": round(step_us, 1), "fill_us": round(fill_us, 1),
            "replay_us": round(replay_us, 1), "other_us": round(step_us - fill_us - replay_us, 1),
            "replay_clock": "cuda events" if cuda else "host (the static step run eagerly)"}
