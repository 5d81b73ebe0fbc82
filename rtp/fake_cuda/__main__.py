"""``python -m rtp.fake_cuda``: trace the CUDA path with fake CUDA tensors, print the table, exit 1 on a failure.

Options: ``--out FILE`` also writes the table (markdown); ``--only dense|moe|moe-fp8|dense-awq|dense-kv-scales``
limits the models.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

from rtp.fake_cuda.report import default_cases, format_table, make_models, run_case


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rtp.fake_cuda", description=__doc__)
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    parser.add_argument("--only", choices=("dense", "moe", "moe-fp8", "dense-awq", "dense-kv-scales"),
                        help="trace one model only")
    args = parser.parse_args(argv)
    logging.getLogger("rtp").setLevel(logging.WARNING)  # the traced start-ups would log every step
    t0 = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="rtp-fake-cuda-") as tmp:
        models = make_models(Path(tmp))
        for case in default_cases():
            if args.only and case.model != args.only:
                continue
            rows += run_case(case, models[case.model])
    failed = [r for r in rows if r.status == "FAIL"]
    for r in failed:
        for err in r.errors:
            print(f"=== FAIL {r.case.model_label} TP={r.case.tp} {r.case.backend} / {r.stage}, {err}", file=sys.stderr)
    table = format_table(rows)
    summary = (f"{len(rows)} stages: {sum(r.status == 'PASS' for r in rows)} passed, {len(failed)} failed, "
               f"{sum(r.status == 'SKIP' for r in rows)} skipped ({time.perf_counter() - t0:.1f} s)")
    print(table)
    print(summary)
    if args.out is not None:
        args.out.write_text(f"# rtp fake-CUDA dry run\n\n{table}\n\n{summary}\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
