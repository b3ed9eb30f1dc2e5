# This cell fails on purpose: a pool of 2 blocks of 4 cannot hold 10 tokens.
# The spec refuses, says why, and changes nothing. Give it 3 blocks and run again.
from spec.block_manager import BlockManager

m = BlockManager(num_blocks=2, block_size=4)
m.add_sequence(0, [])
m.append_slots(0, list(range(10)))
print("table:", m.block_table(0))
