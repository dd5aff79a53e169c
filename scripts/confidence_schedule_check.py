"""The DSpark paper's Appendix A in this loop: confidence_threshold="auto" keeps the target's distribution at batch 1,
and the same schedule without its early stop (a search over every width) does not.

The draft (tests/test_deepspec_drafts.py, `scheduled_sampling_draft`) is built for it: after token 1 its confidence is
0.3, after token 4 it is 0.97, and its Markov head drafts 4 after 1 more often than the target samples it. On the
cost curve `SAMPLED_COSTS`, a row whose pending token is 1 verifies it alone under the early stop; a search over every
width verifies its first proposal exactly when that proposal is 4 (its second confidence is then high), so 4 comes
out too often. Each sample is one batch-1 call (a batch's width follows the sum of its rows, which hides one row's
bias); the chi-square is over the first 3 new tokens, as in the tests.

    python scripts/confidence_schedule_check.py [--samples 1000]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from sampling_checks import NUM_NEW, chi_square_p_value, exact_joint, sampled_counts, sampling_target  # noqa: E402
from test_deepspec_drafts import SAMPLED_COSTS, scheduled_sampling_draft  # noqa: E402

import dflash_hf.steps_dflash as steps  # noqa: E402
from dflash_hf.proposer_dflash import DFlashProposer  # noqa: E402

TEMPERATURE = 0.9


def sampled_law(early_stop: bool, samples: int, seed: int) -> tuple[Counter, int]:
    """The first NUM_NEW new tokens of `samples` batch-1 calls, and the proposals they accepted; without
    `early_stop`, every width choice searches all widths."""
    target, input_ids = sampling_target()
    draft = scheduled_sampling_draft(target)
    schedule = steps.worthwhile_width
    if not early_stop:
        steps.worthwhile_width = lambda confidences, counts, costs, early_stop=False: schedule(
            confidences, counts, costs, early_stop=False)
    generator, counts, accepted = torch.Generator().manual_seed(seed), Counter(), 0
    try:
        for _ in range(samples):
            proposer = DFlashProposer(draft, target, target.config.vocab_size - 1, confidence_threshold="auto")
            sampled, kept = sampled_counts(target, proposer, input_ids, generator, num_samples=1,
                                           max_new_tokens=NUM_NEW + 2, block_size=4, temperature=TEMPERATURE,
                                           step_costs=SAMPLED_COSTS)
            for continuation, count in sampled.items():
                counts[continuation[:NUM_NEW]] += count
            accepted += kept
    finally:
        steps.worthwhile_width = schedule
    return counts, accepted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=5)
    arguments = parser.parse_args()
    torch.set_num_threads(1)
    target, input_ids = sampling_target()
    law = exact_joint(target, input_ids, TEMPERATURE, None, None)
    exact_14 = sum(probability for cell, probability in law.items() if cell[:2] == (1, 4))
    for name, early_stop in (("early stop (confidence_threshold='auto')", True), ("search over every width", False)):
        counts, accepted = sampled_law(early_stop, arguments.samples, arguments.seed)
        p_value = chi_square_p_value(counts, law, arguments.samples)
        observed = sum(count for cell, count in counts.items() if cell[:2] == (1, 4)) / arguments.samples
        print(f"{name}: chi-square p = {p_value:.3g} against the target's law ({arguments.samples} samples, "
              f"{accepted} proposals accepted); P(1, 4, ...) {observed:.3f}, target {exact_14:.3f}")


if __name__ == "__main__":
    main()
