# Block size 4: grow sequence 0 to 10 tokens, then read its block table back.
from paged_spec.cells import show
from spec.block_manager import BlockManager

block_size, tokens = 4, 10
m = BlockManager(num_blocks=8, block_size=block_size)
m.add_sequence(0, [])
slots = m.append_slots(0, list(range(10, 10 + tokens)))  # token ids 10, 11, ...
table = m.block_table(0)
print(f"{tokens} tokens of block size {block_size}: {len(table)} blocks, table {list(table)}")
print("slots:", slots)
print("empty slots in the last block:", m.tail_waste(0))
print("free blocks:", m.pool.num_free, "of", m.pool.num_blocks)
show(m)
