import pytest
import torch

from runtime.wire.params import SamplingParams
from runtime.model.sampler import SamplingState, sample


def state(seed=0, **params):
    return SamplingState(SamplingParams(**params), seed, torch.device("cpu"))


def test_greedy_rows_take_the_argmax_and_sampled_rows_follow_their_own_generator():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    histories = [([], [])] * 3
    batch = sample(logits, [state(1, temperature=0.0), state(7, temperature=0.9), state(8, temperature=1.3)],
                   histories)
    assert batch[0].token_id == int(torch.argmax(logits[0]))
    # The same rows alone, or in another order, give the same tokens.
    alone = sample(logits[1:2], [state(7, temperature=0.9)], histories[:1])[0].token_id
    flipped = sample(logits[[2, 1]], [state(8, temperature=1.3), state(7, temperature=0.9)], histories[:2])
    assert batch[1].token_id == alone == flipped[1].token_id and batch[2].token_id == flipped[0].token_id


def test_sampling_follows_the_distribution_and_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 1e-9]]))
    counts = torch.zeros(4)
    s = state(3, temperature=1.0)
    for _ in range(4000):
        counts[sample(logits, [s], [([], [])])[0].token_id] += 1
    assert torch.allclose(counts / 4000, torch.tensor([0.5, 0.3, 0.2, 0.0]), atol=0.03)
    top1 = state(4, temperature=1.0, top_k=1)
    assert {sample(logits, [top1], [([], [])])[0].token_id for _ in range(50)} == {0}
    nucleus = state(5, temperature=1.0, top_p=0.6)
    assert {sample(logits, [nucleus], [([], [])])[0].token_id for _ in range(200)} == {0, 1}


def test_penalties_and_logprobs():
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    out = sample(logits, [state(0, temperature=0.0, presence_penalty=1.0, logprobs=True, top_logprobs=2)],
                 [([5], [0])])[0]
    assert out.token_id == 1  # token 0 was already generated: penalised below token 1
    assert out.logprob == torch.log_softmax(logits[0], -1)[1].item()  # from the model's distribution
    assert [t for t, _ in out.top] == [0, 1]


def _outputs(logits):
    states = [state(7, temperature=0.9, logprobs=True, top_logprobs=3), state(9, temperature=1.1, top_k=5),
              state(2, temperature=0.0, logprobs=True, top_logprobs=1)]
    return [(o.token_id, o.logprob, o.top) for o in sample(logits, states, [([], [])] * 3)]


def test_draws_are_made_on_the_generators_device_not_the_default_one():
    # Under another default device, a factory call without device= (e.g. a draw from a CUDA
    # generator made on the default CPU device) fails or lands elsewhere; the sampler's do not.
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    expected = _outputs(logits)
    with torch.device("meta"):
        assert _outputs(logits) == expected
    gen = torch.Generator().manual_seed(11)
    with torch.device("meta"):
        draw = torch.rand((), generator=gen, device=gen.device)
    assert draw.device == gen.device and draw.item() == torch.rand((), generator=torch.Generator().manual_seed(11)).item()


def test_logprobs_and_top_logprobs_of_every_row_come_from_the_rows_own_distribution():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4))
    out = _outputs(logits)
    raw = torch.log_softmax(logits, dim=-1)
    for row, top_n in ((0, 3), (2, 1)):
        token, logprob, top = out[row]
        assert logprob == raw[row, token].item()
        values, ids = torch.topk(raw[row], top_n)
        assert top == [(int(i), v.item()) for i, v in zip(ids, values)]
    assert out[1][1] is None and out[1][2] is None and out[2][0] == int(torch.argmax(logits[2]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sampling_on_cuda_draws_from_cuda_generators():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2)).cuda()
    states = [SamplingState(SamplingParams(temperature=0.9, logprobs=True, top_logprobs=2), seed, torch.device("cuda"))
              for seed in (1, 2, 3)]
    again = [SamplingState(SamplingParams(temperature=0.9, logprobs=True, top_logprobs=2), seed, torch.device("cuda"))
             for seed in (1, 2, 3)]
    first = sample(logits, states, [([], [])] * 3)
    assert [o.token_id for o in first] == [o.token_id for o in sample(logits, again, [([], [])] * 3)]
    assert all(0 <= o.token_id < 50 and len(o.top) == 2 for o in first)
