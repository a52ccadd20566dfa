"""`keras-amp` console command: `doctor`, `check`, `troubleshoot`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import warnings

# Exit codes of `keras-amp check`.
CLEAN, FINDINGS, BAD_INPUT = 0, 1, 2


def _doctor(args: argparse.Namespace) -> int:
    args.before_tensorflow()
    from keras_amp import doctor

    sections = doctor.collect()
    if args.json:
        print(json.dumps(doctor.as_dict(sections), indent=2))
    else:
        print(doctor.format_report(sections), end="")
    return 0


class _BadInput(Exception):
    """A path, policy or batch `keras-amp check` cannot use (exit code 2)."""


def _one_line(e: BaseException) -> str:
    from keras_amp.diagnostics import user_site

    return user_site.one_line(e)


def _not_a_file(path: str) -> str:
    return f"a folder, not a file: {path}" if os.path.isdir(path) else f"no such file: {path}"


# The first bytes of the files Keras loads: a .keras archive is a zip, a legacy model HDF5.
_ZIP, _HDF5 = b"PK\x03\x04", b"\x89HDF\r\n\x1a\n"


def _load_batch(path: str):
    import numpy as np

    if not os.path.isfile(path):
        raise _BadInput(f"--batch: {_not_a_file(path)}")
    try:
        data = np.load(path, allow_pickle=False)
        if not hasattr(data, "files"):  # a single .npy array: an ndarray, not a context manager
            raise ValueError("a single array, not named arrays")
        with data:
            arrays = {k: data[k] for k in data.files}
    except (OSError, ValueError) as e:
        # NumPy's own text for a zip of other files (a .keras archive) is about pickles: not the point here.
        why = "it holds other files" if "pickle" in str(e) else _one_line(e)
        raise _BadInput(f"--batch: not a NumPy .npz file of arrays 'x' (and optionally 'y'): {path} ({why}); "
                        "write one with numpy.savez(path, x=..., y=...)") from e
    if "x" not in arrays:
        raise _BadInput(f"--batch: the .npz needs an array 'x' (and optionally 'y'). Received: "
                        f"{', '.join(sorted(arrays)) or 'no arrays'}")
    return arrays["x"], arrays.get("y")


def _load_model(path: str, policy: str | None):
    import keras

    import keras_amp

    if policy is not None:
        try:
            keras_amp.enable(policy)
        except (TypeError, ValueError) as e:
            raise _BadInput(f"--policy: {e}") from e
    if not os.path.isfile(path):
        raise _BadInput(_not_a_file(path))
    with open(path, "rb") as f:
        head = f.read(8)
    if not (head.startswith(_ZIP) or head.startswith(_HDF5)):
        raise _BadInput(f"not a Keras model: {path} (a .keras file is a zip archive, a legacy .h5 file HDF5; "
                        f"this one starts with {head!r})")
    try:
        with warnings.catch_warnings():
            # An optimizer saved before its first step: its state is not what `check` reads.
            warnings.filterwarnings("ignore", message="Skipping variable loading for optimizer")
            return keras.saving.load_model(path)
    except Exception as e:  # Keras raises many types for a file that is not a loadable model
        if "safe_mode" in str(e):  # a Lambda layer: Keras's text says to pass an argument this command has not
            raise _BadInput(
                f"{path} holds a Lambda layer (Python code), which keras-amp check does not run. For a model you "
                "trust, in Python: keras_amp.check_model(keras.saving.load_model(path, safe_mode=False), x)") from e
        raise _BadInput(f"not a Keras model, or one that cannot be loaded here: {path} ({_one_line(e)})") from e


def _check(args: argparse.Namespace) -> int:
    args.before_tensorflow()
    from keras_amp.diagnostics import symptoms
    from keras_amp.diagnostics.check import check_model
    from keras_amp.diagnostics.overflow import find_overflow
    from keras_amp.diagnostics.traced_step import REFERENCE_FACTOR

    try:
        if not 0.0 < args.underflow <= 1.0:
            raise _BadInput(f"--underflow must be in (0, 1]. Received: {args.underflow}")
        batch = _load_batch(args.batch) if args.batch else None
        model = _load_model(args.model, args.policy)
    except _BadInput as e:
        print(f"keras-amp check: {e}", file=sys.stderr)
        return BAD_INPUT
    except Exception as e:  # anything else while loading: still bad input, said in one line
        print(f"keras-amp check: cannot load {args.model}: {_one_line(e)}", file=sys.stderr)
        return BAD_INPUT
    x, y = batch if batch is not None else (None, None)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the report states what a warning would
            report = check_model(model, x)
            located = find_overflow(model, x, y) if batch is not None else None
    except Exception as e:  # out-of-range ids, a wrong shape, a model that cannot run: input, not findings
        what = "the batch does not fit the model" if batch is not None else "the model cannot run"
        print(f"keras-amp check: {what}: {_one_line(e)}", file=sys.stderr)
        return BAD_INPUT
    underflowing = located.underflowing(args.underflow) if located is not None else []
    diagnoses = []
    if located is not None and not located.ok:
        diagnoses.append(_overflow_diagnosis(model, located, symptoms))
    if underflowing:
        diagnoses.append(symptoms.diagnose(
            "zero_gradients", {"loss_scaled": located.loss_scale > 1.0, "gradient_underflow": True},
            ", ".join(f"{s.path!r}: {s.gradients.underflow_fraction:.0%} underflowed/subnormal" for s in underflowing),
            layers=[s.path for s in underflowing], probe_scale=f"{located.loss_scale * REFERENCE_FACTOR:g}"))
    clean = report.ok and not diagnoses
    if args.json:
        print(json.dumps(_strict_json({
            "model": report.model,
            "findings": [dataclasses.asdict(f) for f in report.findings],
            "overflow": None if located is None else dataclasses.asdict(located),
            "diagnoses": [str(d) for d in diagnoses],
            "clean": clean,
        }), indent=2, default=str, allow_nan=False))
    else:
        print(report)
        if located is not None:
            print(located)
        for d in diagnoses:
            print(d)
    return CLEAN if clean else FINDINGS


def _strict_json(value):
    """`value` with every non-finite float as the string "nan", "inf" or "-inf": JSON has no NaN or
    Infinity, and a strict parser rejects Python's `NaN` output."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(v) for v in value]
    return value


