# This cell never ends on purpose: press Stop. Python restarts, and every cell
# runs as before.
from spec.block_manager import BlockManager

m = BlockManager(num_blocks=8, block_size=4)
rounds = 0
while True:  # add, grow and free a sequence, forever
    m.add_sequence(0, [])
    m.append_slots(0, list(range(10)))
    m.free(0)
    rounds += 1
    if rounds % 20_000 == 0:
        print(rounds, "rounds, and still", m.pool.num_free, "free blocks")
