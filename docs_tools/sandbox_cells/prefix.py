# Two requests start with the same 8-token system prompt (2 full blocks of 4).
# With prefix caching on, the second finds those blocks resident and shares them.
from paged_spec.cells import show
from spec.block_manager import BlockManager

system = list(range(100, 108))
m = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
for user, question in enumerate(([1, 2, 3], [4, 5])):
    prompt = system + question
    cached = m.add_sequence(user, prompt)  # tokens the cache supplies
    m.append_slots(user, prompt[cached:])
    print(
        f"request {user}: {cached} of {len(prompt)} prompt tokens from the cache,"
        f" table {list(m.block_table(user))}"
    )
print("blocks held:", m.pool.num_held, "| hit rate:", round(m.prefix_stats.hit_rate, 3))
show(m)
