# The pitfall: block size 16, a request that ends at 20 tokens. How many blocks
# does it hold, and how many of their slots stay empty? And at block size 4?
from paged_spec.cells import show
from spec.block_manager import BlockManager

for block_size in (16, 4):
    m = BlockManager(num_blocks=8, block_size=block_size)
    m.add_sequence(0, [])
    m.append_slots(0, list(range(20)))
    blocks, empty = len(m.block_table(0)), m.tail_waste(0)
    print(f"block size {block_size:2}: 20 tokens hold {blocks} blocks, {empty} slots empty")
    show(m, title=f"20 tokens at block size {block_size}: {empty} empty slots")
