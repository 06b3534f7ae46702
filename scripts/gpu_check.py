"""GPU check: every routing algorithm's fused passes against the torch code, their training step
and peak memory against ResNet-18 (eager and compiled), and the paper's model trained against
the clock: one command within 8 minutes on a fresh GPU machine, Triton's compiles included.

Here, once: build the CIFAR-10 subset that travels with the code (the GPU machine has no
CIFAR-10 and no network): 15,000 class-balanced training images and the 1,000 exact test
images, about 43 MiB in ``gpu-data/`` (ignored by git; scripts/make_gpu_check_data.py):

    python scripts/make_gpu_check_data.py --data /path/to/data    # or with $CAPSCTL_DATA set

On the GPU machine, from the repository's root, with ``gpu-data`` carried along. It needs
torch with CUDA, triton and torchvision, and capsctl's own dependencies (typer, rich, pyyaml,
safetensors), used as they are; capsctl itself is not installed there and needs not be: run
it from the tree with ``PYTHONPATH=.``. Nothing is downloaded; the part files go to ``--out``:

    PYTHONPATH=. python scripts/gpu_check.py --plan          # each part's budget: <= 8 min
    PYTHONPATH=. python scripts/gpu_check.py --data-dir gpu-data --out $OUT

Anywhere: ``python scripts/gpu_check.py --summary DIR`` prints the markdown tables of the part
files in DIR (gather the files of several commands in one folder first), ready for the README;
``--dry-run --part all --out DIR`` runs every part on the CPU at toy sizes (batch 2, one timed
step, fewer models in bench and compile, two training steps on a tiny synthetic CIFAR-10 folder
unless ``--data-dir`` is given; torch.compile with the ``aot_eager`` backend, which captures the
graph without generating C++), so CI keeps the script working where no GPU is; its check
part also runs every fused Triton pass forward and backward at small shapes under Triton's
interpreter against the torch code (``kernels`` in its JSON).

Parts (``--part``, repeatable, or ``all``, the default). Each writes ``OUT/gpu-check-<part>.json``,
rewritten atomically after every row (a command stopped at its limit leaves every finished
row), prints its rows as they come, ends with its table and rewrites ``OUT/gpu-check-summary.md``
(the tables of all part files in OUT): at most six files. A row that fails is recorded with its
error and the part goes on. Each part has a budget of seconds from ``--plan``
(scripts/gpu_check_plan.py: derived from the kernels' ahead-of-time report, its compile seconds
and modelled steps, 8 minutes in all); a part starts no row that would end past its budget at
the pace of its slowest row so far, and records those as skipped. The seconds are estimates
until measured:

- ``warm`` (about 2 minutes, nearly all Triton compiling): one training step of every fused row
  the check and the bench parts time, at their sizes and precisions, so that Triton's cache
  holds exactly the variants they launch and no later clock counts a compile.
- ``check`` (under a minute): a forward and backward pass at
  batch 8 of cifar10-caps, cifar10-caps-simple (sequential), cifar10-dynamic-simple,
  cifar10-em-simple and cifar10-self-simple, in fp32 and under bf16 autocast, with the default
  passes (the fused ones on a GPU) and inside ``dispatch.use("chunked")`` (the torch code), same
  seed, weights and batch: the largest difference of the logits and of each parameter's
  gradient relative to the torch code's largest value (a gradient's denominator is at least
  1e-3 of the model's largest gradient, so the near-zero gradients of biases before a BatchNorm
  do not count); which backends ran. ``ok`` in fp32: every difference at most 1e-2. In bf16
  (see :func:`within_bf16`): every difference at most twice the torch code's own bf16 error
  (its bf16 result against its fp32 result, same element, same denominator), plus 1e-2.
- ``bench`` (about a minute): training step and inference at batch 128 (2 warm-up and 5 timed
  steps, the median, through ``capsctl bench``'s code) of ResNet-18 and of cifar10-caps (T=2
  concurrent), cifar10-caps-simple sequential T=2 and T=3, cifar10-dynamic(-simple),
  cifar10-em(-simple) and cifar10-self(-simple), in fp32 and in bf16 autocast + channels_last
  (a model that cannot take channels_last is measured without it, and marked so); the capsule
  models with the default ("fused") passes first, then cifar10-caps and cifar10-caps-simple
  with the torch code; peak GPU memory
  (``torch.cuda.max_memory_allocated``) and both ratios to ResNet-18 in the same setting; the
  backend the routing passes ran (``BenchRow.routing_backend``).
- ``compile`` (about 2 minutes, mostly compiling): bf16 + channels_last + ``torch.compile``
  training steps (no inference) of ResNet-18, cifar10-caps and cifar10-caps-simple
  (sequential), with peak memory.
- ``train`` (``--minutes`` + about 30 s; default 1.5): cifar10-caps, the paper's model, in bf16
  with channels_last on a one-cycle schedule fitted to the minutes (``train.time_limit``; batch
  256, lr 0.2, Nesterov, label smoothing 0.1) on the training images of ``--data-dir`` (default
  ``$CAPSCTL_DATA``, else the repository's ``gpu-data/``; 1,000 held out for validation):
  seconds to 90% and 94% validation accuracy where reached, each epoch as it ends, and the
  accuracy on the data's test file (with gpu-data/, the 1,000 exact test images), labelled
  with the number of training images.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from the tree, as on the GPU machine (PYTHONPATH=.)

if "--dry-run" in sys.argv[1:]:  # before Triton is imported: the dry run's kernels run on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

from capsctl.threads import short_omp_spin  # noqa: E402

short_omp_spin()  # before torch is imported, as the capsctl command does

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from capsctl.atomic import write_text_atomic  # noqa: E402
from capsctl.bench import BenchRow, add_ratios, run_bench  # noqa: E402
from capsctl.compile_cache import use_private_compile_cache  # noqa: E402
from capsctl.config import build_model, resolve_config  # noqa: E402
from capsctl.data.synthetic import write_random_cifar10  # noqa: E402
from capsctl.devices import autocast  # noqa: E402
from capsctl.layers import dispatch  # noqa: E402
from capsctl.memory import keep_freed_memory  # noqa: E402
from capsctl.training import train_from_preset  # noqa: E402
from capsctl.version import __version__  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check_plan import BUDGET_S, REPORT, Rows, load_report, plan, plan_table  # noqa: E402

PARTS = ("warm", "check", "bench", "compile", "train")
TARGETS = (0.90, 0.94)
TOLERANCE = 1e-2  # check: the largest relative difference called ok in float32
BF16_MARGIN = 2.0  # check: bf16 differences against the torch code's own bf16 error (within_bf16)
GRAD_FLOOR = 1e-3  # check: a gradient's denominator, as a share of the model's largest gradient
TRAIN_MODEL = "cifar10-caps"
TRAIN_VAL = 1000


@dataclass(frozen=True)
class Model:
    """A model as the check runs it: a registered name and, for a capsule model, T and the
    schedule (None: its own)."""

    name: str
    iterations: int | None = None
    routing: str | None = None

    @property
    def label(self) -> str:
        if self.routing is None:
            return self.name
        t = f", T={self.iterations}" if self.iterations else ""
        return f"{self.name} ({self.routing}{t})"


RESNET = Model("resnet18")
CAPS = Model("cifar10-caps")  # T=2 concurrent: only the class capsules route
SEQ2 = Model("cifar10-caps-simple", 2, "sequential")
SEQ3 = Model("cifar10-caps-simple", 3, "sequential")
DYN, DYN_S = Model("cifar10-dynamic"), Model("cifar10-dynamic-simple")
EM, EM_S = Model("cifar10-em"), Model("cifar10-em-simple")
SELF, SELF_S = Model("cifar10-self"), Model("cifar10-self-simple")
SEQ = Model("cifar10-caps-simple", None, "sequential")
CHECK_MODELS = (CAPS, SEQ, DYN_S, EM_S, SELF_S)
BENCH_MODELS = (RESNET, CAPS, SEQ2, SEQ3, DYN, DYN_S, EM, EM_S, SELF, SELF_S)
TORCH_BENCH_MODELS = (CAPS, SEQ2)  # the torch code's rows: IDPA's, against its fused passes
COMPILE_MODELS = (RESNET, CAPS, SEQ2)
DRY_BENCH_MODELS = (RESNET, SEQ2, SELF_S)  # the dry run: every code path, fewer models
DRY_COMPILE_MODELS = (SEQ2,)
SETTINGS = {
    "fp32": {"amp": False, "channels_last": False},
    "bf16+cl": {"amp": True, "channels_last": True},
}
PASSES = {"fused": None, "torch": "chunked"}  # the dispatch's default, and use("chunked")


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.summary is not None:
        print(summary(args.summary), flush=True)
        return 0
    budgets = plan(plan_rows(args), load_report(args.report))
    if args.plan:
        print(plan_table(budgets, args.report), flush=True)
        return 0 if sum(b.seconds for b in budgets) <= BUDGET_S else 1
    try:
        import torchvision  # noqa: F401 - the models' backbones
    except ImportError:
        print("gpu_check needs torchvision: pip install torchvision==0.29.1")
        return 1
    keep_freed_memory()  # as the capsctl command does
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; run with --dry-run to check the script on a CPU")
        return 1
    parts = PARTS if not args.part or "all" in args.part else tuple(dict.fromkeys(args.part))
    for model in {*CHECK_MODELS, *BENCH_MODELS, *COMPILE_MODELS}:
        resolve_config(model.name)  # a stale name fails here, also in the dry run
    run = Run.start(args, {b.part: b.seconds for b in budgets})
    print(
        f"gpu_check on {run.meta['device']}, torch {torch.__version__}, triton "
        f"{run.meta['triton']}, parts {', '.join(parts)}" + " (dry run)" * args.dry_run,
        flush=True,
    )
    for name in parts:
        PART_FUNCTIONS[name](run)
        write_text_atomic(args.out / "gpu-check-summary.md", summary(args.out) + "\n")
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", action="append", choices=[*PARTS, "all"], help="default: all")
    ap.add_argument("--out", type=Path, default=Path("gpu-check"), help="default: gpu-check/")
    ap.add_argument(
        "--data-dir", help="the train part's data (default: $CAPSCTL_DATA, else gpu-data/)"
    )
    ap.add_argument("--minutes", type=float, default=1.5, help="the train part's training")
    ap.add_argument("--plan", action="store_true", help="print each part's budget and exit")
    ap.add_argument(
        "--report", type=Path, default=REPORT, help="the kernels' report the plan reads"
    )
    ap.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU (CI)")
    ap.add_argument("--summary", type=Path, metavar="DIR", help="print the tables of DIR's parts")
    return ap.parse_args(argv)


# --- the parts' common frame: sizes, the JSON file, the clock --------------------------------


@dataclass
class Run:
    """What every part shares: the arguments, the device, the sizes and the metadata."""

    args: argparse.Namespace
    device: str
    meta: dict[str, Any]
    budgets: dict[str, float]  # seconds each part may take (gpu_check_plan.py)

    @classmethod
    def start(cls, args: argparse.Namespace, budgets: dict[str, float]) -> Run:
        device = "cpu" if args.dry_run else "cuda"
        args.out.mkdir(parents=True, exist_ok=True)
        if device == "cuda":
            name = torch.cuda.get_device_name()
        else:
            name = f"cpu ({torch.get_num_threads()} threads)"
        meta = {
            "device": name,
            "torch": torch.__version__,
            "triton": _version("triton"),
            "python": platform.python_version(),
            "capsctl": __version__,
            "dry_run": bool(args.dry_run),
            "command": sys.argv,
        }
        return cls(args, device, meta, budgets)

    @property
    def dry(self) -> bool:
        return bool(self.args.dry_run)

    def part(self, name: str, **settings: Any) -> Part:
        return Part(
            name,
            self.args.out / f"gpu-check-{name}.json",
            self.meta,
            settings,
            None if self.dry else self.budgets[name],
        )


class Part:
    """One part's JSON file, rewritten atomically after every row, and its clock: no row
    starts that would end after ``budget_s`` at the pace of the slowest row so far."""

    def __init__(
        self,
        name: str,
        path: Path,
        meta: dict[str, Any],
        settings: dict[str, Any],
        budget_s: float | None,
    ) -> None:
        self.path, self.budget_s, self.t0 = path, budget_s, time.perf_counter()
        self.row_t0, self.slowest = self.t0, 0.0
        self.doc: dict[str, Any] = {
            "part": name,
            **meta,
            "settings": settings,
            "started": time.strftime("%FT%T%z"),
            "seconds": 0.0,
            "done": False,
            "rows": [],
        }
        self.save()

    def out_of_time(self) -> bool:
        if self.budget_s is None:
            return False
        return time.perf_counter() - self.t0 + self.slowest > self.budget_s

    def add(self, row: dict[str, Any]) -> None:
        now = time.perf_counter()
        self.slowest, self.row_t0 = max(self.slowest, now - self.row_t0), now
        self.doc["rows"].append(row)
        self.save()

    def save(self, done: bool = False) -> None:
        self.doc["seconds"] = round(time.perf_counter() - self.t0, 1)
        self.doc["done"] = done
        write_text_atomic(self.path, json.dumps(self.doc, indent=2) + "\n")

    def skipped(self) -> str:
        return f"skipped: it would end after the part's {self.budget_s or 0:.0f} seconds"


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _error(e: BaseException) -> str:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return f"{type(e).__name__}: {str(e).strip()[:600]}"


@contextlib.contextmanager
def _passes(which: str) -> Iterator[None]:
    """The routing passes of ``which`` (a key of :data:`PASSES`) inside the block."""
    backend = PASSES[which]
    with dispatch.use(backend) if backend else contextlib.nullcontext():
        yield


@contextlib.contextmanager
def _tally() -> Iterator[dict[str, int]]:
    """How many routing passes each backend ran inside the block (filled in at its end)."""
    ran: dict[str, int] = {}
    dispatch.reset_ran()
    yield ran
    ran.update(dispatch.ran())


def _backend(ran: dict[str, int]) -> str:
    """The backends of a tally as ``capsctl bench`` writes them ("-": no routing pass ran)."""
    return "+".join(b for b in dispatch.BACKENDS if b in ran) or "-"


# --- warm: Triton's cache filled with the variants the later parts launch ---------------------


def plan_rows(args: argparse.Namespace) -> Rows:
    """What the parts run, for the plan (gpu_check_plan.py)."""
    _, warmup, iters = bench_sizes(False)
    return Rows(
        check=[m.name for m in CHECK_MODELS],
        bench=[(m.name, setting, passes) for m, setting, passes in bench_rows(False)],
        compiled=[m.name for m in COMPILE_MODELS],
        bench_steps=warmup + iters + warmup + iters,  # training, then inference
        train_minutes=args.minutes,
    )


def warm(run: Run) -> None:
    """One training step of every fused row the check and the bench parts will time, at their
    sizes and precisions: Triton compiles each kernel variant they launch here, so that no
    later part's clock counts a compile."""
    batch = check_batch(run.dry)
    part = run.part("warm", check_batch=batch, bench_batch=bench_sizes(run.dry)[0])
    print("\nwarm: one step of each fused row, compiling the Triton kernels it launches")
    steps = [("check", m, "fp32" if not amp else "bf16") for m in CHECK_MODELS for amp in (0, 1)]
    steps += [("bench", m, setting) for m, setting, passes in bench_rows(run.dry)
              if passes == "fused"]  # fmt: skip
    for kind, model, setting in steps:
        row: dict[str, Any] = {"for": kind, "model": model.label, "setting": setting}
        t0 = time.perf_counter()
        if part.out_of_time():
            row["error"] = part.skipped()
        else:
            try:
                if kind == "check":
                    _warm_check(model, setting == "bf16", run.device, batch)
                else:
                    sizes = (bench_sizes(run.dry)[0], 0, 1)
                    _measure(run, model, dict(SETTINGS[setting]), "fused", False, sizes)
            except Exception as e:  # recorded; the part that times it records its own error
                row["error"] = _error(e)
        row["seconds"] = round(time.perf_counter() - t0, 2)
        part.add(row)
        print(f"{kind:<7}{model.label:<38}{setting:<9}{row['seconds']:>7.1f} s  "
              f"{row.get('error', '')}", flush=True)  # fmt: skip
    part.save(done=True)


