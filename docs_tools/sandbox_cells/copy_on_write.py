# After a fork, each sequence writes its own next token (position 10). Block 2 is
# shared and partly filled, so the first writer gets a copy of it.
from paged_spec.cells import show
from spec.block_manager import BlockManager

m = BlockManager(num_blocks=8, block_size=4)
m.add_sequence(0, [])
m.append_slots(0, list(range(10, 20)))
m.take_copies()
m.fork(0, 1)
print("seq 1 writes 42 into slot", m.append_slots(1, [42]))  # gets a copy of block 2
print("seq 0 writes 77 into slot", m.append_slots(0, [77]))  # block 2 is its own now
copies = m.take_copies()
print("copies for the backend, before this step's KV writes:", copies)
for seq in m.sequence_ids():
    print(f"seq {seq}: block table {list(m.block_table(seq))}, last tokens {m.tokens(seq)[8:]}")
show(m, copies=copies)
