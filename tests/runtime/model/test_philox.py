import torch

from runtime.model.philox import philox4x32, uniforms
from runtime.model.sampler import SamplingState, sample
from runtime.wire.params import SamplingParams


def words(*values):
    return tuple(torch.tensor([v], dtype=torch.int64) for v in values)


def test_philox4x32_10_gives_random123_s_known_answers():
    # Random123's kat_vectors for philox4x32 with 10 rounds: (counter, key) -> output
    cases = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
             ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
             ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
              (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for counter, key, expected in cases:
        assert tuple(int(w) for w in philox4x32(words(*counter), words(*key))) == expected


def test_a_row_s_uniform_depends_on_its_seed_and_position_only():
    keys = torch.tensor([[5, 5, 2**62 + 3, 5], [0, 1, 0, 0]])
    u = uniforms(keys)
    assert u.dtype == torch.float32 and bool(((u >= 0) & (u < 1)).all())
    assert u[0] == u[3] and u[0] != u[1] and u[0] != u[2]
    assert torch.equal(uniforms(keys[:, 2:3]), u[2:3])  # alone: the same bits
    # The top 24 bits of the first word of Philox4x32-10 (counter (0, 0, 0, 0), key (5, 0)) over 2**24
    first = int(philox4x32(words(0, 0, 0, 0), words(5, 0))[0])
    assert float(u[0]) == (first >> 8) / 2**24


def test_keyed_sampling_rows_are_their_own_and_follow_the_distribution():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    states = [SamplingState(SamplingParams(temperature=t), seed, torch.device("cpu")) for seed, t in
              ((7, 0.9), (8, 1.3), (9, 0.0))]
    histories = [([1], [4, 5]), ([1], []), ([1], [3])]
    batch = [o.token_id for o in sample(logits, states, histories, keyed=True)]
    alone = sample(logits[1:2], states[1:2], histories[1:2], keyed=True)[0].token_id
    assert batch[1] == alone and batch[2] == int(torch.argmax(logits[2]))
    # A draw is keyed, not taken from a generator: asking again gives the same token
    assert [o.token_id for o in sample(logits, states, histories, keyed=True)] == batch
    # Over many output positions, the draws follow the distribution
    probs = torch.tensor([[0.5, 0.3, 0.2, 1e-9]])
    s = SamplingState(SamplingParams(temperature=1.0), 3, torch.device("cpu"))
    counts = torch.zeros(4)
    for position in range(3000):
        counts[sample(probs.log(), [s], [([], [0] * position)], keyed=True)[0].token_id] += 1
    assert torch.allclose(counts / 3000, torch.tensor([0.5, 0.3, 0.2, 0.0]), atol=0.03)
