"""What the statistical tests share: the tiny 6-token target they sample, the exact law of its continuations, batched
sampling with one generator per row, and one chi-square goodness-of-fit test (with its pooling of small cells).

A sample is a row of one batch of identical prompts; each row draws from its own generator, so the rows are
independent samples (a batch's rows equal each row alone: test_batch.py).
"""

from __future__ import annotations

from collections import Counter

import torch
from helpers import make_target
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from dflash_hf import speculative_decode

SAMPLING_VOCAB = 6  # the sampled target's vocabulary; its last id is the drafts' mask token
NUM_NEW = 3  # new tokens per sample: 6 ** 3 cells
NUM_SAMPLES = 1000


def sampling_target() -> tuple[torch.nn.Module, torch.Tensor]:
    """The 6-token Llama every chi-square test samples (weights spread enough for every cell to matter), and its
    prompt [1, 4]."""
    return make_target("llama", seed=11, vocab_size=SAMPLING_VOCAB, init_std=0.4), torch.tensor([[1, 4, 2, 5]])


def warpers(temperature: float, top_k: int | None, top_p: float | None) -> LogitsProcessorList:
    """Transformers' own temperature, top-k and top-p warpers: the reference the loop's processing must match."""
    chain = [TemperatureLogitsWarper(temperature)]
    if top_k is not None:
        chain.append(TopKLogitsWarper(top_k))
    if top_p is not None:
        chain.append(TopPLogitsWarper(top_p))
    return LogitsProcessorList(chain)


def exact_joint(target: torch.nn.Module, input_ids: torch.Tensor, temperature: float, top_k: int | None,
                top_p: float | None, num_new: int = NUM_NEW) -> dict[tuple[int, ...], float]:
    """P(x1 .. x_num_new) under plain sampling from the target with Transformers' own warpers."""
    return processed_joint(target, input_ids, warpers(temperature, top_k, top_p), num_new)


@torch.no_grad()
def processed_joint(target: torch.nn.Module, input_ids: torch.Tensor, process: LogitsProcessorList,
                    num_new: int = NUM_NEW) -> dict[tuple[int, ...], float]:
    """P(x1 .. x_num_new) under plain sampling from the target's logits processed by `process` (Transformers' own
    processors and warpers, each prefix as the processors' input_ids)."""
    device = input_ids.device
    probabilities = {(): 1.0}
    vocabulary = target.get_output_embeddings().weight.shape[0]
    for _ in range(num_new):
        prefixes = list(probabilities)
        continued = torch.tensor([list(prefix) for prefix in prefixes], dtype=torch.long, device=device)
        batch = torch.cat((input_ids.repeat(len(prefixes), 1), continued.reshape(len(prefixes), -1)), dim=1)
        next_probabilities = process(batch, target(batch).logits[:, -1].float()).softmax(-1).tolist()
        probabilities = {prefix + (token,): probabilities[prefix] * next_probabilities[row][token]
                         for row, prefix in enumerate(prefixes) for token in range(vocabulary)}
    return probabilities


@torch.no_grad()
def sampled_counts(target: torch.nn.Module, proposer, input_ids: torch.Tensor, generator: torch.Generator,
                   num_samples: int = NUM_SAMPLES, **decode_arguments) -> tuple[dict[tuple[int, ...], int], int]:
    """`num_samples` continuations of `input_ids` [1, T] by one `speculative_decode` call over as many identical rows,
    each with its own generator (seeded from `generator`): how often each continuation came out, and the drafted
    tokens accepted in all of them."""
    seeds = torch.randint(0, 2**62, (num_samples,), generator=generator).tolist()
    generators = [torch.Generator(device=input_ids.device).manual_seed(seed) for seed in seeds]
    result = speculative_decode(target, proposer, input_ids.repeat(num_samples, 1), generator=generators,
                                **decode_arguments)
    counts = Counter(tuple(result.new_tokens(row)) for row in range(num_samples))
    accepted = sum(length - 1 for lengths in result.acceptance_lengths for length in lengths)
    return dict(counts), accepted


def chi_square_p_value(counts: dict, expected: dict, num_samples: int) -> float:
    """Chi-square goodness of fit of `counts` (cell -> count) to `expected` (cell -> probability); cells with an
    expected count below 5 are pooled; p from torch's gammaincc."""
    observed_cells, expected_cells, pooled_observed, pooled_expected = [], [], 0, 0.0
    for cell, probability in expected.items():
        if probability * num_samples >= 5:
            observed_cells.append(counts.get(cell, 0))
            expected_cells.append(probability * num_samples)
        else:
            pooled_observed += counts.get(cell, 0)
            pooled_expected += probability * num_samples
    if pooled_expected > 0:
        observed_cells.append(pooled_observed)
        expected_cells.append(pooled_expected)
    elif pooled_observed > 0:
        return 0.0  # a sequence of probability zero was sampled
    scale = num_samples / sum(expected_cells)
    statistic = sum((o - e * scale) ** 2 / (e * scale) for o, e in zip(observed_cells, expected_cells))
    degrees = len(observed_cells) - 1
    return float(torch.special.gammaincc(torch.tensor(degrees / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def assert_follows(counts: dict, expected: dict, wrong: dict, num_samples: int = NUM_SAMPLES) -> None:
    """The counts fit `expected` (p > 1e-3), and the same statistic rejects the nearby `wrong` law (its power)."""
    p_value, p_value_wrong = (chi_square_p_value(counts, law, num_samples) for law in (expected, wrong))
    print("p", p_value, "p_wrong", p_value_wrong)
    assert p_value > 1e-3
    assert p_value_wrong < 1e-3
