"""Runs every benchmark in turn (each in its own process, so they never share a warm TF runtime).

    python benchmarks/run_all.py            # the recorded figures (~10 minutes on 2 cores)
    python benchmarks/run_all.py --quick    # a smoke run of each (~2 minutes)
"""

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
QUICK = {
    "bench_loss_scale.py": ["--width", "512", "--blocks", "4", "--block-steps", "20"],
    "bench_layers.py": ["--quick"],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short runs: check they work, not the figures")
    args = parser.parse_args()
    failed = []
    for script, quick_args in QUICK.items():
        print(f"=== {script}", flush=True)
        rc = subprocess.call([sys.executable, str(HERE / script), *(quick_args if args.quick else [])])
        if rc:
            failed.append(script)
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
