# The pitfall: a 20-token prompt at block size 16, forked into a beam of width 4
# before any divergence. How many physical blocks does the beam hold?
from paged_spec.cells import show
from spec.block_manager import BlockManager

m = BlockManager(num_blocks=8, block_size=16)
m.add_sequence(0, [])
m.append_slots(0, list(range(20)))
m.take_copies()  # the prompt's step is laid out
for beam in (1, 2, 3):
    m.fork(0, beam)
print("blocks held with copy-on-write:", m.pool.num_held)
print("blocks four full clones would hold:", sum(len(m.block_table(s)) for s in m.sequence_ids()))
print("reference counts:", [m.pool.ref_count(b) for b in m.block_table(0)])
show(m)