def _overflow_diagnosis(model, located, symptoms):
    """The non-finite-loss diagnosis of `find_overflow`'s report: the data first, then the scale."""
    import keras

    from keras_amp.diagnostics.traced_step import REFERENCE_FACTOR

    layers = located.offending_layers()
    scaled = isinstance(getattr(model, "optimizer", None), keras.optimizers.LossScaleOptimizer)
    forward = located.forward is not None and located.forward.layer in layers
    facts = {"data_non_finite": bool(located.data), "loss_scaled": scaled,
             # find_overflow ran at the scale training uses: a layer producing inf/NaN there, forward
             # or backward, overflows the steps; a non-finite loss from finite layers does not.
             "scale_at_floor_or_overflowing": forward or located.backward is not None,
             "forward_overflow": forward}
    context = {"layers": layers, "data": "; ".join(f"the --batch {d}" for d in located.data)}
    if scaled:
        context.update(half_scale=f"{located.loss_scale / 2:g}",
                       probe_scale=f"{located.loss_scale * REFERENCE_FACTOR:g}")
    detail = f"find_overflow at loss scale {located.loss_scale:g}"
    if math.isfinite(located.loss) and not located.data:  # the loss is finite: only the backward pass overflows
        then = "the step is skipped" if scaled else "the step puts inf/NaN into the weights"
        detail += f"; the loss ({located.loss:g}) is finite, the backward pass overflows: {then}"
    return symptoms.diagnose("non_finite_loss", facts, detail, **context)


def _symptoms():
    """The decision tree's module: keras_amp's own once keras_amp is imported; otherwise (the
    `keras-amp` command, see keras_amp_console.py) its file executed alone, so that printing the
    tree does not import TensorFlow. `symptoms.py` imports only the standard library."""
    if "keras_amp" in sys.modules:
        from keras_amp.diagnostics import symptoms

        return symptoms
    import keras_amp_console

    return keras_amp_console.load_standalone("diagnostics/symptoms.py", "_keras_amp_console_symptoms")


