"""Engine vs transformers: decode step time at batch 1/8/32 and prefill tokens/s.

Both sides run the same weights in the same dtype on the same device (CPU: the same
threads), forward only (no sampling); on CUDA every timing ends with a synchronize. transformers runs its own forward with its ``DynamicCache`` (and
``logits_to_keep=1`` in prefill, so it too skips the vocabulary projection of
non-final positions). Measurements interleave the two engines and keep each one's best
run (least disturbed by other processes on a shared machine), so background load hits
both alike.

    python -m benchmarks.engine.engine_bench [--quick]
    python -m benchmarks.engine.engine_bench --device cuda [--dtype bfloat16]

Writes benchmarks/results/engine_cpu.md (engine_cuda.md with --device cuda).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.cli import quick_parser
from benchmarks.harness.machine import machine_block
from bundled_models import tiny
from engine.build import build_engine
from engine.config import EngineConfig
from engine.kv.sequence import Sequence
from engine.runner import ModelRunner
from wire.params import SamplingParams

RESULTS = Path(__file__).parents[1] / "results" / "engine_cpu.md"
RESULTS_CUDA = Path(__file__).parents[1] / "results" / "engine_cuda.md"
BATCHES = (1, 8, 32)
CONTEXT = 128  # prompt tokens before the timed decode steps


@dataclass(frozen=True)
class Row:
    model: str
    what: str
    ours: float
    theirs: float
    unit: str
    lower_is_better: bool

    @property
    def ratio(self) -> float:
        """ours / transformers for times, transformers / ours for rates: <= 1 is not slower."""
        return self.ours / self.theirs if self.lower_is_better else self.theirs / self.ours


def _random_model(
    root: Path, name: str, config_cls: Any, vocab: int, sizes: dict[str, int]
) -> Path:
    """A ``config_cls`` decoder of ``sizes`` (``tiny.decoder_sizes``) with tied embeddings
    and random weights (seed 0), saved as ``root / name``."""
    from transformers import AutoModelForCausalLM

    extras = {"max_position_embeddings": 8192, "tie_word_embeddings": True, "dtype": "float32"}
    cfg = config_cls(vocab_size=vocab, **sizes, **extras)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(root / name)
    return root / name


def build_bench_model(root: Path) -> Path:
    """A random Qwen2 of hidden 512, 8 layers (GQA 8/4), on Qwen2's vocabulary."""
    from transformers import Qwen2Config

    sizes = tiny.decoder_sizes(512, 1536, 8, 8, 4)
    return _random_model(root, "qwen2-h512-l8", Qwen2Config, tiny.QWEN2_PADDED_VOCAB, sizes)


def build_smollm2_shape(root: Path) -> Path:
    """SmolLM2-135M's shapes (Llama, hidden 576, 30 layers, GQA 9/3, vocab 49152), random
    weights: the default model's step cost, where its weights cannot be carried."""
    from transformers import LlamaConfig

    return _random_model(
        root, "smollm2-shape", LlamaConfig, 49152, tiny.decoder_sizes(576, 1536, 30, 9, 3)
    )


def best_interleaved(
    fns: list[Callable[[], float]], repeats: int, lower_is_better: bool
) -> list[float]:
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            samples[i].append(fn())
    return [min(s) if lower_is_better else max(s) for s in samples]


def _sync(device: str) -> None:
    if device == "cuda":  # kernels run asynchronously: a timing must wait for their end
        torch.cuda.synchronize()


def _prompts(batch: int, length: int) -> list[list[int]]:
    """Random token ids below the smallest vocabulary of the models above (SmolLM2's 49152):
    an id past a model's vocabulary is a device-side assert in the embedding on CUDA."""
    g = torch.Generator().manual_seed(batch * 1000 + length)
    return torch.randint(0, 49_152, (batch, length), generator=g).tolist()


def _sequences(batch: int, length: int) -> list[Sequence]:
    """``batch`` engine sequences of ``_prompts(batch, length)``, default sampling."""
    prompts = _prompts(batch, length)
    return [Sequence(i, p, sampling=SamplingParams(), block_size=16) for i, p in enumerate(prompts)]


def ours_decode(runner: ModelRunner, batch: int, steps: int) -> Callable[[], float]:
    def run() -> float:
        seqs = _sequences(batch, CONTEXT)
        runner.prefill([(s, s.num_tokens) for s in seqs])
        for s in seqs:
            s.output_ids.append(11)
        _sync(runner.device.type)
        t0 = time.perf_counter()
        for step in range(steps):
            runner.decode(seqs)
            for s in seqs:
                s.output_ids.append(12 + step)
        _sync(runner.device.type)
        elapsed = (time.perf_counter() - t0) / steps
        for s in seqs:
            runner.kv.free_blocks(s)
        return elapsed

    return run


