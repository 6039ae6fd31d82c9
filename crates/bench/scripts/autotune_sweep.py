"""The autotune sweep of benches/RESULTS.md (issue 24): `gpufeed bench` over one workload with
--workers 1, 2, 3, 4, the default and auto, the settings in turn within each round; prints each
setting's median steady and whole-run rate and the reasons auto gave.

python3 crates/bench/scripts/autotune_sweep.py records|rows|jpegs ROUNDS
(GPUFEED: the binary, default target/release/gpufeed; JPEGS: the ImageFolder of the jpegs run.)
"""

import json
import os
import statistics
import subprocess
import sys

G = os.environ.get("GPUFEED", "target/release/gpufeed")
WORK = {
    "records": ["--epochs", "4", "--no-baseline"],
    "rows": ["--epochs", "4", "--no-baseline", "--record-bytes", "4096", "--records", "131072"],
    "jpegs": ["--epochs", "3", "--images", os.environ.get("JPEGS", "jpegs"), "--batch-size", "64"],
}
SETTINGS = {
    "w1": ["--workers", "1"],
    "w2": ["--workers", "2"],
    "w3": ["--workers", "3"],
    "w4": ["--workers", "4"],
    "default": [],
    "auto": ["--workers", "auto"],
}


def main() -> None:
    which, rounds = sys.argv[1], int(sys.argv[2])
    unit = "samples" if which == "jpegs" else "bytes"
    results = {name: [] for name in SETTINGS}
    reasons = []
    for _ in range(rounds):
        for name, flags in SETTINGS.items():
            out = subprocess.run(
                [G, "bench", "--json", *WORK[which], *flags],
                capture_output=True,
                text=True,
                check=True,
            )
            d = json.loads(out.stdout)
            results[name].append((d[f"steady_{unit}_per_sec"], d[f"{unit}_per_sec"], d["workers"]))
            if name == "auto":
                reasons.append(d["tuning"]["reason"])
    for name, runs in results.items():
        steady = statistics.median(r[0] for r in runs)
        whole = statistics.median(r[1] for r in runs)
        print(
            f"{which} {name:8s} steady median {steady:,.0f}  whole median {whole:,.0f}  "
            f"workers {[r[2] for r in runs]}  steady {[round(r[0]) for r in runs]}"
        )
    for reason in reasons:
        print("auto:", reason)


if __name__ == "__main__":
    main()
