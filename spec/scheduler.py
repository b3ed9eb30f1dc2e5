"""Continuous batching: which sequences compute which tokens in each step.

The API, for an engine or a simulator that drives a scheduler from outside:

```python
sched = ContinuousScheduler(SchedulerConfig(num_blocks=64, block_size=16))
sched.submit(request)              # CapacityError now if it could never fit
while sched.has_unfinished():
    out = sched.step()             # SchedulerOutput: who computes which tokens, and where
    # run the model on out.batch / out.token_ids (or cost it), then sample
    # one token for every entry of out.samples (all of them share a row's logits
    # when a request forks), and report them:
    done = sched.update({s.seq_id: token for s in out.samples})
sched.metrics                      # spec.metrics.MetricsRecorder: steps and timelines
sched.result(request_id)           # FinishedRequest: each sample's generated tokens
```

Between ``update`` and the next ``step`` a caller may ``submit`` more requests
or ``abort`` one. Any implementation of the :class:`Scheduler` protocol plugs
into the engine, the simulator and ``conformance.scheduler.invariants``.
Every call either completes or raises a :class:`~spec.errors.SpecError` that
names the bad argument, having changed nothing: a refused ``update`` can be
retried, a refused request never enters, and the others carry on.

Each step (:meth:`ContinuousScheduler.step`):

1. **Running sequences first**, best rank first. Each gets the tokens it
   still has to compute, up to the step's token budget
   (``max_num_batched_tokens``) and ``max_chunk_tokens``: a decode is one
   token, a long prompt is cut into chunks. If the pool cannot hold them,
   the worst running sequence not yet scheduled this step is preempted (it
   may be the sequence itself), and its blocks return to the pool at once.
2. **Then, unless something was preempted**, swapped-out and waiting
   sequences are taken in the same order while seats (``max_num_seqs``),
   budget and blocks last; the first that does not fit stops admission, so
   no one overtakes the head of the queue.
3. The step's work is laid out as :class:`spec.batch.BatchMetadata`.

**Who is best** is a rank fixed when a sequence is created
(:mod:`spec.sched_policy`): the arrival order under FCFS; under the priority
policy, priority with aging, where waiting ``aging_steps`` steps is worth one
priority level, so that no stream of better-priority arrivals can keep a
request waiting forever. Because ranks never change, queues are heaps and a
step that can admit no one costs nothing per waiting request.

**Memory is asked, not counted.** Every decision above that needs blocks asks
the memory side (:class:`spec.cache_manager.CacheManager`) a query, then
issues the matching command: ``can_admit``/``admit`` (prefix-cache hits
counted), ``can_grow``/``grow``, ``can_swap_out``/``preempt``,
``can_swap_in``/``swap_in``, ``release``. The scheduler modules compute no
block counts (``tests/test_scheduler_layering.py`` checks their code for it).

A preempted sequence keeps the tokens it generated. By **recomputation** it
goes back to waiting and later recomputes prompt and generated tokens as one
long prefill; by **swapping** its KV moves to a host pool and comes back into
fresh blocks. Either way no sampled token is drawn again.

With ``n > 1`` samples a request runs its prompt once; when the prompt's last
token is computed the request forks (:meth:`BlockManager.fork`): all samples
share the prompt's blocks, and the first write into a shared partial block
copies it. It reserves ``n`` seats from admission, so the fork always fits.

Static batching, the baseline, is :class:`StaticScheduler`: a batch forms,
runs to completion, and only then does the next one form; with
``max_wait_steps > 0`` a batch first waits to fill, as request-level scheduling does
(:mod:`spec.sched_static`).

The code, by role: :mod:`spec.sched_policy` (the configuration and the
rank), :mod:`spec.sched_queue` (the waiting queues),
:mod:`spec.sched_types` (what a step hands out), :mod:`spec.sched_continuous`
(the step's rules), :mod:`spec.sched_static` (static batching) and
:mod:`spec.cache_manager` (the memory side). Import the public names from here.

A worked example: a budget of 8 tokens chunks a 10-token prompt, and a second
request joins as soon as the first is decoding.

>>> sched = ContinuousScheduler(
...     SchedulerConfig(num_blocks=8, block_size=4, max_num_batched_tokens=8, max_num_seqs=4))
>>> sched.submit(Request(request_id=0, prompt=tuple(range(10)), max_new_tokens=2))
>>> out = sched.step()
>>> out.scheduled, out.samples                    # 8 of 10 prompt tokens; nothing to sample yet
(((0, 8),), ())
>>> _ = sched.update({})
>>> sched.submit(Request(request_id=1, prompt=(1, 2, 3), max_new_tokens=1))
>>> out = sched.step()
>>> out.scheduled                                 # the prompt's last 2 tokens, then request 1
((0, 2), (1, 3))
>>> [(s.seq_id, s.request_id) for s in out.samples]
[(0, 0), (1, 1)]
>>> [r.request_id for r in sched.update({0: 42, 1: 7})]     # request 1 is done after 1 token
[1]
>>> sched.step().scheduled, sched.manager.block_table(0)    # request 0 decodes token 42
(((0, 1),), (0, 1, 2))
>>> [(r.request_id, r.outputs) for r in sched.update({0: 43})]
[(0, ((42, 43),))]
>>> sched.has_unfinished(), sched.manager.pool.num_held
(False, 0)
"""

from __future__ import annotations

from spec.request import Request
from spec.sched_continuous import ContinuousScheduler
from spec.sched_policy import SchedulerConfig
from spec.sched_static import StaticScheduler
from spec.sched_types import FinishedRequest, SampleSlot, Scheduler, SchedulerOutput

__all__ = [
    "ContinuousScheduler",
    "FinishedRequest",
    "Request",
    "SampleSlot",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "StaticScheduler",
]