def _warm_check(model: Model, amp: bool, device: str, batch: int) -> None:
    cfg = resolve_config(model.name)
    net = build_model(cfg).to(device).train()
    if model.iterations is not None or model.routing is not None:
        net.set_routing(model.iterations, model.routing)
    x = torch.randn(batch, cfg.in_channels, cfg.input_size, cfg.input_size, device=device)
    y = torch.zeros(batch, dtype=torch.long, device=device)
    _forward_backward(net, x, y, amp)


# --- check: the fused passes against the torch code ------------------------------------------


def check_batch(dry: bool) -> int:
    return 2 if dry else 8


def check(run: Run) -> None:
    batch = check_batch(run.dry)
    part = run.part(
        "check",
        batch_size=batch,
        tolerance=TOLERANCE,
        bf16_margin=BF16_MARGIN,
        grad_floor=GRAD_FLOOR,
    )
    print(f"\ncheck: forward and backward at batch {batch}, default passes vs the torch code")
    print(f"{'model':<38}{'dtype':<6}{'fused ran':<16}{'logits':>10}{'grads':>10}  ok  worst")
    for model in CHECK_MODELS:
        for dtype in ("fp32", "bf16"):
            row: dict[str, Any] = {"model": model.label, "dtype": dtype}
            if part.out_of_time():
                row["error"] = part.skipped()
            else:
                try:
                    row.update(_compare(model, dtype == "bf16", run.device, batch))
                except Exception as e:  # recorded, the part goes on
                    row["error"] = _error(e)
            part.add(row)
            print(_check_line(row), flush=True)
    if run.dry:
        part.doc["kernels"] = interpreted_kernels()
    part.save(done=True)
    print("\n" + check_table(part.doc["rows"]), flush=True)