def _hf_cache(model: Any) -> Any:
    """An empty transformers KV cache for ``model``."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def hf_decode(model: Any, batch: int, steps: int) -> Callable[[], float]:
    def run() -> float:
        ids = torch.tensor(_prompts(batch, CONTEXT), device=model.device)
        with torch.inference_mode():
            cache = _hf_cache(model)
            model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            _sync(model.device.type)
            t0 = time.perf_counter()
            for step in range(steps):
                nxt = torch.full((batch, 1), 12 + step, device=model.device)
                model(nxt, past_key_values=cache, use_cache=True)
            _sync(model.device.type)
            return (time.perf_counter() - t0) / steps

    return run


def ours_prefill(runner: ModelRunner, batch: int, length: int) -> Callable[[], float]:
    def run() -> float:
        seqs = _sequences(batch, length)
        _sync(runner.device.type)
        t0 = time.perf_counter()
        runner.prefill([(s, s.num_tokens) for s in seqs])
        _sync(runner.device.type)
        rate = batch * length / (time.perf_counter() - t0)
        for s in seqs:
            runner.kv.free_blocks(s)
        return rate

    return run


def hf_prefill(model: Any, batch: int, length: int) -> Callable[[], float]:
    def run() -> float:
        ids = torch.tensor(_prompts(batch, length), device=model.device)
        with torch.inference_mode():
            _sync(model.device.type)
            t0 = time.perf_counter()
            model(
                ids,
                past_key_values=_hf_cache(model),
                use_cache=True,
                logits_to_keep=1,
            )
            _sync(model.device.type)
            return batch * length / (time.perf_counter() - t0)

    return run


def bench_model(
    name: str, path: Path, quick: bool, device: str = "cpu", dtype: str = "float32"
) -> list[Row]:
    from transformers import AutoModelForCausalLM

    config = EngineConfig(model=str(path), num_kv_blocks=1024, device=device, dtype=dtype)
    runner = build_engine(config).runner
    hf: Any = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    hf = hf.to(torch.device(device)).eval()
    repeats, steps = (2, 4) if quick else (6, 12)
    rows = []
    for batch in BATCHES:
        ours, theirs = best_interleaved(
            [ours_decode(runner, batch, steps), hf_decode(hf, batch, steps)], repeats, True
        )
        rows.append(
            Row(
                name,
                f"decode step, batch {batch}, context {CONTEXT}",
                ours * 1e3,
                theirs * 1e3,
                "ms",
                True,
            )
        )
    pb, pl = (4, 128) if quick else (8, 256)
    ours, theirs = best_interleaved(
        [ours_prefill(runner, pb, pl), hf_prefill(hf, pb, pl)], repeats, False
    )
    rows.append(Row(name, f"prefill {pb} x {pl} tokens", ours, theirs, "tok/s", False))
    return rows


def report(rows: list[Row], command: str, device: str = "cpu", dtype: str = "float32") -> str:
    lines = [
        f"# Engine vs transformers, {device.upper()} forward ({dtype})",
        "",
        f"Command: `{command}`",
        "",
        "Ratio = ours/transformers for step times, transformers/ours for rates: <= 1.0 means",
        "the engine is not slower. Best of interleaved runs (the machine is shared).",
        "",
        "| model | measurement | engine | transformers | unit | ratio |",
        "| --- | --- | ---: | ---: | --- | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r.model} | {r.what} | {r.ours:.2f} | {r.theirs:.2f} | {r.unit} | {r.ratio:.2f} |"
        )
    lines += ["", *machine_block()]
    return "\n".join(lines)


def main() -> None:
    parser = quick_parser(__doc__, "fewer repeats and steps")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument(
        "--models",
        nargs="+",
        choices=("tiny", "h512", "smollm2"),
        default=("tiny", "h512", "smollm2"),
        help="which models to run (smollm2's shape on CUDA only)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        models = []
        if "tiny" in args.models:
            models.append(("tiny qwen2 (h64, 2 layers)", tiny.tiny_model_dir("qwen2")))
        if "h512" in args.models:
            models.append(("random qwen2 (h512, 8 layers)", build_bench_model(Path(tmp))))
        if args.device == "cuda" and "smollm2" in args.models:
            models.append(("SmolLM2-135M shape, random", build_smollm2_shape(Path(tmp))))
        for name, path in models:
            rows.extend(bench_model(name, path, args.quick, args.device, args.dtype))
    command = f"python -m benchmarks.engine.engine_bench --threads {args.threads}"
    command += " --quick" if args.quick else ""
    if set(args.models) != {"tiny", "h512", "smollm2"}:
        command += " --models " + " ".join(args.models)
    if args.device != "cpu" or args.dtype != "float32":
        command += f" --device {args.device} --dtype {args.dtype}"
    text = report(rows, command, args.device, args.dtype)
    if not args.quick:  # a smoke run is no record
        out = RESULTS if args.device == "cpu" else RESULTS_CUDA
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
