"""`keras-amp` console command."""

from __future__ import annotations

import argparse
import json
import sys


def _doctor(args: argparse.Namespace) -> int:
    from keras_amp import doctor

    sections = doctor.collect()
    if args.json:
        print(json.dumps(doctor.as_dict(sections), indent=2))
    else:
        print(doctor.format_report(sections), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="keras-amp", description="Mixed precision for Keras 3 on TensorFlow.")
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="report versions, devices, oneDNN, TF32 and the policy 'auto' would pick")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.set_defaults(func=_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
