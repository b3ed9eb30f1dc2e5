# Fork sequence 0 into sequence 1: the child gets the same block ids, and every
# block gains a holder. No KV is copied.
from paged_spec.cells import show
from spec.block_manager import BlockManager

m = BlockManager(num_blocks=8, block_size=4)
m.add_sequence(0, [])
m.append_slots(0, list(range(10, 20)))
m.take_copies()  # the step that computes these tokens is laid out: now a fork may follow
m.fork(0, 1)
for seq in m.sequence_ids():
    print(f"seq {seq}: block table {list(m.block_table(seq))}")
print("reference counts:", [m.pool.ref_count(b) for b in m.block_table(0)])
print("blocks held:", m.pool.num_held, "(the same 3: nothing was copied)")
show(m)