#: The dry run's Triton check: each fused pass at small shapes, forward and backward, under
#: Triton's interpreter against the torch code (float32 sums in another order: 1e-4 of the
#: largest value).
KERNEL_TOLERANCE = 1e-4


def interpreted_kernels() -> list[dict[str, Any]]:
    """Every fused Triton pass (routed, weighted, gated, EM's moments and quadratic form) and
    every kernel around them (dynamic routing's squash, EM's E-step on a conv layer's windows,
    a whole EM routing with its M-step, on an FC and a conv layer, the gradient of a conv
    layer's window copy), forward and backward at small shapes, inside
    ``dispatch.use("triton")`` (the interpreter, on the CPU) and inside ``use("chunked")``: one
    row each with the backend that ran (``triton`` only where every kernel of the row ran
    without falling back) and the largest difference relative to the torch code's largest
    value."""
    print("\nkernels: each fused pass under Triton's interpreter vs the torch code")
    rows = []
    for name, make in _KERNEL_CASES.items():
        row: dict[str, Any] = {"pass": name}
        try:
            inputs = make()
            with _tally() as ran, dispatch.use("triton"):
                fused = _pass_outputs(name, inputs)
                kernels = dispatch.fused_ran()
            with dispatch.use("chunked"):
                torch_code = _pass_outputs(name, inputs)
            worst = max(
                float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))
                for a, b in zip(fused, torch_code, strict=True)
            )
            missing = [k for k in _KERNELS_OF.get(name, ()) if not kernels.get(k)]
            backend = "-" if missing else _backend(ran) if ran else "triton"
            row.update(ran=backend, worst=worst, ok=worst <= KERNEL_TOLERANCE and not missing)
        except Exception as e:  # recorded, the next pass goes on
            row.update(error=_error(e), ok=False)
        rows.append(row)
        print(
            f"  {name:<12}{row.get('ran', '-'):<10}{row.get('worst', float('nan')):.1e}  "
            f"{'ok' if row['ok'] else 'FAIL ' + row.get('error', '')}",
            flush=True,
        )
    return rows


