# One step of the continuous scheduler with a budget of 8 tokens: a 10-token
# prompt is cut into a chunk of 8, and the next request waits for the next step.
from paged_spec.cells import show
from spec.scheduler import ContinuousScheduler, Request, SchedulerConfig

config = SchedulerConfig(num_blocks=8, block_size=4, max_num_batched_tokens=8, max_num_seqs=4)
sched = ContinuousScheduler(config)
sched.submit(Request(request_id=0, prompt=tuple(range(10)), max_new_tokens=2))
sched.submit(Request(request_id=1, prompt=(1, 2, 3), max_new_tokens=1))
out = sched.step()
print("scheduled (sequence, new tokens):", out.scheduled)
print("tokens in the step:", out.batch.num_tokens, "of a budget of", config.max_num_batched_tokens)
print("slot mapping:", out.batch.slot_mapping)
print("sequences that sample a token:", [s.seq_id for s in out.samples])  # prompts done
show(sched.manager, title=f"after step {out.step}: the blocks the scheduler holds")
