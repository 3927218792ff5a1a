import torch

from runtime.protocol import SamplingParams
from runtime.sampler import SamplingState, sample


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