def _kernel_inputs(*shapes: tuple[int, ...]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*s, generator=g).requires_grad_() for s in shapes]


# x[J, B, a, x], w[J, x, m, c], p[B, m, a, c], r[J, B, m] with J=5, B=3, a=x=c=4, m=3
_KERNEL_CASES: dict[str, Callable[[], list[torch.Tensor]]] = {
    "routed": lambda: _kernel_inputs((5, 3, 4, 4), (5, 4, 3, 4), (3, 3, 4, 4)),
    "weighted": lambda: _kernel_inputs((5, 3, 4, 4), (5, 4, 3, 4), (5, 3, 3)),
    "gated": lambda: _kernel_inputs((3, 5), (5, 3, 4, 4), (5, 4, 3, 4), (5, 16, 3), (5, 3)),
    "em_moments": lambda: _kernel_inputs((3, 5, 3), (3, 5), (5, 3, 4, 4), (5, 4, 12), (3, 16, 3)),
    "em_quad": lambda: _kernel_inputs((2, 3, 16, 3), (5, 3, 4, 4), (5, 4, 12), (3, 16, 3)),
    # parent poses s[..., d]
    "squash": lambda: _kernel_inputs((3, 5, 16)),
    # quad[B, J, m], c[B, 1, m] of a conv layer: 1 image, 2 types on a 4x4 grid, 3x3 windows
    "e_step": lambda: _kernel_inputs((4, 18, 3), (4, 1, 3)),
    # a whole EM routing, 3 iterations: xs[B, J, a*x], weights [J, x, m, c], activations
    "em_routing": lambda: _kernel_inputs((3, 4, 16), (4, 4, 2, 4), (3, 4)),
    # the same on a conv layer's windows (1 image, 2 types on a 4x4 grid, 3x3 windows: 4 sites
    # of 18 children), each child's assignments normalized over all its windows
    "em_conv": lambda: _kernel_inputs((4, 18, 16), (18, 4, 2, 4), (4, 18)),
    # a conv layer's window copy of poses [b, H, W, n, d] (its gradient gathered per child)
    "windows": lambda: _kernel_inputs((1, 5, 5, 2, 16)),
}
# the kernels around the passes (dispatch.run_fused's names) each row must run
_KERNELS_OF = {
    "gated": ("gate",),
    "squash": ("squash",),
    "e_step": ("e_step", "overlap_max", "overlap_sum"),
    "em_routing": ("m_step", "em_estep_moments"),
    "em_conv": ("m_step", "em_estep_moments", "overlap_lse", "overlap_sum"),
    "windows": ("overlap_sum",),
}


