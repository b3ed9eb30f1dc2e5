"""Continuous batching end to end: a few dozen requests through the engine, checked.

``python -m paged_spec.engine_demo [--backend BACKEND] [--requests N]``

``BACKEND`` is anything the conformance suite's ``--backend`` accepts (one
loader, :func:`conformance.run.discovery.load_backend`): ``triton`` (the default),
``torch``, ``reference``, ``module:factory`` or ``path/to/file.py:factory``,
so a third party's backend runs through the engine exactly as it conforms.

Runs requests of mixed lengths (short chats and long documents, some sharing a
system prompt, some with parallel samples, greedy and sampled) through the
tiny model on a paged KV cache small enough to force preemption, prints the
metrics per request class, then runs every sample alone with contiguous
attention and prints ``identical to unbatched: K/K requests``. Exits 1 if any
request differs. ``--baseline`` also runs the static-batching scheduler.

``python -m paged_spec.engine_demo --beams K`` runs beam search of width ``K``
instead (:mod:`paged_spec.engine.beam_search`): a 20-token prompt, ``--steps`` tokens,
16-token blocks unless ``--block-size`` says otherwise. It prints the
blocks held at every step against full clones of every beam, then runs a
plain beam search with contiguous attention and prints ``identical to
contiguous beam search: K/K``. Exits 1 if any beam differs.

``python -m paged_spec.engine_demo --speculative K`` serves the same requests
with speculative decoding (:mod:`paged_spec.engine.speculative`): a drafter
(``--draft layers``, the model's first layer, or ``--draft ngram``) proposes
up to ``K`` tokens per decoding sequence, each step verifies them in rows of
``1 + k`` tokens. It prints ``identical to unbatched: N/N``,
then runs plain decoding (the same scheduler, no drafts) and prints that the
speculative output equals it token for token, with the acceptance rate and
the steps each took. Exits 1 if either differs.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial

from conformance.errors import SetupError
from conformance.run.discovery import load_backend
from paged_spec._cli import positive_int
from paged_spec.engine.beam_search import contiguous_beam_search, format_steps, paged_beam_search
from paged_spec.engine.loop import Engine
from paged_spec.engine.speculative import LayerSkipDrafter, SpeculativeEngine, ngram_drafter
from paged_spec.engine.tiny_model import TinyModel, generate_alone
from spec.backend import Backend
from spec.errors import CapacityError
from spec.kv_budget import cdiv
from spec.metrics import format_table
from spec.request import Request
from spec.scheduler import ContinuousScheduler, SchedulerConfig, StaticScheduler

SYSTEM_PROMPT = tuple(range(100, 124))  # 24 tokens shared by the chat requests


def make_backend(ref: str) -> Backend:
    """The backend ``ref`` names, through the one loader the conformance suite uses.

    ``ref`` is anything ``python -m conformance run --backend`` accepts: an
    installed name (``reference``, ``torch``, ``triton``), ``module:factory``
    or ``path/to/file.py:factory``. The engine drives the numpy contract, so a
    backend that declares the device-resident one (``tensors="torch"``) is
    refused here, by name, rather than failing inside the first step.
    Raises :class:`conformance.errors.SetupError` saying what to fix.
    """
    backend = load_backend(ref)
    tensors = backend.capabilities.tensors
    if tensors != "numpy":
        raise SetupError(
            f"{ref!r} declares tensors={tensors!r}: the engine drives the numpy contract "
            "(spec/backend.py); build the backend with the default tensors='numpy'"
        )
    return backend


def make_requests(count: int, seed: int) -> tuple[list[Request], dict[int, int]]:
    """Chats (shared system prompt, short) and documents (long prompt); staggered arrivals."""
    rng = random.Random(seed)
    requests, arrivals = [], {}
    for rid in range(count):
        doc = rid % 4 == 3
        user = tuple(rng.randrange(256) for _ in range(rng.randint(2, 12)))
        prompt = tuple(rng.randrange(256) for _ in range(rng.randint(40, 90))) if doc else user
        requests.append(
            Request(
                request_id=rid,
                prompt=prompt if doc else SYSTEM_PROMPT + prompt,
                max_new_tokens=rng.randint(4, 24),
                stop_tokens=frozenset({rng.randrange(256)}),
                n=2 if rid % 7 == 5 else 1,
                temperature=0.0 if rid % 2 else 0.8,
                seed=rid,
                request_class="document" if doc else "chat",
            )
        )
        arrivals[rid] = rid // 3
    return requests, arrivals


def run(
    backend: Backend,
    scheduler_cls: type[ContinuousScheduler],
    config: SchedulerConfig,
    model: TinyModel,
    requests: Sequence[Request],
    arrivals: dict[int, int],
    engine_cls: Callable[..., Engine] = Engine,
) -> Engine:
    engine = engine_cls(model, backend, scheduler_cls(config))
    engine.run(requests, arrivals)
    return engine


def report(name: str, engine: Engine) -> None:
    """The metrics table, with the engine's wall clock as the clock for seconds."""
    ends, metrics = engine.step_end_times, engine.scheduler.metrics
    print(f"\n{name}: {len(ends)} steps in {ends[-1]:.1f} s")
    print(format_table(metrics.summarize(ends), metrics.totals()))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m paged_spec.engine_demo", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--backend",
        default="triton",
        help="triton (default), torch, reference, module:factory or path/to/file.py:factory",
    )
    parser.add_argument("--requests", type=positive_int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-blocks", type=positive_int, default=40)
    parser.add_argument("--block-size", type=positive_int, help="default 8; 16 with --beams")
    parser.add_argument("--preemption", default="recompute", choices=["recompute", "swap"])
    parser.add_argument("--baseline", action="store_true", help="also run static batching")
    parser.add_argument("--beams", type=positive_int, help="run beam search of this width")
    parser.add_argument("--steps", type=positive_int, default=24, help="beam search: tokens")
    parser.add_argument(
        "--speculative", type=positive_int, metavar="K", help="speculative: up to K drafts"
    )
    parser.add_argument(
        "--draft",
        default="layers",
        choices=["layers", "ngram"],
        help="with --speculative: the model's first layer (default) or n-gram lookup",
    )
    args = parser.parse_args(argv)
    try:
        backend = make_backend(args.backend)
    except SetupError as e:  # a spec that names no usable backend: a usage error
        parser.error(f"--backend {args.backend}: {e}")
    torch = sys.modules.get("torch")  # loaded only by a backend that computes with it
    if torch is not None:
        torch.set_num_threads(1)  # tiny matrices: threads only contend
    model = TinyModel()
    if args.beams is not None:
        return beams(args, model, backend)
    args.block_size = args.block_size or 8
    requests, arrivals = make_requests(args.requests, args.seed)
    config = SchedulerConfig(
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_num_batched_tokens=64,
        max_num_seqs=12,
        max_model_len=model.config.max_positions,
        preemption=args.preemption,
        num_host_blocks=2 * args.num_blocks,
        enable_prefix_caching=True,
        num_speculative_tokens=args.speculative or 0,
    )
    engine_cls: Callable[..., Engine] = Engine
    if args.speculative is not None:
        drafter = ngram_drafter if args.draft == "ngram" else LayerSkipDrafter(model)
        engine_cls = partial(SpeculativeEngine, drafter=drafter)
    try:
        engine = run(backend, ContinuousScheduler, config, model, requests, arrivals, engine_cls)
    except CapacityError as e:  # a pool too small for the requests: a usage error
        parser.error(f"--num-blocks {args.num_blocks} x --block-size {args.block_size}: {e}")
    report(f"continuous batching on {args.backend}", engine)
    if args.baseline:
        report("static batching", run(backend, StaticScheduler, config, model, requests, arrivals))

    same = 0
    for r in requests:
        alone = tuple(generate_alone(model, r, i) for i in range(r.n))
        got = engine.finished[r.request_id].outputs
        same += got == alone
        if got != alone:
            print(f"request {r.request_id}: batched {got} != alone {alone}")
    print(f"identical to unbatched: {same}/{len(requests)} requests")
    ok = same == len(requests)
    if args.speculative is not None:
        plain_config = replace(config, num_speculative_tokens=0)
        plain = run(backend, ContinuousScheduler, plain_config, model, requests, arrivals)
        ok &= compare_plain(engine, plain, requests)
    return 0 if ok else 1


def compare_plain(spec: Engine, plain: Engine, requests: Sequence[Request]) -> bool:
    """Print whether speculative decoding generated exactly plain decoding's tokens, the
    acceptance rate and both step counts; True when every token is the same."""
    same = total = 0
    for r in requests:
        got, want = spec.finished[r.request_id].outputs, plain.finished[r.request_id].outputs
        for a, b in zip(got, want, strict=True):
            total += len(b)
            same += sum(x == y for x, y in zip(a, b, strict=False)) if len(a) == len(b) else 0
        if got != want:
            print(f"request {r.request_id}: speculative {got} != plain {want}")
    print(f"speculative output equals plain decoding token for token: {same}/{total} tokens")
    t = spec.scheduler.metrics.totals()
    drafted, accepted = int(t.get("draft_tokens", 0)), int(t.get("accepted_tokens", 0))
    rate = accepted / drafted if drafted else 0.0
    print(
        f"acceptance rate: {rate:.2f} ({accepted} of {drafted} drafts accepted, "
        f"{t.get('accepted_per_step', 0.0):.2f} per step that verified); "
        f"steps: {len(spec.step_end_times)} speculative, {len(plain.step_end_times)} plain"
    )
    return same == total


def beams(args: argparse.Namespace, model: TinyModel, backend: Backend) -> int:
    """The beam search demo: blocks per step, then the check against contiguous beam search."""
    prompt, block_size = tuple(range(100, 120)), args.block_size or 16
    need = max(args.num_blocks, args.beams * (cdiv(len(prompt) + args.steps, block_size) + 1))
    found, record = paged_beam_search(
        model,
        backend,
        prompt,
        args.beams,
        args.steps,
        block_size=block_size,
        num_blocks=need,
    )
    print(
        f"beam search of width {args.beams} on {args.backend}: a {len(prompt)}-token prompt, "
        f"{args.steps} tokens, blocks of {block_size}\n"
    )
    print(format_steps(record))
    plain = contiguous_beam_search(model, prompt, args.beams, args.steps)
    same = sum(a.tokens == b.tokens for a, b in zip(found, plain, strict=True))
    for i, (a, b) in enumerate(zip(found, plain, strict=True)):
        if a.tokens != b.tokens:
            print(f"beam {i}: paged {a.tokens} != contiguous {b.tokens}")
    print(f"\nidentical to contiguous beam search: {same}/{len(plain)}")
    return 0 if same == len(plain) == args.beams else 1


if __name__ == "__main__":
    sys.exit(main())
