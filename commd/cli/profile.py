"""``commd profile``: measure a model's layer sizes and backward times on this machine.

Writes the profile JSON that ``commd simulate``, the planner and the benchmarks read:
``{"name", "source", "forward_s", "layers": [{"name", "bytes", "backward_s"}, ...]}`` with
one layer per trainable parameter tensor, in forward order. See docs/profiles.md.
torch is imported only when the command runs, so ``commd --help`` stays fast without it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from datetime import UTC, datetime
from typing import Any

from commd.models import MODEL_NAMES

__all__ = ["format_profile", "register_command", "run"]

_DESCRIPTION = """\
Measure a model's per-layer gradient sizes and backward times on this machine and write a
profile (JSON) for `commd simulate`, the planner and the benchmarks.

Each trainable parameter tensor is one layer, in forward order; bytes = numel x element size
(float32). backward_s is the time from the previous gradient becoming ready (or from the start
of backward) to this one, the median over the measured iterations; forward_s is the median
forward + loss time. Inputs are synthetic; a warm-up runs first. On a shared or busy machine
the numbers are noisy: profile on an idle one.

How long: one warm-up plus --iterations forward+backward passes. With the defaults (batch 8,
5 iterations, 1 warm-up) resnet50 takes 12-15 s on a 2-core CPU, vgg16 about 40 s,
bert_base about 30 s, small_cnn 2 s; time grows about linearly with --batch-size and
--iterations (batch 32 and 10 iterations: about 100 s for resnet50).
"""

_EPILOG = f"""\
models: {", ".join(MODEL_NAMES)}
examples:
  commd profile --model resnet50 -o resnet50.json            (the defaults: 12-15 s on 2 cores)
  commd profile --model resnet50 --batch-size 16 --iterations 10 --warmup 2 -o resnet50.json
      (as the shipped resnet50 profile was made: bigger batch, steadier medians, < 1 min)
"""


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def register_command(subparsers: Any) -> None:
    """Add the ``profile`` subcommand to the CLI's ``add_subparsers()`` object."""
    p = subparsers.add_parser(
        "profile",
        help="measure a model's layer sizes and backward times (writes a profile JSON)",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # No `choices=`: an unknown model gets commd's one-line message listing the valid ones.
    p.add_argument("--model", required=True, metavar="NAME", help="model to profile (see below)")
    p.add_argument(
        "--batch-size", type=positive_int, default=8, metavar="N", help="per-process batch (8)"
    )
    p.add_argument(
        "--seq-len", type=positive_int, default=128, metavar="N", help="bert_base tokens (128)"
    )
    p.add_argument(
        "--iterations", type=positive_int, default=5, metavar="N", help="measured iterations (5)"
    )
    p.add_argument(
        "--warmup", type=_non_negative, default=1, metavar="N", help="unmeasured iterations (1)"
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to run (cpu)")
    p.add_argument("--name", help="profile name to record (default: the model name)")
    p.add_argument("--output", "-o", metavar="FILE.json", help="write here (default: stdout)")
    p.set_defaults(func=run)


def _err(message: str) -> None:
    print(f"commd: {message}", file=sys.stderr)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _command(args: argparse.Namespace) -> str:
    parts = [
        f"commd profile --model {args.model} --batch-size {args.batch_size}",
        f"--iterations {args.iterations} --warmup {args.warmup} --device {args.device}",
    ]
    if args.model == "bert_base":
        parts.append(f"--seq-len {args.seq_len}")
    return " ".join(parts)


def format_profile(profile: dict[str, Any]) -> str:
    """Profile JSON with one layer per line: readable, and diffs show which layers changed."""
    head = {k: v for k, v in profile.items() if k != "layers"}
    lines = [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
    layers = ",\n".join(f"    {json.dumps(layer)}" for layer in profile["layers"])
    return "{\n" + "\n".join(lines) + '\n  "layers": [\n' + layers + "\n  ]\n}\n"


def _umask() -> int:
    mask = os.umask(0o022)  # the only way to read it is to set it; put it straight back
    os.umask(mask)
    return mask


def _write(text: str, path: str | None) -> None:
    if path is None:
        sys.stdout.write(text)
        return
    # Write-then-rename, so an interrupted run never leaves half a profile behind.
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".profile-", suffix=".json")
    try:
        # mkstemp creates the file 0600; give it the mode a plain open() would: 0666 & ~umask.
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def run(args: argparse.Namespace) -> int:
    """Run ``commd profile``; returns the exit code (2: bad arguments, 1: cannot run here)."""
    if args.model not in MODEL_NAMES:
        _err(f"unknown model {args.model!r}; valid models: {', '.join(MODEL_NAMES)}")
        return 2
    try:
        import torch

        from commd.models.layer_timing import measure
    except ImportError as exc:
        _err(f"profiling needs torch ({exc}); install it with: pip install 'commd[gloo]'")
        return 1
    if args.device == "cuda" and not torch.cuda.is_available():
        _err(f"--device cuda, but torch {torch.__version__} sees no CUDA GPU; use --device cpu")
        return 1

    def progress(step: int, fwd: float, bwd: float) -> None:
        kind = "warm-up" if step < 1 else f"{step}/{args.iterations}"
        print(f"commd: profile {args.model} {kind}: forward {fwd:.3f} s, backward {bwd:.3f} s",
              file=sys.stderr)  # fmt: skip

    m = measure(
        args.model, batch_size=args.batch_size, iterations=args.iterations,
        warmup=args.warmup, device=args.device, seq_len=args.seq_len, progress=progress,
    )  # fmt: skip
    if args.device == "cuda":
        machine = f"GPU {torch.cuda.get_device_name()}"
    else:
        machine = f"{os.cpu_count()}-core CPU ({_cpu_name()}), {torch.get_num_threads()} threads"
    seq = f" x seq {args.seq_len}" if args.model == "bert_base" else ""
    source = (
        f"`{_command(args)}` on a {machine}; torch {torch.__version__}, Python "
        f"{platform.python_version()}, float32, batch {args.batch_size}{seq}, synthetic data; "
        f"median of {args.iterations} iterations after {args.warmup} warm-up; per-layer "
        f"medians scaled by {m.scale:.3f} to sum to the median time from backward start to "
        f"the last gradient ready ({m.backward_s:.4f} s; whole backward() {m.backward_call_s:.4f}"
        f" s); {datetime.now(UTC).date().isoformat()}. Timings are machine-specific and noisy."
    )
    profile = {
        "name": args.name or args.model,
        "source": source,
        "forward_s": round(m.forward_s, 9),
        "layers": [
            {"name": t.name, "bytes": t.bytes, "backward_s": round(t.backward_s, 9)}
            for t in m.layers
        ],
    }
    try:
        _write(format_profile(profile), args.output)
    except OSError as exc:
        _err(f"cannot write the profile to {args.output}: {exc.strerror or exc}")
        return 1
    total = sum(t.bytes for t in m.layers)
    print(f"commd: profile {profile['name']}: {len(m.layers)} layers, {total:,} bytes, backward "
          f"{m.backward_s:.4f} s, forward {m.forward_s:.4f} s"
          + (f" -> {args.output}" if args.output else ""), file=sys.stderr)  # fmt: skip
    return 0
