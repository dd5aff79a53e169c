"""Differential fuzzing: `draft.spec_generate` against `target.generate` over seeded random cases
(tests/fuzz_cases.py).

    python scripts/fuzz_generate.py --cases 2000 --seed 0 --jobs 1 --report fuzz_report.json
    python scripts/fuzz_generate.py --seed 0 --case 137          # replay one case alone

Case N of a run is drawn from seed + N, so a reported case replays alone with --case N and the same --seed. The
report (JSON) holds the counts (equal / mismatch / refused / crashed) and every mismatch's and crash's case, its
arguments and what differed. Exit status 1 when any case mismatched or crashed.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def quiet() -> None:
    """Silence Transformers' and torch's warnings about tiny random models (noise in a fuzzing run)."""
    import transformers

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    logging.getLogger("torch").setLevel(logging.ERROR)


def run_chunk(indices: list[int], base_seed: int) -> list[dict]:
    """Run the cases `indices` in this process; their results as dicts."""
    from fuzz_cases import run_cases

    return [asdict(result) for result in run_cases(indices, base_seed)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Differential fuzzing of spec_generate against generate.")
    parser.add_argument("--cases", type=int, default=200, help="how many cases (indices 0 .. cases-1)")
    parser.add_argument("--start", type=int, default=0, help="first case index")
    parser.add_argument("--seed", type=int, default=0, help="base seed: case N is drawn from seed + N")
    parser.add_argument("--case", type=int, nargs="*", help="replay only these case indices")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (each runs every jobs-th case)")
    parser.add_argument("--report", type=Path, default=Path("fuzz_report.json"), help="JSON report to write")
    args = parser.parse_args(argv)
    indices = args.case if args.case else list(range(args.start, args.start + args.cases))
    begin = time.perf_counter()
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs, initializer=quiet) as pool:
            chunks = pool.map(run_chunk, [indices[job::args.jobs] for job in range(args.jobs)],
                              [args.seed] * args.jobs)
            results = sorted((result for chunk in chunks for result in chunk), key=lambda result: result["index"])
    else:
        results = run_chunk(indices, args.seed)
    counts = {"equal": 0, "mismatch": 0, "refused": 0, "crashed": 0}
    for result in results:
        counts[result["outcome"]] += 1
    failures = [result for result in results if result["outcome"] in ("mismatch", "crashed")]
    for result in failures:
        result["replay"] = f"python scripts/fuzz_generate.py --seed {args.seed} --case {result['index']}"
    refusals: dict[str, int] = {}
    for result in results:
        if result["outcome"] == "refused":
            reason = result["detail"].split(":", 2)[-1].strip()[:90]
            refusals[reason] = refusals.get(reason, 0) + 1
    seconds = round(time.perf_counter() - begin)
    taus = sorted(result["tau"] for result in results if result["tau"] is not None)
    accepted = {"median_tau": taus[len(taus) // 2] if taus else None,
                "cases_with_tau_over_1.5": sum(tau > 1.5 for tau in taus)}
    report = {"seed": args.seed, "cases": len(results), "counts": counts, "seconds": seconds, "accepted": accepted,
              "refusals": dict(sorted(refusals.items(), key=lambda item: -item[1])), "failures": failures}
    args.report.write_text(json.dumps(report, indent=1))
    print(f"{len(results)} cases in {seconds} s: " + ", ".join(f"{k} {v}" for k, v in counts.items())
          + f"; median tokens per verify {accepted['median_tau']}")
    for result in failures:
        print(f"{result['outcome']}: case {result['index']} ({result['case']['target']} target, "
              f"{result['case']['draft']} draft): {result['detail'][:300]}\n  replay: {result['replay']}")
    return 1 if failures else 0


if __name__ == "__main__":
    quiet()
    sys.exit(main())
