"""The scheduler asks memory; it does no block arithmetic itself (issue 13).

The scheduler modules' code (docstrings aside) may not count blocks, read
the pool, or drive the block manager or the host pool directly: no ``cdiv``,
no ``//`` or ``%``, no pool counts or block-manager commands. Every such
question goes through :class:`spec.cache_manager.CacheManager`. The checker
itself is shown to fire on the code this replaced.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCHEDULER_MODULES = [
    "spec/scheduler.py",
    "spec/sched_continuous.py",
    "spec/sched_static.py",
    "spec/sched_policy.py",
    "spec/sched_queue.py",
    "spec/sched_types.py",
    "spec/sched_requests.py",
]
FORBIDDEN_CALLS = {
    "cdiv",
    "blocks_for",
    "prompt_block_hashes",
    "BlockManager",
    "BlockPool",
    "HostPool",
    "build_batch",
}
FORBIDDEN_COUNTS = {  # reading any of these is counting blocks
    "pool",
    "block_size",
    "num_blocks",
    "num_host_blocks",
    "num_available",
    "num_free",
    "num_cached",
    "num_held",
}
FORBIDDEN_METHODS = {  # calling any of these is driving memory directly
    "blocks_needed",
    "can_append",
    "append_slots",
    "add_sequence",
    "cached_prefix",
    "tail_waste",
    "block_table",
    "cached_block",
    "ref_count",
    "allocate",
    "free",
    "take_copies",
}
FORBIDDEN_MODULES = {"spec.block_pool", "spec.prefix_cache", "spec.kv_budget"}


def block_arithmetic(source: str) -> list[str]:
    """Each place in ``source`` that counts blocks or touches memory without the cache manager."""
    found = []
    for node in ast.walk(ast.parse(source)):
        where = f"line {getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv | ast.Mod):
            found.append(f"{where}: {type(node.op).__name__}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in FORBIDDEN_CALLS:
                found.append(f"{where}: calls {node.func.id}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in FORBIDDEN_METHODS:
                found.append(f"{where}: calls .{node.func.attr}")
        elif isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_COUNTS:
            found.append(f"{where}: .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module in FORBIDDEN_MODULES:
            found.append(f"{where}: imports {node.module}")
        elif isinstance(node, ast.ImportFrom) and any(a.name == "cdiv" for a in node.names):
            found.append(f"{where}: imports cdiv")
    return found


@pytest.mark.parametrize("module", SCHEDULER_MODULES)
def test_scheduler_modules_do_no_block_arithmetic(module: str) -> None:
    found = block_arithmetic((ROOT / module).read_text())
    assert not found, f"{module} does block arithmetic itself: {found}"


def test_the_check_fires_on_the_code_it_replaced() -> None:
    """The admission check of the old scheduler, verbatim in spirit: counted, not asked."""
    old = """
from spec.block_manager import cdiv

def _swap_in(self, seq, plan):
    k = min(seq.remaining, self._chunk_limit(plan))
    need = cdiv(seq.num_computed + k, self._config.block_size)
    if need > self._manager.pool.num_available:
        return False
    slots = self._manager.append_slots(seq.seq_id, seq.tokens[: seq.num_computed])
    return cached // self._config.block_size
"""
    found = block_arithmetic(old)
    assert any("cdiv" in f for f in found) and any("num_available" in f for f in found)
    assert any("FloorDiv" in f for f in found) and any("append_slots" in f for f in found)


def test_every_scheduler_module_is_checked() -> None:
    """A new scheduler module must join the list (the memory side is the one exception)."""
    spec_files = {str(p.relative_to(ROOT)) for p in (ROOT / "spec").glob("sched*.py")}
    assert spec_files | {"spec/scheduler.py"} == set(SCHEDULER_MODULES)