def _pass_outputs(name: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The pass's outputs and the gradients of their sum, on the backend open in the block."""
    from capsctl.layers import (
        WindowGrid,
        e_step,
        em_routing_chunked,
        gated_pass,
        routed_pass,
        squash,
        vote_moments,
        vote_quad,
        weighted_pass,
        window_copy,
    )

    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    if name == "routed":
        outs = list(routed_pass(*leaves, 0.25))[:1]  # S (R is detached)
    elif name == "weighted":
        x, w, r = leaves
        outs = [weighted_pass(x, w, r.softmax(-1))]
    elif name == "gated":
        act, x, w, wr, br = leaves
        outs = [t for t in gated_pass(act.sigmoid(), x, w, wr, br)[:2]]
    elif name == "em_moments":
        r, act, x, wc, shift = leaves
        outs = list(vote_moments(r.softmax(-1), act.sigmoid(), x, wc, shift))
    elif name == "em_quad":
        qp, x, wc, shift = leaves
        outs = [vote_quad(qp, x, wc, shift)]
    elif name == "squash":
        outs = [squash(leaves[0])]
    elif name == "e_step":
        quad, c = leaves
        grid = WindowGrid.of(torch.zeros(1, 4, 4, 2), 3, 1)
        r = e_step(quad.abs() * 1.0, c, grid)  # quad is consumed: a fresh tensor
        # each child's R sums to 1: weigh them, or their sum's gradient would be 0
        outs = [r * torch.randn(r.shape, generator=torch.Generator().manual_seed(1))]
    elif name == "windows":
        win = window_copy(leaves[0], 3, 2)  # [B, J, d]
        outs = [win * torch.randn(win.shape, generator=torch.Generator().manual_seed(2))]
    else:
        xs, w, act = leaves
        beta = torch.zeros(2)
        grid = WindowGrid.of(torch.zeros(1, 4, 4, 2), 3, 1) if name == "em_conv" else None
        outs = em_routing_chunked(
            xs, w * 0.3, act.sigmoid(), beta, beta, 3, 1.0, rows=4, grid=grid
        )[:2]  # fmt: skip
        outs = list(outs)
    grads = torch.autograd.grad(sum(o.sum() for o in outs), leaves, allow_unused=True)
    return [*(o.detach() for o in outs), *(g for g in grads if g is not None)]


def _compare(model: Model, amp: bool, device: str, batch: int) -> dict[str, Any]:
    cfg = resolve_config(model.name)
    torch.manual_seed(0)
    net = build_model(cfg).to(device).train()
    if model.iterations is not None or model.routing is not None:
        net.set_routing(model.iterations, model.routing)
    state = copy.deepcopy(net.state_dict())
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, cfg.in_channels, cfg.input_size, cfg.input_size, generator=gen)
    y = torch.randint(0, cfg.num_classes, (batch,), generator=gen)
    x, y = x.to(device), y.to(device)
    with _tally() as fused_ran:
        fused = _forward_backward(net, x, y, amp)
    net.load_state_dict(state)
    with _passes("torch"), _tally() as torch_ran:
        ref = _forward_backward(net, x, y, amp)
    diffs = _differences(fused, ref)
    worst = max(diffs, key=lambda k: (k != "logits", diffs[k]))
    row = {
        "fused_ran": _backend(fused_ran),
        "torch_ran": _backend(torch_ran),
        "logits_max_abs_diff": float((fused[0] - ref[0]).abs().max()),
        "logits_rel": diffs["logits"],
        "grads_rel": max(v for k, v in diffs.items() if k != "logits"),
        "grads_worst": worst,
    }
    if not amp:
        row["ok"] = max(diffs.values()) <= TOLERANCE
        return row
    net.load_state_dict(state)
    with _passes("torch"):
        own = _differences(ref, _forward_backward(net, x, y, False), like=ref)
    row["bf16_error_rel"] = max(own.values())  # the torch code's bf16 against its fp32
    row["ok"] = within_bf16(diffs, own)
    return row


def _differences(
    got: tuple[torch.Tensor, dict[str, torch.Tensor]],
    want: tuple[torch.Tensor, dict[str, torch.Tensor]],
    like: tuple[torch.Tensor, dict[str, torch.Tensor]] | None = None,
) -> dict[str, float]:
    """The largest difference of the logits (key ``"logits"``) and of each parameter's gradient
    between ``got`` and ``want``, relative to the largest value of ``like`` (default ``want``);
    a gradient's denominator is at least :data:`GRAD_FLOOR` of the largest gradient."""
    ref_logits, ref_grads = like if like is not None else want
    top = max(float(g.abs().max()) for g in ref_grads.values())
    den = max(float(ref_logits.abs().max()), 1e-30)
    out = {"logits": float((got[0] - want[0]).abs().max()) / den}
    for name, ref in ref_grads.items():
        den = max(float(ref.abs().max()), GRAD_FLOOR * top, 1e-30)
        out[name] = float((got[1][name] - want[1][name]).abs().max()) / den
    return out


def within_bf16(diffs: dict[str, float], own: dict[str, float]) -> bool:
    """Whether the fused passes' bf16 results ``diffs`` (against the torch code's bf16 ones)
    are within what bf16 itself explains, value by value (the logits and each gradient).

    bf16 keeps 8 significant bits: each rounding is off by up to ``2**-8`` of its value, and a
    computation ``L`` roundings deep by about ``L * 2**-8`` of it, times the condition of its
    sums (a gradient that is a sum of terms which nearly cancel loses more). Rather than guess
    ``L`` and the condition of every gradient, the check measures their product: ``own`` is the
    torch code's bf16 result against its float32 result, for the same values and with the same
    denominators. The fused passes run in float32 inside and round to bf16 at the same places
    as the torch code, so both bf16 results lie within ``own`` of the float32 one, and within
    ``2 * own`` of each other (:data:`BF16_MARGIN`); :data:`TOLERANCE` is added for what stays
    float32 in both (there, ``own`` is about 0)."""
    return all(v <= BF16_MARGIN * own[k] + TOLERANCE for k, v in diffs.items())