def _troubleshoot(args: argparse.Namespace) -> int:
    symptoms = _symptoms()
    if args.symptom is not None and args.symptom not in symptoms.SYMPTOM_NAMES:
        print(f"keras-amp troubleshoot: unknown symptom {args.symptom!r}. Allowed: "
              f"{', '.join(symptoms.SYMPTOM_NAMES)}", file=sys.stderr)
        return BAD_INPUT
    if args.markdown:
        print(symptoms.render_markdown(args.symptom), end="")
    else:
        print(symptoms.render_text(args.symptom), end="")
    return 0


def _version() -> str:
    if "keras_amp" in sys.modules:
        from keras_amp.version import __version__

        return __version__
    import keras_amp_console

    return keras_amp_console.load_standalone("version.py", "_keras_amp_console_version").__version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="keras-amp", description="Mixed precision for Keras 3 on TensorFlow.")
    parser.add_argument("--version", action="version", version=f"keras-amp {_version()}")
    sub = parser.add_subparsers(dest="command")  # none given: `main` says so, with any unknown flag
    doctor = sub.add_parser("doctor", help="report versions, devices, oneDNN, TF32 and the policy 'auto' would pick")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.set_defaults(func=_doctor, parser=doctor)

    check = sub.add_parser(
        "check", help="mixed-precision findings for a saved model; with --batch, where it overflows",
        description="Prints check_model's findings for a saved .keras model and, given a batch, "
        "find_overflow's report (the layer producing inf/NaN forward and backward, headroom, "
        "gradient underflow). Exit code 0: clean, 1: findings, 2: bad input.")
    check.add_argument("model", help="path of a .keras model file")
    check.add_argument("--policy", default=None,
                       help="keras_amp.enable() this policy before loading (mixed_float16, mixed_bfloat16, "
                       "float32, auto); saved layers keep the dtype policies they were saved with")
    check.add_argument("--batch", default=None,
                       help="a .npz file with arrays 'x' (inputs) and optionally 'y' (labels)")
    check.add_argument("--underflow", type=float, default=0.5,
                       help="fraction of a layer's gradient elements underflowed to zero or subnormal that counts as a "
                       "finding (default 0.5)")
    check.add_argument("--json", action="store_true",
                       help='print the result as JSON (a non-finite number as "nan", "inf" or "-inf")')
    check.set_defaults(func=_check, parser=check)

    symptoms = _symptoms()
    trouble = sub.add_parser(
        "troubleshoot", help="print the symptom decision tree", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Prints the decision tree from a symptom to what to do. Symptoms:\n"
        + "\n".join(f"  {s.name:<18} {s.title}" for s in symptoms.SYMPTOMS))
    trouble.add_argument("symptom", nargs="?", default=None,
                         help="one of the symptoms above (default: all)")
    trouble.add_argument("--markdown", action="store_true",
                         help="as Markdown: the README's troubleshooting section, or the symptom's part of it")
    trouble.set_defaults(func=_troubleshoot, parser=trouble)
    parser.commands = tuple(sub.choices)  # for `main`'s message when none is given
    return parser


def main(argv: list[str] | None = None, before_tensorflow=None) -> int:
    """Runs the command in `argv`; `before_tensorflow()` runs before a command imports TensorFlow
    (the entry point passes one that keeps TensorFlow's start-up banner out of the output)."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command is None:
        parser.error(f"a command is required ({', '.join(parser.commands)})"
                     + (f"; unrecognized arguments: {' '.join(unknown)}" if unknown else ""))
    if unknown:  # said by the command's parser, with its usage, not the top-level one
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.before_tensorflow = before_tensorflow or (lambda: None)
    try:
        return args.func(args)
    except BrokenPipeError:  # `keras-amp check --json | head`: the reader stopped reading
        # Python would report the pipe again when it flushes stdout at exit: point stdout elsewhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