def _forward_backward(
    net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, amp: bool
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    net.zero_grad(set_to_none=True)
    with autocast(x.device, amp):
        logits = net(x)
    F.cross_entropy(logits.float(), y).backward()
    grads = {
        n: p.grad.detach().float().clone() for n, p in net.named_parameters() if p.grad is not None
    }
    return logits.detach().float(), grads


def _check_line(row: dict[str, Any]) -> str:
    head = f"{row['model']:<38}{row['dtype']:<6}"
    if "error" in row:
        return head + row["error"]
    return (
        f"{head}{row['fused_ran']:<16}{row['logits_rel']:>10.1e}{row['grads_rel']:>10.1e}"
        f"  {'yes' if row['ok'] else 'NO ':<4}{row['grads_worst']}"
    )


# --- bench and compile: training steps against ResNet-18 ------------------------------------


def bench_rows(dry: bool) -> list[tuple[Model, str, str]]:
    """``(model, setting, passes)`` of each bench row in order: the fused rows first (the
    targets; ResNet-18 first in each setting, the rows' yardstick), then the torch code's."""
    models = DRY_BENCH_MODELS if dry else BENCH_MODELS
    torch_models = [m for m in models if m != RESNET] if dry else TORCH_BENCH_MODELS
    rows = [(m, setting, "fused") for setting in SETTINGS for m in models]
    return rows + [(m, setting, "torch") for setting in SETTINGS for m in torch_models]


def bench_sizes(dry: bool) -> tuple[int, int, int]:
    """Batch, warm-up and timed steps of a bench row."""
    return (2, 1, 1) if dry else (128, 2, 5)


def bench(run: Run) -> None:
    batch, warmup, iters = sizes = bench_sizes(run.dry)
    part = run.part("bench", batch_size=batch, warmup=warmup, iters=iters)
    print(f"\nbench: training step and inference at batch {batch}, median of {iters}")
    print(BENCH_HEADER)
    refs: dict[str, BenchRow | None] = {}
    for model, setting, passes in bench_rows(run.dry):
        row, measured = _bench_row(
            part, run, model, setting, passes, False, sizes, refs.get(setting)
        )
        if model == RESNET:
            refs[setting] = measured
        part.add(row)
        print(_bench_line(row), flush=True)
    part.save(done=True)
    print("\n" + bench_table(part.doc["rows"], []), flush=True)


def compile_part(run: Run) -> None:
    batch, warmup, iters = (2, 1, 1) if run.dry else (128, 2, 5)
    models = DRY_COMPILE_MODELS if run.dry else COMPILE_MODELS
    backend = "aot_eager" if run.dry else "inductor"
    part = run.part("compile", batch_size=batch, warmup=warmup, iters=iters, backend=backend)
    use_private_compile_cache()  # as capsctl bench --compile does
    print(f"\ncompile: bf16+cl training step under torch.compile ({backend}), batch {batch}")
    print(BENCH_HEADER)
    ref: BenchRow | None = None
    for model in models:
        with _compile_backend(backend):
            sizes = (batch, warmup, iters)
            row, measured = _bench_row(part, run, model, "bf16+cl", "fused", True, sizes, ref)
        torch._dynamo.reset()  # the next model compiles afresh, the last one's graphs freed
        if model == RESNET:
            ref = measured
        part.add(row)
        print(_bench_line(row), flush=True)
    part.save(done=True)
    print("\n" + bench_table([], part.doc["rows"]), flush=True)


@contextlib.contextmanager
def _compile_backend(backend: str) -> Iterator[None]:
    """``torch.compile`` with ``backend`` inside the block (what run_bench calls)."""
    original = torch.compile
    if backend != "inductor":
        torch.compile = functools.partial(original, backend=backend)  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.compile = original  # type: ignore[assignment]


def _bench_row(
    part: Part,
    run: Run,
    model: Model,
    setting: str,
    passes: str,
    compiled: bool,
    sizes: tuple[int, int, int],
    ref: BenchRow | None,
) -> tuple[dict[str, Any], BenchRow | None]:
    """One measured row (its error instead where it failed) with its ratios to ``ref``
    (ResNet-18 in the same setting), and what run_bench returned."""
    row: dict[str, Any] = {"setting": setting, "passes": passes, "compiled": compiled}
    row["name"] = model.label
    if part.out_of_time():
        return {**row, "error": part.skipped()}, None
    flags = dict(SETTINGS[setting])
    try:
        measured = _measure(run, model, flags, passes, compiled, sizes)
    except Exception as e:  # recorded, the part goes on
        if not flags["channels_last"] or "channels_last" not in str(e):
            return {**row, "error": _error(e)}, None
        row["channels_last_error"] = _error(e)  # measured without it, and said so
        flags["channels_last"] = False
        try:
            measured = _measure(run, model, flags, passes, compiled, sizes)
        except Exception as e2:
            return {**row, "error": _error(e2)}, None
    measured.name = model.label
    add_ratios([measured], ref)
    row.update(measured.to_dict(), memory_ratio=None)  # routing_backend: what the passes ran
    if ref is not None and measured.peak_device_bytes and ref.peak_device_bytes:
        row["memory_ratio"] = measured.peak_device_bytes / ref.peak_device_bytes
    return row, measured


def _measure(
    run: Run,
    model: Model,
    flags: dict[str, bool],
    passes: str,
    compiled: bool,
    sizes: tuple[int, int, int],
) -> BenchRow:
    batch, warmup, iters = sizes
    with _passes(passes):
        (row,) = run_bench(
            [model.name],
            batch_size=batch,
            warmup=warmup,
            iters=iters,
            device=run.device,
            iterations=model.iterations,
            routing=model.routing,
            infer=not compiled,
            compile=compiled,
            **flags,
        )
    return row


BENCH_HEADER = (
    f"{'model':<38}{'setting':<9}{'passes':<8}{'ran':<9}{'step':>10}{'ratio':>8}"
    f"{'infer/s':>9}{'peak':>11}{'ratio':>7}"
)


def _bench_line(row: dict[str, Any]) -> str:
    head = f"{row['name']:<38}{row['setting']:<9}{row['passes']:<8}"
    if "error" in row:
        return head + row["error"]
    ips = row.get("infer_images_per_s")
    return (
        f"{head}{row.get('routing_backend') or '-':<9}{_ms(row['train_step_s']):>10}"
        f"{_x(row['train_ratio']):>8}{f'{ips:.0f}' if ips else '-':>9}"
        f"{_mib(row['peak_device_bytes']):>11}{_x(row['memory_ratio']):>7}"
    )


# --- train: the paper's model against the clock ----------------------------------------------


def train(run: Run) -> None:
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        carried = REPO / "gpu-data"
        data_dir = run.args.data_dir or os.environ.get("CAPSCTL_DATA")
        if data_dir is None and (carried / "cifar10").is_dir():
            data_dir = str(carried)
        if run.dry and run.args.data_dir is None:
            data_dir = str(write_random_cifar10(Path(tmp) / "data", train=64, test=16))
        overrides = _train_overrides(run, data_dir)
        part = run.part(
            "train",
            model=TRAIN_MODEL,
            overrides=overrides,
            data_dir=data_dir,
            subset=_subset(data_dir),
        )
        part.doc["epochs"] = []
        how = "two steps at batch 8" if run.dry else f"{run.args.minutes:g} minutes, bf16 + cl"
        print(f"\ntrain: {TRAIN_MODEL}, {how}, data from {data_dir}")
        print(f"{'epoch':>6}{'seconds':>9}{'train loss':>12}{'val acc':>9}{'lr':>9}")
        minutes = None if run.dry else run.args.minutes  # the dry run: two steps
        row: dict[str, Any] = {"model": TRAIN_MODEL, "minutes": minutes}
        try:
            row.update(_fit(part, overrides, Path(tmp) / "run"))
        except Exception as e:  # recorded
            row["error"] = _error(e)
            print(row["error"], flush=True)
        part.add(row)
    part.save(done=True)
    print("\n" + train_table(part.doc["rows"]), flush=True)


def _train_overrides(run: Run, data_dir: str | None) -> list[str]:
    overrides = [f"train.device={run.device}"]
    if data_dir is not None:
        overrides.append(f"data.data_dir={data_dir}")
    if run.dry:
        return [
            *overrides,
            "data.val_size=16",
            "train.epochs=1",
            "train.steps_per_epoch=2",
            "train.batch_size=8",
            "train.eval_batch_size=16",
            "train.time_limit=null",
        ]
    return [
        *overrides,
        f"data.val_size={TRAIN_VAL}",
        "data.download=false",
        "train.amp=true",
        "train.channels_last=true",
        "train.schedule=onecycle",
        "train.epochs=1000",  # more than fit: the clock ends the run, the schedule follows it
        "train.batch_size=256",
        "train.eval_batch_size=500",
        "train.lr=0.2",
        "train.nesterov=true",
        "train.label_smoothing=0.1",
        f"train.time_limit={run.args.minutes * 60:.0f}",
    ]


def _subset(data_dir: str | None) -> dict[str, Any] | None:
    """What scripts/make_gpu_check_data.py wrote about the training subset, if it wrote it."""
    path = Path(data_dir or ".") / "cifar10" / "subset.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _fit(part: Part, overrides: list[str], out: Path) -> dict[str, Any]:
    reached: dict[float, float] = {}
    data: dict[str, Any] = {}
    t0 = time.perf_counter()

    def on_event(e: dict[str, Any]) -> None:
        if e.get("event") == "data":
            data.update({k: e[k] for k in ("train", "val", "test", "test_name") if k in e})
            part.doc["data"] = dict(data)
            part.save()
        if e.get("event") != "epoch_end":
            return
        seconds, acc = time.perf_counter() - t0, e.get("val_accuracy")
        for target in TARGETS:
            if acc is not None and acc >= target and target not in reached:
                reached[target] = seconds
        epoch = {
            "epoch": e.get("epoch"),
            "seconds": round(seconds, 1),
            "val_accuracy": acc,
            "train_loss": e.get("train_loss"),
            "lr": e.get("lr"),
        }
        part.doc["epochs"].append(epoch)
        part.save()
        print(
            f"{epoch['epoch']:>6}{seconds:>9.0f}{_f(epoch['train_loss'], 12, '.3f')}"
            f"{_f(acc, 9, '.2%')}{_f(epoch['lr'], 9, '.3f')}",
            flush=True,
        )

    result = train_from_preset(
        TRAIN_MODEL, out=out, overrides=overrides, on_event=on_event, handle_sigint=False
    )
    test = result.test
    return {
        "train_images": data.get("train"),
        "val_images": data.get("val"),
        "epochs": result.epochs_done,
        "seconds": result.seconds,
        "seconds_to": {f"{t:.2f}": reached.get(t) for t in TARGETS},
        "best_val_accuracy": result.best_val_accuracy,
        "test_accuracy": test.accuracy if test is not None else None,
        "test_set": test.dataset if test is not None else data.get("test_name"),
        "test_images": data.get("test"),
    }


# --- the tables (markdown) -------------------------------------------------------------------


def summary(folder: Path) -> str:
    """The markdown tables of the part files in ``folder``."""
    docs = {}
    for name in PARTS:
        path = folder / f"gpu-check-{name}.json"
        if path.is_file():
            docs[name] = json.loads(path.read_text())
    if not docs:
        return f"no gpu-check-<part>.json in {folder}"
    first = next(iter(docs.values()))
    lines = [
        f"GPU check on {first['device']}: torch {first['torch']}, triton {first['triton']}, "
        f"capsctl {first['capsctl']}" + " (dry run)" * bool(first.get("dry_run")),
    ]
    for name, doc in docs.items():
        if not doc.get("done"):
            lines.append(
                f"(part {name} did not finish: {len(doc['rows'])} rows in {doc['seconds']:.0f} s)"
            )
    bench_rows = docs.get("bench", {}).get("rows", [])
    compile_rows = docs.get("compile", {}).get("rows", [])
    if bench_rows or compile_rows:
        batch = (docs.get("bench") or docs["compile"])["settings"]["batch_size"]
        lines += [
            "",
            f"Training step at batch {batch} (median) and its ratio to ResNet-18 in "
            "the same setting; peak GPU memory and its ratio (fused: the default passes; "
            "torch: the torch code, dispatch.use('chunked'))",
            "",
            bench_table(bench_rows, compile_rows),
        ]
    if "check" in docs:
        lines += [
            "",
            "The default passes against the torch code (forward and backward, "
            "largest relative difference)",
            "",
            check_table(docs["check"]["rows"]),
        ]
    if "train" in docs:
        lines += ["", train_table(docs["train"]["rows"] or _unfinished_train(docs["train"]))]
    if "warm" in docs:
        warmed = docs["warm"]["rows"]
        failed = sum(1 for r in warmed if "error" in r)
        lines += ["", f"Warm-up (Triton's compiles): {len(warmed)} steps in "
                  f"{docs['warm']['seconds']:.0f} s, {failed} failed or skipped"]  # fmt: skip
    return "\n".join(lines)


def _unfinished_train(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The train part's row from its epochs so far, where it did not finish."""
    epochs, data = doc.get("epochs") or [], doc.get("data", {})
    if not epochs:
        return []
    accs = [e["val_accuracy"] for e in epochs if e["val_accuracy"] is not None]
    to = {
        f"{t:.2f}": next((e["seconds"] for e in epochs if (e["val_accuracy"] or 0) >= t), None)
        for t in TARGETS
    }
    return [
        {
            "model": doc["settings"]["model"],
            "minutes": None,
            "train_images": data.get("train"),
            "val_images": data.get("val"),
            "epochs": f"{len(epochs)} (unfinished)",
            "seconds_to": to,
            "best_val_accuracy": max(accs, default=None),
            "test_accuracy": None,
            "test_set": "not reached",
            "test_images": None,
        }
    ]


def bench_table(rows: list[dict[str, Any]], compiled: list[dict[str, Any]]) -> str:
    """One line per model: its training step and ratio in each setting and passes, the backend
    the fused rows ran, peak memory (eager and compiled); columns with no figure left out."""
    by = {(r["name"], r["setting"], r["passes"], r["compiled"]): r for r in [*rows, *compiled]}
    steps = [(s, p, False) for s in SETTINGS for p in PASSES] + [("bf16+cl", "fused", True)]
    peaks = [(s, "fused", False) for s in SETTINGS] + [("bf16+cl", "fused", True)]
    head = ["model", "ran"] + [_column(k) for k in steps] + ["ran compiled"]
    head += ["peak " + _column(k) for k in peaks]
    table = []
    for name in dict.fromkeys(r["name"] for r in [*rows, *compiled]):
        cells = [name, _ran(rows, name)]
        cells += [_step_cell(by.get((name, *k))) for k in steps] + [_ran(compiled, name)]
        table.append(cells + [_peak_cell(by.get((name, *k))) for k in peaks])
    keep = [i for i in range(len(head)) if i == 0 or any(r[i] not in ("", "-") for r in table)]
    out = ["| " + " | ".join(head[i] for i in keep) + " |", "|" + "---|" * len(keep)]
    out += ["| " + " | ".join(r[i] for i in keep) + " |" for r in table]
    return "\n".join(out)


def _column(key: tuple[str, str, bool]) -> str:
    setting, passes, compiled = key
    return f"{setting} compiled" if compiled else f"{setting} {passes}"


def _ran(rows: list[dict[str, Any]], name: str) -> str:
    """The backends the fused rows of ``name`` ran, "-" where none routes or none said."""
    ran = {r.get("routing_backend") for r in rows if r["name"] == name and r["passes"] == "fused"}
    return ", ".join(sorted(b for b in ran if b)) or "-"


def check_table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| model | dtype | fused ran | logits | gradients (worst parameter) "
        "| torch code's own bf16 error | ok |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['model']} | {r['dtype']} | {_cell_error(r['error'])} | | | | |")
            continue
        out.append(
            f"| {r['model']} | {r['dtype']} | {r['fused_ran']} | {r['logits_rel']:.1e} | "
            f"{r['grads_rel']:.1e} ({r['grads_worst']}) | {_own(r)} | "
            f"{'yes' if r['ok'] else 'NO'} |"
        )
    return "\n".join(out)


def _own(row: dict[str, Any]) -> str:
    """The bf16 row's own error of the torch code ("-" for fp32 rows)."""
    own = row.get("bf16_error_rel")
    return "-" if own is None else f"{own:.1e}"


def train_table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| model | training images | minutes | epochs | to 90% val | to 94% val | best val "
        "| test |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['model']} | {r['error'][:300].replace('|', '/')} | | | | | | |")
            continue
        to = [_f(r["seconds_to"][f"{t:.2f}"], 0, ".0f") for t in TARGETS]
        to = [f"{t} s" if t != "-" else t for t in to]
        test = "-"
        if r["test_accuracy"] is not None:
            test = f"{r['test_accuracy']:.2%} on {_n(r['test_images'])} ({r['test_set']})"
        out.append(
            f"| {r['model']} | {_n(r['train_images'])} (+{_n(r['val_images'])} val) | "
            f"{_f(r['minutes'], 0, 'g')} | {r['epochs']} | {to[0]} | {to[1]} | "
            f"{_f(r['best_val_accuracy'], 0, '.2%')} | {test} |"
        )
    return "\n".join(out)


def _step_cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return ""
    if "error" in row:
        return _cell_error(row["error"])
    cell = f"{_ms(row['train_step_s'])} ({_x(row['train_ratio'])})"
    return cell + " (no cl)" * ("channels_last_error" in row)


def _peak_cell(row: dict[str, Any] | None) -> str:
    if row is None or "error" in row or not row.get("peak_device_bytes"):
        return "-" if row is not None and "error" not in row else ""
    return f"{_mib(row['peak_device_bytes'])} ({_x(row['memory_ratio'])})"


def _cell_error(error: str) -> str:
    return ("skipped" if error.startswith("skipped") else error.split(":")[0]).replace("|", "/")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _mib(n: int | None) -> str:
    return "-" if not n else f"{n / 2**20:,.0f} MiB"


def _n(count: int | None) -> str:
    return "?" if count is None else f"{count:,}"


def _f(value: float | None, width: int, spec: str) -> str:
    return f"{'-' if value is None else format(value, spec):>{width}}"


PART_FUNCTIONS: dict[str, Callable[[Run], None]] = {
    "warm": warm,
    "check": check,
    "bench": bench,
    "compile": compile_part,
    "train": train,
}

if __name__ == "__main__":
    sys.exit(main())
